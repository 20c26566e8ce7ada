"""ds_config parsing: the seed config, a catalogue of bad configs, "auto", batch arithmetic, LR schedules.

Comparisons with DeepSpeed's own DeepSpeedConfig on real files are in test_config_deepspeed.py.
"""

import copy
import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from pipezero.train.config import ConfigError, parse_config
from pipezero.train.config.optim import (SchedulerConfig, SchedulerType, WarmupType, build_optimizer,
                                         build_scheduler, lr_at)

SEED = Path(__file__).resolve().parents[1] / "examples" / "configs" / "seed_ds_config.json"


def _seed():
    return json.loads(SEED.read_text())


def test_seed_config_verbatim():
    cfg = parse_config(SEED, world_size=4, hidden_size=64)
    scaler = cfg.precision.scaler
    assert cfg.compute_dtype == torch.float16 and scaler.dynamic and scaler.min_scale == 1e-5
    assert scaler.init_scale == 2.0 ** 16 and scaler.clip_grad_norm == cfg.gradient_clipping == 1.0
    assert cfg.zero.stage == 3 and cfg.zero.overlap_comm
    assert cfg.zero.offload_optimizer and cfg.zero.offload_param
    assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_size, cfg.batch.accumulation_steps) == (32, 8, 1)
    assert cfg.steps_per_print == 100 and not cfg.wall_clock_breakdown
    assert cfg.zero.reduce_bucket_size == 64 * 64
    assert cfg.zero.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert cfg.zero.stage3_param_persistence_threshold == 640


def test_a_typical_deepspeed_user_config():
    raw = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "gradient_clipping": 1.0,
           "steps_per_print": 2000, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                             "warmup_num_steps": 100, "total_num_steps": 1000}},
           "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                 "sub_group_size": 1e9, "reduce_bucket_size": 5e8,
                                 "stage3_prefetch_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e6,
                                 "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                 "stage3_gather_16bit_weights_on_model_save": True},
           "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "gpt_small"}}
    cfg = parse_config(raw, world_size=8)
    assert cfg.batch.train_batch_size == 4 * 8 * 8 and cfg.gradient_clipping == 1.0
    assert cfg.scheduler.type is SchedulerType.WARMUP_DECAY_LR and cfg.scheduler.total_num_steps == 1000
    assert cfg.zero.stage3_param_persistence_threshold == 1_000_000 and cfg.compute_dtype == torch.bfloat16
    assert (cfg.tensorboard.enabled, cfg.tensorboard.output_path, cfg.tensorboard.job_name) == (
        True, "logs/", "gpt_small")


def test_one_reader_per_section():
    """parse_config and the packages' own from_config read a section through the same reader."""
    from pipezero.precision import LossScaler
    from pipezero.zero import ZeroOptimizer

    raw = _seed()
    raw["zero_optimization"].update(allgather_partitions=True, reduce_bucket_size=5e8)
    cfg = parse_config(raw, world_size=4, hidden_size=64)
    param = torch.nn.Parameter(torch.zeros(2))
    scaler = LossScaler.from_config(torch.optim.SGD([param], lr=0.1), raw["fp16"], clip_grad_norm=1.0)
    assert scaler.config == cfg.precision.scaler
    zero = ZeroOptimizer.from_config(torch.optim.SGD([param], lr=0.1), {**raw["zero_optimization"], "stage": 2},
                                     hidden_size=64)
    assert zero.config == dataclasses.replace(cfg.zero, stage=2, offload_param=False, overlap_comm=True)
    empty = ZeroOptimizer.from_config(torch.optim.SGD([param], lr=0.1), {})
    assert empty.config == parse_config({"train_batch_size": 1}).zero  # DeepSpeed's defaults on both paths
    assert (empty.config.stage, empty.config.reduce_bucket_size, empty.config.overlap_comm) == (0, 500_000_000, False)


def test_deepspeed_defaults_spellings_and_coercions():
    cfg = parse_config({"train_batch_size": 8, "fp16": {"enabled": "true"}, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 2e8, "prefetch_bucket_size": "1000", "param_persistence_threshold": 1e4,
        "max_live_parameters": 1e9, "gather_16bit_weights_on_model_save": False, "cpu_offload": True,
        "offload_param": {"device": "cpu", "pipeline_read": False, "pipeline_write": False}},
        "prescale_gradients": False, "aio": {"block_size": 1048576}})
    assert cfg.gradient_clipping == 1.0 and cfg.compute_dtype == torch.float16  # DeepSpeed's default clip
    z = cfg.zero
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        200_000_000, 1000, 10_000)
    assert z.offload_optimizer and z.offload_param and z.overlap_comm
    below = parse_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {
        "device": "cpu"}}}).zero
    assert not below.offload_param  # ignored below stage 3, as DeepSpeed ignores it
    bf16 = parse_config({"train_batch_size": 8, "bf16": {"enabled": True}}).precision.scaler
    assert bf16.checks_finite and bf16.is_noop  # DeepSpeed's check_grad_overflow default


def test_auto_resolves_from_the_callers_values():
    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto", "sub_group_size": "auto"}}
    values = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
              "bf16.enabled": True, "optimizer.params.lr": 1e-4, "optimizer.params.betas": [0.9, 0.95],
              "optimizer.params.eps": 1e-6, "optimizer.params.weight_decay": 0.1,
              "scheduler.params.warmup_num_steps": 5, "scheduler.params.total_num_steps": 50}
    cfg = parse_config(hf, world_size=4, hidden_size=32, auto_values=values)
    assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_size, cfg.batch.accumulation_steps) == (24, 2, 3)
    assert cfg.gradient_clipping == 0.5 and cfg.compute_dtype == torch.bfloat16
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.scheduler.warmup_max_lr, cfg.scheduler.warmup_min_lr) == (
        1e-4, (0.9, 0.95), 1e-4, 0.0)
    assert cfg.zero.reduce_bucket_size == 32 * 32 and cfg.zero.stage3_param_persistence_threshold == 320
    with pytest.raises(ConfigError, match=r'sets train_batch_size and .*"auto".*auto_values'):
        parse_config(hf, world_size=4, hidden_size=32)  # never "sets neither": it says what resolves them
    with pytest.raises(ConfigError, match=r'\["gradient_clipping"\] is "auto".*auto_values=\{"gradient_clipping"'):
        parse_config(hf, world_size=4, hidden_size=32, auto_values={k: v for k, v in values.items()
                                                                     if k != "gradient_clipping"})
    with pytest.raises(ConfigError, match=r'\["reduce_bucket_size"\] is "auto": pass hidden_size='):
        parse_config(hf, world_size=4, auto_values=values)


def test_explicit_sizes_are_kept_and_5e8_is_an_int():
    raw = _seed()
    raw["zero_optimization"].update(reduce_bucket_size=5e8, stage3_prefetch_bucket_size=123)
    zero = parse_config(raw, hidden_size=8).zero
    assert zero.reduce_bucket_size == 500_000_000 and isinstance(zero.reduce_bucket_size, int)
    assert zero.stage3_prefetch_bucket_size == 123 and zero.stage3_param_persistence_threshold == 80


@pytest.mark.parametrize("keys, world, pipe, expect", [
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, 1, (32, 4, 2)),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, 6, 2, (48, 4, 4)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 8, 4, (30, 3, 5)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, 4, 1,
     (24, 2, 3)),
    ({"train_batch_size": 16}, 2, 1, (16, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 2}, 4, 2, (4, 2, 1)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "pipeline": {"stages": 2, "micro_batches": 4}}, 4, None, (16, 2, 4)),
])
def test_batch_arithmetic(keys, world, pipe, expect):
    raw = dict(keys)
    if pipe is not None:
        raw["pipeline"] = {"stages": pipe}
    b = parse_config(raw, world_size=world).batch
    assert (b.train_batch_size, b.micro_batch_size, b.accumulation_steps) == expect
    assert b.train_batch_size == b.micro_batch_size * b.accumulation_steps * b.data_degree


def _with(path, value):
    """The seed config with one key (a tuple path) set, or deleted when value is _DEL."""
    raw = copy.deepcopy(_seed())
    *parents, last = path
    node = raw
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DEL:
        del node[last]
    else:
        node[last] = value
    return raw


_DEL = object()

# (path, value, world, words the error must contain): each a config a user could plausibly write
BAD = [
    (("train_batch_size",), 30, 4, ["train_batch_size", "30", "4"]),
    (("train_batch_size",), -1, 1, ["train_batch_size", "-1"]),
    (("train_batch_size",), "thirty-two", 1, ["train_batch_size", "integer"]),
    (("train_micro_batch_size_per_gpu",), 3, 4, ["train_batch_size", "32", "3", "4", "12"]),
    (("gradient_accumulation_steps",), 3, 1, ["train_batch_size", "32", "gradient_accumulation_steps 3"]),
    (("gradient_accumulation_steps",), 0.5, 1, ["gradient_accumulation_steps", "integer"]),
    (("train_batch_size",), _DEL, 1, ["train_micro_batch_size_per_gpu", "at least one"]),
    (("fp16", "enabled"), "maybe", 1, ['["fp16"]["enabled"]', "true or false"]),
    (("fp16", "enabled"), "yes", 1, []),  # DeepSpeed reads "yes" (and "true", 1, "on") as true
    (("fp16", "opt_level"), "O2", 1, ['["fp16"]["opt_level"]', "not a key of DeepSpeed's"]),
    (("fp16", "loss_scale"), -2, 1, ['["fp16"]["loss_scale"]', "-2"]),
    (("fp16", "loss_scale_window"), 0, 1, ["loss_scale_window", ">= 1"]),
    (("fp16", "hysterisis"), 2, 1, ['"hysterisis"', 'did you mean "hysteresis"']),
    (("fp16", "fp16_master_weights_and_grads"), True, 1, ["fp16_master_weights_and_grads", "fp32"]),
    (("bf16",), {"enabled": True}, 1, ["fp16", "bf16", "at most one"]),
    (("zero_optimization", "stage"), 4, 1, ['["zero_optimization"]["stage"]', "4", "3"]),
    (("zero_optimization", "stage"), 2, 1, []),  # offload_param below stage 3: ignored with a warning
    (("zero_optimization", "zero_quantized_weights"), True, 1, ["zero_quantized_weights", "ZeRO++",
                                                                "is not supported by pipezero"]),
    (("zero_optimization", "offload_optimizer", "device"), "nvme", 1, ["nvme", "cpu"]),
    (("zero_optimization", "offload_optimizer", "device"), "gpu", 1, ["device", "'gpu'", "'cpu'"]),
    (("zero_optimization", "offload_param", "nvme_path"), "/nvme", 1, []),  # unused without NVMe
    (("zero_optimization", "cpu_offload"), True, 1, ["cpu_offload", "offload_optimizer"]),
    (("zero_optimization", "reduce_bucket_size"), "big", 1, ["reduce_bucket_size", "'big'", "integer"]),
    (("zero_optimization", "allgather_bucket_size"), "auto", 1, []),  # DeepSpeed's default applies
    (("zero_optimization", "overlap_com"), True, 1, ['"overlap_com"', 'did you mean "overlap_comm"']),
    (("zero_optimization",), [3], 1, ['["zero_optimization"]', "JSON object"]),
    (("gradient_clipping",), "auto", 1, ["gradient_clipping", 'auto_values={"gradient_clipping"']),
    (("gradient_clipping",), -1.0, 1, ["gradient_clipping", "-1.0"]),
    (("steps_per_print",), 0, 1, ["steps_per_print", "0"]),
    (("wall_clock_breakdown",), "often", 1, ["wall_clock_breakdown", "true or false"]),
    (("tensorboard", "output_path"), 3, 1, ["output_path", "string"]),
    (("tensorboard", "job"), "x", 1, ['["tensorboard"]["job"]', "job_name"]),
    (("optimizer",), {"type": "SGD"}, 1, ['["optimizer"]["type"]', "'SGD'", "'AdamW'"]),
    (("optimizer", "params"), {"lr": 1e-3, "betas": [0.9]}, 1, ["betas", "two numbers"]),
    (("optimizer", "params"), {"lr": "auto"}, 1, ['["lr"]', 'auto_values={"optimizer.params.lr"']),
    (("optimizer", "params"), {"amsgrad": True}, 1, ['["amsgrad"]', "AMSGrad", "is not supported by pipezero"]),
    (("scheduler",), {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, 1,
     ["total_num_steps", "required"]),
    (("scheduler",), {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}, 1,
     ["total_num_steps", "5", "warmup_num_steps = 10"]),
    (("scheduler",), {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, 1, ["warmup_type", "'log'"]),
    (("scheduler",), {"params": {}}, 1, ['["scheduler"]["type"] is required', "WarmupCosineLR"]),
    (("scheduler",), {"type": "OneCycle"}, 1, ['["scheduler"]["type"]', "'OneCycle'", "'WarmupLR'"]),
    (("scheduler",), {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}, 1, ["cos_min_ratio"]),
    (("pipeline", "stages"), 3, 4, ["stages", "3", "world size 4"]),
    (("pipeline", "schedule"), "2f2b", 1, ["schedule", "'1f1b'", "'zbv'"]),
    (("pipeline", "chunks"), 2, 1, ["chunks", "1f1b", "interleaved_1f1b"]),
    (("pipeline", "schedule"), "zbv", 1, []),  # fine on its own: zbv defaults to chunks=2
    (("pipeline", "micro_batches"), 4, 1, ["micro_batches", "4", "gradient_accumulation_steps", "1"]),
    (("pipeline", "partition_method"), "type:[", 1, ["partition_method", "regex"]),
    (("pipeline", "partition_method"), "by_size", 1, ["partition_method", "type:<regex>"]),
    (("pipeline", "partition_method"), [1, -2, 1], 1, ["partition_method", "per-layer costs", ">= 0"]),
    (("pipeline", "partition_method"), [0.0, 1.5, 7.4], 1, []),  # per-layer costs are accepted
    (("amp",), {"enabled": True}, 1, ['["amp"]', "fp16 or bf16"]),
    (("activation_checkpointing",), {"partition_activations": True}, 1, []),  # tensor 1: nothing to split
    (("sparse_attention",), {"mode": "fixed"}, 1, ['["sparse_attention"]', "is not supported by pipezero"]),
    (("my_own_key",), 1, 1, []),  # in no DeepSpeed version: DeepSpeed ignores it, pipezero warns
    (("train_micro_batch_size_per_gpuu",), 8, 1, ['did you mean "train_micro_batch_size_per_gpu"']),
    (("train_batch_sise",), 32, 1, ['"train_batch_sise"', 'did you mean "train_batch_size"']),
]


@pytest.mark.parametrize("path, value, world, words", BAD)
def test_bad_config_names_the_key(path, value, world, words):
    raw = _with(path, value)
    if not words:  # the control case of the catalogue: this one must parse
        parse_config(raw, world_size=world, hidden_size=64)
        return
    with pytest.raises(ConfigError) as err:
        parse_config(raw, world_size=world, hidden_size=64)
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_catalogue_size():
    assert sum(1 for *_, words in BAD if words) >= 25


def test_bad_file_and_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match="bad.json.*not valid JSON"):
        parse_config(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="path to ds_config.json or a dict"):
        parse_config(42)


def test_ignored_keys_warn_once_and_noop_values_are_silent(caplog, monkeypatch):
    # warn_once is per process: start this test with none seen, whatever ran before it
    import pipezero.config_fields as fields

    monkeypatch.setattr(fields, "_WARNED", set())
    monkeypatch.setattr(logging.getLogger("pipezero"), "propagate", True)  # train/log may have stopped it
    raw = _with(("dump_state",), True)
    raw["zero_optimization"]["round_robin_gradients"] = True
    raw["zero_optimization"]["parameter_alignment"] = False  # DeepSpeed's default: changes nothing, silent
    raw["my_note_to_self"] = "x"  # a key of no DeepSpeed version
    with caplog.at_level(logging.WARNING, logger="pipezero"):
        parse_config(raw, hidden_size=64)
        parse_config(raw, hidden_size=64)
    # one record each: a record object that reached the capture twice (a handler another test left
    # higher up the logger tree) is still one warning
    text = [r.getMessage() for r in {id(r): r for r in caplog.records}.values()]
    assert sum("dump_state" in t for t in text) == 1
    assert sum("round_robin_gradients" in t for t in text) == 1
    assert sum("my_note_to_self" in t and "any DeepSpeed version" in t for t in text) == 1
    assert not any("parameter_alignment" in t for t in text)


def test_pipeline_section_and_bfloat16_alias():
    raw = {"train_batch_size": 16, "bfloat16": {"enabled": True},
           "pipeline": {"stages": 2, "schedule": "Interleaved_1F1B", "chunks": 2, "micro_batches": 4,
                        "activation_checkpoint_interval": 1, "partition_method": "type:Block"}}
    cfg = parse_config(raw, world_size=4)
    assert cfg.compute_dtype == torch.bfloat16
    assert cfg.pipeline.schedule == "interleaved_1f1b"
    assert (cfg.pipeline.chunks, cfg.batch.accumulation_steps, cfg.batch.micro_batch_size) == (2, 4, 2)
    with pytest.raises(ConfigError, match="bfloat16"):
        parse_config({**raw, "bf16": {"enabled": True}}, world_size=4)


def test_adam_means_adamw_unless_adam_w_mode_false():
    p = [torch.nn.Parameter(torch.zeros(2))]
    base = {"train_batch_size": 1}
    adam = {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1}}
    opt = parse_config({**base, "optimizer": adam}).optimizer
    assert type(build_optimizer(opt, p)) is torch.optim.AdamW
    opt = parse_config({**base, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer
    assert type(build_optimizer(opt, p)) is torch.optim.Adam
    built = build_optimizer(parse_config({**base, "optimizer": {"type": "AdamW", "params": {
        "lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.5}}}).optimizer, p)
    g = built.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.01, (0.8, 0.9), 1e-6, 0.5)
    assert not g["fused"]  # torch's fused kernel on CUDA only (DeepSpeed's FusedAdam); its default elsewhere
    if torch.cuda.is_available():
        assert build_optimizer(opt, [torch.nn.Parameter(torch.zeros(2, device="cuda"))]).param_groups[0]["fused"]


def test_lr_schedules_run_step_s_at_iteration_s_minus_1():
    """DeepSpeed's convention (test_config_deepspeed.py checks it against its classes): the first two
    optimizer steps run at the start value, then the ramp; WarmupDecayLR decays to warmup_min_lr."""
    lin = SchedulerConfig(type=SchedulerType.WARMUP_LR, warmup_num_steps=4, warmup_type=WarmupType.LINEAR,
                          warmup_min_lr=0.0, warmup_max_lr=1.0)
    assert [lr_at(lin, s, 9.0) for s in range(7)] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    log = SchedulerConfig(type=SchedulerType.WARMUP_LR, warmup_num_steps=8, warmup_max_lr=2.0)
    assert lr_at(log, 4, 0.0) == pytest.approx(2.0 * math.log(4) / math.log(8))
    decay = SchedulerConfig(type=SchedulerType.WARMUP_DECAY_LR, warmup_num_steps=2, total_num_steps=6,
                            warmup_type=WarmupType.LINEAR, warmup_min_lr=0.2, warmup_max_lr=1.0)
    assert [lr_at(decay, s, 0.0) for s in range(9)] == pytest.approx(
        [0.2, 0.2, 0.6, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    cos = SchedulerConfig(type=SchedulerType.WARMUP_COSINE_LR, warmup_num_steps=2, total_num_steps=6,
                          warmup_type=WarmupType.LINEAR, warmup_min_ratio=0.5, cos_min_ratio=0.1)
    ratio = lambda progress: 0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2  # noqa: E731
    got = [lr_at(cos, s, 2.0) for s in (0, 1, 2, 3, 5, 7, 10)]
    assert got == pytest.approx([0.0, 1.0, 1.5, 2.0 * ratio(0.25), 2.0 * ratio(0.75), 0.2, 0.2])


def test_scheduler_drives_the_optimizer_and_resumes():
    raw = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
           "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "total_num_steps": 10,
                                                               "warmup_type": "linear"}}}
    cfg = parse_config(raw)
    opt = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    sched = build_scheduler(cfg.scheduler, opt)
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(5):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([lr_at(cfg.scheduler, s, 0.5) for s in range(6)])
    state = json.loads(json.dumps(sched.state_dict()))  # JSON, for the checkpoint manifest
    opt2 = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    sched2 = build_scheduler(cfg.scheduler, opt2)
    sched2.load_state_dict(state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(seen[-1])
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_at(cfg.scheduler, 6, 0.5))


def test_a_shortened_misspelling_of_a_top_level_key_is_a_typo_not_a_foreign_key():
    from pipezero.config_fields import _near_miss

    batch = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
    assert _near_miss("trian_micro_batch", batch) == "train_micro_batch_size_per_gpu"
    assert _near_miss("my_custom_key", batch) is None and _near_miss("steps", batch) is None
