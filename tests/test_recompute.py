"""Activation checkpointing (pipe/memory/): full, selective and offloaded equal one process, and keep less.

The truth is the same layers trained in one process without checkpointing (1F1B, pipe 1); the
checkpointed runs are pipe 2 under 1F1B, ZB-H1, ZB-V and DualPipeV (split backward: the deferred
Linear GEMMs, or with deferred_linear=False no graph split for a checkpointed chunk), for the
project's GPT and a tiny Llama through hf_layer_specs, with and without LoRA. A recompute must be
exact: loss, every gradient and every parameter after an SGD step within 1e-6 (fp32), and each
block must really run its forward twice. A whole model (build(model=...), initialize at ZeRO-3) is
checkpointed the same way. What a forward keeps alive for backward is measured deterministically
on CPU: the bytes of every storage an op made that is still alive after the forward (none >
selective > full); the offload moves exactly the blocks' inputs. The ds_config section is read as
DeepSpeed's own parser reads it.
"""

import zlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef

from harness import run
from pipezero.config_fields import ConfigError
from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
from pipezero.pipe.compile import model_blocks
from pipezero.pipe.lora import LoraConfig, lora_specs, trainable_parameters
from pipezero.pipe.memory.offload import HostOffload
from pipezero.pipe.memory.recompute import RecomputeConfig, checkpoint_blocks
from pipezero.topology import Grid
from pipezero.train.config import parse_config
from pipezero.train.gpt.model import GPT, GPTConfig, gpt_loss, gpt_specs

transformers = pytest.importorskip("transformers")

GPT_CFG = GPTConfig(vocab_size=64, n_layer=3, n_head=2, d_model=16, seq_len=8, seed=1)
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
LORA = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear")
BATCH, SEQ, MICRO, LR = 8, 8, 4, 0.5
FULL, SELECTIVE = RecomputeConfig(mode="full"), RecomputeConfig(mode="selective")
FULL_OFF, SELECTIVE_OFF = RecomputeConfig(mode="full", offload=True), RecomputeConfig(mode="selective", offload=True)
FIRST_OFF = RecomputeConfig(mode="full", offload=True, offload_layers=1)  # a forward's first layer's inputs only
FIRST_TWO = RecomputeConfig(mode="full", checkpoint_layers=2)  # a forward's first two layers checkpointed
CASES = [  # (model, schedule, recompute, deferred_linear)
    ("gpt", "1f1b", FULL_OFF, True),
    ("gpt", "zbv", SELECTIVE_OFF, False),                  # ZB-V through torch's graph split
    ("gpt", "zbv", RecomputeConfig(mode="full", interval=2), True),
    ("llama", "zbv", SELECTIVE, True),
    ("llama-lora", "1f1b", SELECTIVE_OFF, True),
    ("llama-lora", "zbv", FULL_OFF, True),
    ("gpt", "zb_h1", FULL_OFF, False),                     # no graph split: one backward call, one recompute
    ("llama-lora", "dualpipev", SELECTIVE_OFF, True),
    ("llama", "1f1b", FIRST_OFF, True),
    ("llama", "1f1b", FIRST_TWO, True),                    # 2 of the 3 decoder layers (one a stage)
]


def _specs(model: str) -> tuple[list, object]:
    if model == "gpt":
        return gpt_specs(GPT_CFG), gpt_loss
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs

    specs = hf_layer_specs(transformers.LlamaConfig(**LLAMA))
    return (lora_specs(specs, LORA) if model == "llama-lora" else specs), causal_lm_loss


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (BATCH, SEQ), generator=gen), torch.randint(0, 64, (BATCH, SEQ), generator=gen)


def _count_block_forwards(module: torch.nn.Module) -> list[int]:
    """Forward calls of the repeated blocks (a pre-hook: a recompute may stop before forward hooks)."""
    calls = [0]
    for m in module.modules():
        if type(m).__name__ in ("Block", "HFDecoderLayer"):
            m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _train(model: str, schedule: str, recompute: RecomputeConfig | None, deferred: bool) -> tuple:
    """One step on this world's pipeline: the loss, every local gradient and parameter after SGD, by name."""
    pipe = dist.get_world_size()
    grid = Grid(pipe=pipe)
    specs, loss_fn = _specs(model)
    plan = make_schedule(schedule, MICRO)
    module = PipelineModule(specs, grid, loss_fn=loss_fn, num_chunks=plan.num_chunks, placement=plan.placement,
                            partition_method="uniform", recompute=recompute, deferred_linear=deferred)
    with torch.no_grad():  # LoRA's B starts at zero; give it values, the same on every grid (by name)
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    calls = _count_block_forwards(module)
    runner = PipelineRunner(module, plan)
    opt = torch.optim.SGD(trainable_parameters(module), lr=LR)
    loss = runner.train_step(*_batch()).item()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    opt.step()
    return loss, grads, {n: p.detach().clone() for n, p in module.named_parameters()}, calls[0]


def _cases(cases: list) -> list:
    return [_train(*case) for case in cases]


def _merged(results: list, index: int) -> dict:
    out = {}
    for rank in results:
        out.update(rank[index])
    return out


def test_checkpointed_pipelines_equal_one_process():
    models = sorted({c[0] for c in CASES})
    truth = dict(zip(models, run(_cases, 1, [(m, "1f1b", None, True) for m in models], timeout=300)[0]))
    got = run(_cases, 2, CASES, timeout=300)
    for i, (model, schedule, recompute, deferred) in enumerate(CASES):
        case = f"{model} {schedule} {recompute} deferred_linear={deferred}"
        loss, grads, params, calls = truth[model]
        ranks = [rank[i] for rank in got]
        for rank in ranks:
            assert rank[0] == pytest.approx(loss, rel=1e-6, abs=1e-6), case
        # each rank ran its blocks forward once per microbatch, and once again in the recompute (a graph
        # split would recompute in each of its backward calls); with checkpoint_layers=2 the stages' layers
        # are [embedding, 0, 1] and [2, norm, head]: blocks 0 and 2 are among their forward's first two
        redone = calls * 2 // 3 if recompute.checkpoint_layers else calls
        assert sum(r[3] for r in ranks) == calls + redone, (case, calls, [r[3] for r in ranks])
        for name, want in (("grad", grads), ("param", params)):
            have = _merged(ranks, {"grad": 1, "param": 2}[name])
            assert set(have) == set(want), (case, set(have) ^ set(want))
            for n in want:
                torch.testing.assert_close(have[n], want[n], rtol=1e-6, atol=1e-6, msg=f"{case}: {name} {n}")


# -- a whole model (build(model=...)) -------------------------------------------------------------

def _llama_grads(recompute: dict | None) -> tuple[float, dict, int]:
    from pipezero.train import build

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    config = {"train_batch_size": 2, **(recompute or {})}
    parts = build(config, model=model)
    calls = [0]
    for block in model_blocks(parts.module):
        block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids, targets = _batch()
    if recompute is not None:  # a KV cache filled twice (forward, recompute) is refused, not trained on
        with pytest.raises(ValueError, match="use_cache=False"):
            parts.module(ids[:2])
    logits = parts.module(ids[:2], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:2].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in parts.module.named_parameters()}, calls[0]


def _build_cases() -> list:
    return [_llama_grads(r) for r in (None, {"activation_checkpointing": {"cpu_checkpointing": True}},
                                      {"pipeline": {"activation_checkpointing": "selective"}},
                                      {"activation_checkpointing": {"cpu_checkpointing": True},
                                       "pipeline": {"offload_activation_layers": 2}})]


def test_selective_runs_its_layers_eager_under_compile():
    """compile=True with selective recomputation: torch's selective checkpoint refuses a compiled layer's
    kernels (they write into buffers they reuse: "Tensor cached during selective activation checkpoint has
    been mutated" at the first backward, before), so those layers run eager and train exactly as without
    compile; full recomputation keeps them compiled (compilation is lazy: nothing is traced here for it)."""
    ids, labels = _batch()
    results = []
    for compile_ in (False, True):
        specs, loss_fn = _specs("llama")
        torch.manual_seed(0)
        module = PipelineModule(specs, Grid(pipe=1), loss_fn=loss_fn, recompute=SELECTIVE, compile=compile_)
        assert not any(getattr(m, "_pipezero_compiled", False) for m in module.layers.values())
        loss = module.loss(module(ids), labels)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in module.named_parameters()}))
    (want, want_grads), (got, grads) = results
    assert got == pytest.approx(want, abs=1e-6), (got, want)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    full = PipelineModule(_specs("llama")[0], Grid(pipe=1), loss_fn=_specs("llama")[1], recompute=FULL, compile=True)
    assert sum(getattr(m, "_pipezero_compiled", False) for m in full.layers.values()) == LLAMA["num_hidden_layers"]
    assert "eager" in SELECTIVE.describe() and "eager" not in FULL.describe()


def test_build_model_checkpoints_its_blocks():
    (loss, grads, calls), *checkpointed = run(_build_cases, 1, timeout=300)[0]
    for got_loss, got, got_calls in checkpointed:
        assert got_loss == loss and got_calls == 2 * calls, (got_loss, loss, got_calls, calls)
        for n in grads:
            torch.testing.assert_close(got[n], grads[n], rtol=1e-6, atol=1e-6, msg=n)


def _initialize_losses(extra: dict) -> tuple[list[float], int]:
    """Three steps of a DeepSpeed-style loop (initialize) at ZeRO-3 over data 2."""
    from pipezero.train import initialize

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    engine, *_ = initialize(model=model, config={
        "train_batch_size": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, **extra})
    calls = [0]
    for block in model_blocks(engine.module):
        block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    gen, rank, losses = torch.Generator().manual_seed(1), dist.get_rank(), []
    for _ in range(3):
        ids = torch.randint(0, 64, (4, SEQ), generator=gen)[2 * rank:2 * rank + 2]
        loss = torch.nn.functional.cross_entropy(engine(ids, use_cache=False).logits.flatten(0, 1), ids.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, calls[0]


def _initialize_cases() -> list:
    return [_initialize_losses(extra) for extra in ({}, {"activation_checkpointing": {"cpu_checkpointing": True}},
                                                    {"pipeline": {"activation_checkpointing": "selective"}})]


def test_initialize_zero3_checkpointed_trains_the_same():
    for (plain, calls), *checkpointed in run(_initialize_cases, 2, timeout=300):
        for losses, recomputed in checkpointed:
            assert losses == pytest.approx(plain, rel=1e-6, abs=1e-6) and recomputed == 2 * calls


# -- what a forward keeps for backward ------------------------------------------------------------

class _LiveBytes(TorchDispatchMode):
    """Every storage an op makes, weakly: live() is the bytes of those still alive (views counted once)."""

    def __init__(self, exclude: set):
        super().__init__()
        self.refs, self.exclude = {}, exclude

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.exclude:
                    self.refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        return out

    def live(self) -> int:
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def _kept_bytes(recompute: RecomputeConfig | None, blocks: int = 4) -> tuple[int, int]:
    """Bytes a GPT forward leaves alive for its backward (and what the offload moved); `blocks`: of its 4
    blocks, how many checkpoint_blocks checkpoints."""
    cfg = GPTConfig(vocab_size=64, n_layer=4, n_head=2, d_model=32, seq_len=64, seed=1)
    model = GPT(cfg)
    offload = HostOffload() if recompute is not None and recompute.offload else None
    if recompute is not None:
        assert checkpoint_blocks(model_blocks(model), recompute, offload) == blocks
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    params = {StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
    with _LiveBytes(params) as mode:
        loss = gpt_loss(model(ids), ids)
    kept = mode.live()
    loss.backward()  # the recompute still gives gradients
    assert all(p.grad is not None for p in model.parameters())
    return kept, offload.offloaded_bytes if offload is not None else 0


def test_checkpointing_keeps_less():
    none, _ = _kept_bytes(None)
    selective, _ = _kept_bytes(SELECTIVE)
    full, _ = _kept_bytes(FULL)
    assert full < selective < none, (full, selective, none)
    assert full < none / 3, (full, none)
    _, moved = _kept_bytes(FULL_OFF)
    assert moved == 4 * 4 * 64 * 32 * 4  # the four blocks' inputs [batch, seq, d_model] in fp32, no more
    _, moved = _kept_bytes(RecomputeConfig(mode="full", offload=True, offload_layers=3))
    assert moved == 3 * 4 * 64 * 32 * 4  # the first three blocks' inputs; the last block keeps its own
    # the first two of four blocks checkpointed: half of what checkpointing saves, saved
    half, moved = _kept_bytes(RecomputeConfig(mode="full", offload=True, checkpoint_layers=2), blocks=2)
    assert half == pytest.approx((none + full) / 2, rel=0.02), (half, none, full)
    assert moved == 2 * 4 * 64 * 32 * 4  # the two checkpointed blocks' inputs


# -- ds_config --------------------------------------------------------------------------------------

def _recompute(section: dict | None = None, pipeline: dict | None = None, tensor: int = 1) -> RecomputeConfig:
    raw = {"train_batch_size": 4 * tensor, "pipeline": pipeline or {}}
    if section is not None:
        raw["activation_checkpointing"] = section
    return parse_config(raw, world_size=tensor, tensor=tensor).recompute


@pytest.mark.parametrize("section", [
    None, {}, {"cpu_checkpointing": True}, {"cpu_checkpointing": "true", "number_checkpoints": 24},
    {"partition_activations": True, "contiguous_memory_optimization": False},
    {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
     "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False},  # HF's boilerplate
])
def test_section_read_as_deepspeed_reads_it(section):
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    theirs = DeepSpeedActivationCheckpointingConfig({} if section is None else {"activation_checkpointing": section})
    ours = _recompute(section)
    offload = theirs.cpu_checkpointing in (True, "true")
    assert ours.offload == offload
    # a section that asks for checkpointed inputs (on the host or split) turns checkpointing on, every layer
    asked = offload or theirs.partition_activations is True
    assert ours == (RecomputeConfig(mode="full", offload=offload) if asked else RecomputeConfig())


def test_pipeline_keys_and_refusals(caplog):
    assert _recompute(pipeline={"activation_checkpoint_interval": 2}) == RecomputeConfig(mode="full", interval=2)
    assert _recompute({"cpu_checkpointing": True}, {"activation_checkpointing": "selective"}) == SELECTIVE_OFF
    with pytest.raises(ConfigError, match='"none" but .*cpu_checkpointing'):
        _recompute({"cpu_checkpointing": True}, {"activation_checkpointing": "none"})
    with pytest.raises(ConfigError, match="expected one of 'none', 'full', 'selective'"):
        _recompute(pipeline={"activation_checkpointing": "some"})
    with pytest.raises(ConfigError, match="tensor degree 2: splitting"):
        _recompute({"partition_activations": True}, tensor=2)
    with pytest.raises(ConfigError, match="did you mean"):
        _recompute({"cpu_checkpoint": True})
    first_two = RecomputeConfig(mode="full", offload=True, offload_layers=2)
    assert _recompute({"cpu_checkpointing": True}, {"offload_activation_layers": 2}) == first_two
    for pipeline in ({"activation_checkpointing": "full", "offload_activation_layers": 2},
                     {"offload_activation_layers": 2}):  # not silently dropped when nothing is checkpointed
        with pytest.raises(ConfigError, match="offload_activation_layers.* = 2 without .*cpu_checkpointing"):
            _recompute(pipeline=pipeline)
    with pytest.raises(ValueError, match="offload_layers=0.*positive integer"):
        RecomputeConfig(mode="full", offload=True, offload_layers=0)
    with pytest.raises(ValueError, match="offload_layers=2, offload=False"):
        RecomputeConfig(mode="full", offload_layers=2)
    assert "first 2 layers in pinned host memory" in first_two.describe()
    assert _recompute(pipeline={"activation_checkpoint_layers": 2}) == FIRST_TWO
    assert "full recompute of a forward's first 2 layers" in FIRST_TWO.describe()
    with pytest.raises(ConfigError, match='"none" but .*activation_checkpoint_layers.* = 2'):
        _recompute(pipeline={"activation_checkpointing": "none", "activation_checkpoint_layers": 2})
    with pytest.raises(ConfigError, match="offload_activation_layers.* = 3 exceeds .*activation_checkpoint_layers"
                                          ".* = 2"):
        _recompute({"cpu_checkpointing": True}, {"activation_checkpoint_layers": 2, "offload_activation_layers": 3})
    with pytest.raises(ValueError, match="checkpoint_layers=2, mode='none'"):
        RecomputeConfig(checkpoint_layers=2)
    with pytest.raises(ValueError, match="checkpoint_layers=0.*positive integer"):
        RecomputeConfig(mode="full", checkpoint_layers=0)
    _recompute({"profile": True, "synchronize_checkpoint_boundary": True})
    assert "profile\"] is ignored" in caplog.text and "synchronize_checkpoint_boundary" in caplog.text


def test_command_line_flags():
    from pipezero.train import finetune
    from pipezero.train.gpt import job

    args = finetune.parse_args(["--activation-checkpointing", "selective", "--offload-activations"])
    assert finetune.train_config(args, None, 32).recompute == SELECTIVE_OFF
    cfg = parse_config(job.ds_config(job.parse_args(["--offload-activations"])), world_size=2)
    assert cfg.recompute == FULL_OFF
    cfg = parse_config(job.ds_config(job.parse_args([])), world_size=2)
    assert cfg.recompute == RecomputeConfig()
    args = finetune.parse_args(["--offload-activation-layers", "3"])
    assert finetune.train_config(args, None, 32).recompute == RecomputeConfig(mode="full", offload=True,
                                                                              offload_layers=3)
    args = finetune.parse_args(["--activation-checkpoint-layers", "2", "--activation-checkpointing", "selective"])
    assert finetune.train_config(args, None, 32).recompute == RecomputeConfig(mode="selective", checkpoint_layers=2)
    cfg = parse_config(job.ds_config(job.parse_args(["--activation-checkpoint-layers", "2"])), world_size=2)
    assert cfg.recompute == FIRST_TWO
