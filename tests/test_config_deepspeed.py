"""parse_config against DeepSpeed 0.19.8's own DeepSpeedConfig on real ds_config files (tests/ds_configs).

DeepSpeed is a test-only reference (CI installs it with DS_BUILD_OPS=0); these tests skip without it.
Configs written for the Hugging Face Trainer hold "auto" values that the Trainer's integration
fills before DeepSpeed reads the file, so DeepSpeed gets the file filled by Hugging Face's rules
for one set of Trainer arguments (_HF_ARGS), and pipezero gets the file as written plus the same
arguments as `auto_values` and `hidden_size`. Every file DeepSpeed accepts must be accepted with
the same resolved values, or refused only as an unsupported DeepSpeed feature; nothing crashes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from pipezero.config_fields import ConfigError
from pipezero.train.config import parse_config

deepspeed = pytest.importorskip("deepspeed")
from deepspeed import comm as ds_comm  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

CORPUS = sorted((Path(__file__).parent / "ds_configs").glob("*.json"))
HIDDEN = 64
# what a Trainer run would pass: per-device batch, accumulation, max_grad_norm, AdamW's and the schedule's
_HF_ARGS = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            "optimizer.params.lr": 3e-5, "optimizer.params.betas": [0.9, 0.99], "optimizer.params.eps": 1e-6,
            "optimizer.params.weight_decay": 0.01, "scheduler.params.warmup_num_steps": 10,
            "scheduler.params.total_num_steps": 100, "fp16.enabled": False, "bf16.enabled": True}
_HF_ZERO = {"reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
            "stage3_param_persistence_threshold": 10 * HIDDEN}


def _trainer_args(raw: dict) -> dict:
    """_HF_ARGS made consistent with the file's explicit batch keys (the Trainer refuses a mismatch)."""
    args = dict(_HF_ARGS)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if isinstance(raw.get(key), int):
            args[key] = raw[key]
    return args


def _hf_filled(raw: dict, world: int) -> dict:
    """The file as the Hugging Face integration hands it to DeepSpeed (its documented fill rules)."""
    cfg = copy.deepcopy(raw)
    args = _trainer_args(raw)
    args["train_batch_size"] = world * args["train_micro_batch_size_per_gpu"] * args["gradient_accumulation_steps"]
    args["scheduler.params.warmup_min_lr"] = 0
    args["scheduler.params.warmup_max_lr"] = args["optimizer.params.lr"]
    args.update({f"zero_optimization.{k}": v for k, v in _HF_ZERO.items()})
    for path, value in args.items():
        *parents, last = path.split(".")
        node = cfg
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) == "auto":
            node[last] = value
    return cfg


def _deepspeed(cfg: dict, world: int) -> DeepSpeedConfig:
    """DeepSpeedConfig on CPU with no process group: its world size and rank come from deepspeed.comm."""
    with mock.patch.object(ds_comm, "get_world_size", lambda *a, **k: world), \
            mock.patch.object(ds_comm, "get_rank", lambda *a, **k: 0):
        return DeepSpeedConfig(copy.deepcopy(cfg))


def _accepting_world(raw: dict) -> tuple[int, DeepSpeedConfig] | None:
    """The largest of 8, 4, 2, 1 processes at which DeepSpeed accepts the file, with its config."""
    for world in (8, 4, 2, 1):
        try:
            return world, _deepspeed(_hf_filled(raw, world), world)
        except Exception:  # noqa: BLE001 - any refusal by DeepSpeed
            continue
    return None


def _theirs(ds: DeepSpeedConfig) -> dict:
    zero, fp16, bf16 = ds.zero_config, ds.float16_config, ds.bfloat16_config
    stage = int(zero.stage)
    offload_opt = zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu" and stage >= 1
    offload_param = zero.offload_param is not None and zero.offload_param.device == "cpu" and stage == 3
    dtype = torch.float16 if fp16.enabled else torch.bfloat16 if bf16.enabled else torch.float32
    out = {"batch": (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps),
           "clip": float(ds.gradient_clipping), "stage": stage, "reduce_bucket_size": zero.reduce_bucket_size,
           "prefetch": zero.prefetch_bucket_size, "persistence": zero.param_persistence_threshold,
           "overlap_comm": bool(zero.overlap_comm), "offload": (offload_opt, offload_param), "dtype": dtype}
    if fp16.enabled:
        dynamic = fp16.loss_scale == 0
        out["scale"] = (dynamic, float(2 ** fp16.initial_scale_power if dynamic else fp16.loss_scale))
        if dynamic:
            out["dynamic"] = (fp16.loss_scale_window, fp16.hysteresis, float(fp16.min_loss_scale),
                              fp16.consecutive_hysteresis)
    if bf16.enabled:
        out["check_grad_overflow"] = bf16.check_grad_overflow
    return out


def _ours(raw: dict, world: int) -> dict:
    cfg = parse_config(raw, world_size=world, hidden_size=HIDDEN, auto_values=_trainer_args(raw))
    b, z, s = cfg.batch, cfg.zero, cfg.precision.scaler
    out = {"batch": (b.train_batch_size, b.micro_batch_size, b.accumulation_steps), "clip": cfg.gradient_clipping,
           "stage": z.stage, "reduce_bucket_size": z.reduce_bucket_size, "prefetch": z.stage3_prefetch_bucket_size,
           "persistence": z.stage3_param_persistence_threshold, "overlap_comm": z.overlap_comm,
           "offload": (z.offload_optimizer, z.offload_param), "dtype": cfg.compute_dtype}
    if cfg.compute_dtype == torch.float16:
        out["scale"] = (s.dynamic, s.init_scale)
        if s.dynamic:
            out["dynamic"] = (s.scale_window, s.hysteresis, s.min_scale, s.consecutive_hysteresis)
    if cfg.compute_dtype == torch.bfloat16:
        out["check_grad_overflow"] = s.checks_finite
    assert s.clip_grad_norm == cfg.gradient_clipping
    return out


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 40


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_corpus_config_resolves_as_deepspeed(path):
    raw = json.loads(path.read_text())
    found = _accepting_world(raw)
    if found is None:  # DeepSpeed refuses it: pipezero may refuse it too, but only with a ConfigError
        try:
            parse_config(raw, world_size=8, hidden_size=HIDDEN, auto_values=_trainer_args(raw))
        except ConfigError:
            pass
        return
    world, ds = found
    try:
        ours = _ours(raw, world)
    except ConfigError as err:
        assert "is not supported by pipezero" in str(err), f"{path.name}: DeepSpeed accepts it, pipezero: {err}"
        return
    assert ours == _theirs(ds)


SCHEDULES = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}},
    {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 4, "warmup_type": "linear"}},
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_num_steps": 4}},  # up to the optimizer's lr
    {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 3,
                                         "total_num_steps": 9, "warmup_type": "linear"}},
    {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4, "total_num_steps": 8}},
    {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1, "warmup_num_steps": 3, "total_num_steps": 9,
                                          "cos_min_ratio": 0.05, "warmup_type": "linear"}},
    {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 4, "total_num_steps": 10}},
    # one warm-up step is two in DeepSpeed's three classes (max(2, warmup_num_steps))
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 1,
                                    "warmup_type": "linear"}},
    {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 1, "total_num_steps": 6}},
    {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1, "warmup_num_steps": 1, "total_num_steps": 6,
                                          "warmup_type": "linear"}},
]


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    """The lr each optimizer step runs at, the scheduler stepped after each (as DeepSpeed's engine does)."""
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("section", SCHEDULES, ids=lambda s: f"{s['type']}-{'-'.join(map(str, s['params'].values()))}")
def test_lr_schedules_equal_deepspeeds_own(section):
    """Each optimizer step's lr, from pipezero's scheduler and from DeepSpeed's class of that name
    built as its engine builds it (the section's params as keyword arguments)."""
    from deepspeed.runtime import lr_schedules

    from pipezero.train.config.optim import build_optimizer, build_scheduler

    def optimizer():
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.03)
    cfg = parse_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.03}},
                        "scheduler": section})
    ours = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    theirs = optimizer()
    expected = _lrs(getattr(lr_schedules, section["type"])(theirs, **section["params"]), theirs, 12)
    assert _lrs(build_scheduler(cfg.scheduler, ours), ours, 12) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_zero_warmup_steps_refused_as_deepspeed_refuses(kind):
    from deepspeed.runtime import lr_schedules

    params = {"warmup_num_steps": 0, **({} if kind == "WarmupLR" else {"total_num_steps": 5})}
    with pytest.raises(ValueError, match="positive integer"):
        getattr(lr_schedules, kind)(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), **params)
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        parse_config({"train_batch_size": 1, "scheduler": {"type": kind, "params": params}})


def test_expert_parallel_is_deepspeeds_autoep_section(monkeypatch):
    """DeepSpeed 0.19.8's "expert_parallel" {"enabled", "autoep_size"} sets the grid's expert axis (it was
    refused), read as DeepSpeed's own parser reads it; the rows stay per data x expert rank (the batch is
    DeepSpeed's); routing keys off their defaults, an expert tensor split and a size that does not divide
    the data degree are refused; the GPT job refuses --expert-parallel (no experts), finetune takes it. pipezero's
    "overlap" and "overlap_pairs" keys in the section (pipe/expert/overlap.py, pipe/pairs.py) are read, DeepSpeed's
    own parser takes the file with them."""
    raw = {"train_micro_batch_size_per_gpu": 2, "expert_parallel": {"enabled": True, "autoep_size": 2,
                                                                     "top_k": "auto", "use_grouped_mm": False}}
    ds = _deepspeed(raw, 4)
    cfg = parse_config(raw, world_size=4)
    assert cfg.expert == ds.expert_parallel_config.autoep_size == 2
    assert cfg.batch.train_batch_size == ds.train_batch_size == 8
    assert parse_config({**raw, "expert_parallel": {"enabled": False, "autoep_size": 2}}, world_size=4).expert == 1
    assert not cfg.expert_overlap  # pipezero's own "overlap" key: off by default; DeepSpeed's parser passes over it
    overlap = {**raw, "expert_parallel": {**raw["expert_parallel"], "overlap": True}}
    assert _deepspeed(overlap, 4).expert_parallel_config.autoep_size == 2
    assert parse_config(overlap, world_size=4).expert_overlap
    with pytest.raises(ConfigError, match="overlap"):
        parse_config({**raw, "expert_parallel": {**raw["expert_parallel"], "overlap": "sometimes"}}, world_size=4)
    assert not cfg.expert_pairs  # "overlap_pairs" (pipe/pairs.py), pipezero's too: off by default
    pairs = {**raw, "expert_parallel": {**raw["expert_parallel"], "overlap_pairs": True}}
    assert _deepspeed(pairs, 4).expert_parallel_config.autoep_size == 2
    assert parse_config(pairs, world_size=4).expert_pairs
    assert not parse_config({**pairs, "expert_parallel": {**pairs["expert_parallel"], "autoep_size": 1}},
                            world_size=4).expert_pairs  # expert 1: no all-to-all to hide
    with pytest.raises(ConfigError, match="overlap_pairs.* 'sometimes'"):
        parse_config({**raw, "expert_parallel": {**raw["expert_parallel"], "overlap_pairs": "sometimes"}},
                     world_size=4)
    for bad, match in (({"autoep_size": 3}, "autoep_size.. = 3 does not divide the data degree 4"),
                       ({"top_k": 4}, "top_k.. = 4: .* leave it at 'auto'"),
                       ({"expert_tensor_parallel_size": 2}, "set it to 1")):
        with pytest.raises(ConfigError, match=match):
            parse_config({**raw, "expert_parallel": {**raw["expert_parallel"], **bad}}, world_size=4)
    from pipezero.train import finetune
    from pipezero.train.gpt import job

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="the GPT this job trains has no experts"):
        job.train_config(job.parse_args(["--expert-parallel", "2", "--pipe", "1"]), None)
    assert finetune.train_config(finetune.parse_args(["--expert-parallel", "2", "--pipe", "1"]), None, 32).expert == 2


@pytest.mark.parametrize("given", [{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
                                   {"train_batch_size": 12, "gradient_accumulation_steps": 3}])
def test_sequence_parallel_size_shares_the_batch_as_deepspeed_does(given):
    """The sequence ranks of a replica take one batch: DeepSpeed's data degree is world / sequence_parallel_size."""
    raw = {**given, "sequence_parallel_size": 2}
    ds = _deepspeed(raw, 4)
    cfg = parse_config(raw, world_size=4)
    assert cfg.sequence == 2 and cfg.batch.data_degree == 2
    assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_size, cfg.batch.accumulation_steps) == (
        ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
    with pytest.raises(ConfigError, match="sequence_parallel_size 3 does not divide the world size 4"):
        parse_config({**raw, "sequence_parallel_size": 3}, world_size=4)
