"""Gradients summed in fp32 under a bf16 model (ds_config data_types.grad_accum_dtype, communication_data_type).

DeepSpeed's meaning is the reference: the same ds_config, model, data and loop through
deepspeed.initialize (its BF16_Optimizer at ZeRO-1, its ZeRO optimizers at stages 2-3) and through
pipezero's initialize must give bit-identical losses and parameters. SGD, not Adam: Adam's first
step is ±lr for an element whose gradient is rounding noise, which hides (or fakes) one ulp. The
pipeline's truth is plain PyTorch in one process: the bf16 GPT, each micro-batch's gradient added
into fp32 sums per data rank, the ranks' sums averaged, SGD on fp32 master copies. Each parity has
its counterpart that must miss: summing in bf16 lands elsewhere.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness import run
from pipezero.config_fields import ConfigError
from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
from pipezero.precision import LossScaler
from pipezero.topology import Grid
from pipezero.train import parse_config
from pipezero.train.checkpoint.state import single_process_names
from pipezero.zero import ZeroConfig, ZeroOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, gpt_loss, gpt_specs  # noqa: E402

ACCUMULATION = 8


def _ds_config(stage: int, accum: str | None, comm: str | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "steps_per_print": 10**9,
           "zero_allow_untested_optimizer": True}
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if comm is not None:
        cfg["communication_data_type"] = comm
    return cfg


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def _loop(initialize, config: dict) -> tuple[list[float], list[torch.Tensor]]:
    """DeepSpeed's loop, two optimizer steps of ACCUMULATION micro-batches each."""
    import torch.distributed as dist

    model = _mlp()
    engine, *_ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config)
    losses = []
    for i in range(2 * ACCUMULATION):
        g = torch.Generator().manual_seed(100 * i + dist.get_rank())
        x, y = torch.randn(2, 16, generator=g).bfloat16(), torch.randint(0, 4, (2,), generator=g)
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, [p.detach().float().clone() for p in model.parameters()]


def _pipezero(config: dict):
    from pipezero.train import initialize

    return _loop(initialize, config)


def _deepspeed(config: dict):
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo: no shm kernel to compile
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    return _loop(deepspeed.initialize, config)


def _same(a, b) -> bool:
    (losses, params), (their_losses, their_params) = a, b
    return losses == their_losses and all(torch.equal(p, q) for p, q in zip(params, their_params, strict=True))


def test_fp32_sums_are_deepspeeds_bit_for_bit():
    """And stage 0 and CPU offload, which DeepSpeed refuses or runs otherwise with fp32 sums, land
    exactly where its ZeRO-1 does."""
    pytest.importorskip("deepspeed")
    for stage, comm in ((1, None), (2, None), (3, None), (1, "fp32")):
        ours = run(_pipezero, 2, _ds_config(stage, "fp32", comm))
        theirs = run(_deepspeed, 2, _ds_config(stage, "fp32", comm), timeout=300, discard=True)
        for rank, (mine, ds) in enumerate(zip(ours, theirs)):
            assert _same(mine, ds), f"stage {stage}, communication {comm}, rank {rank}"
        if comm is None:
            bf16_sums = run(_pipezero, 2, _ds_config(stage, None))
            assert not _same(bf16_sums[0], theirs[0]), f"stage {stage}: summing in bf16 lands elsewhere"
        if (stage, comm) == (1, None):
            offload = _ds_config(1, "fp32")
            offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            for config in (_ds_config(0, "fp32"), offload):
                assert _same(run(_pipezero, 2, config)[0], theirs[0]), config["zero_optimization"]


CFG = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16, seed=4)
BATCH, MICRO, LR, STEPS = 8, 4, 0.5, 2
EMBED, HEAD = "layers.0.weight", f"layers.{CFG.n_layer + 2}.weight"


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(70 + step)
    return tuple(torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=gen) for _ in range(2))


def _truth(data: int) -> dict[str, torch.Tensor]:
    """The bf16 GPT in one process: micro-batch gradients summed in fp32 per data rank, the ranks averaged.

    The embedding and the head get their own copy of the tied weight, so each use's micro-batch
    gradients are summed in fp32 apart and the two sums added (as DeepSpeed's pipeline all-reduces
    its tied weights' fp32 gradients over their owners); both copies take the same step."""
    model = GPT(CFG).to(torch.bfloat16)
    model.layers[-1].weight = torch.nn.Parameter(model.layers[0].weight.detach().clone())
    masters = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    for step in range(STEPS):
        sums = []
        for x, y in zip(*(t.chunk(data) for t in _batch(step))):
            total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
            for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
                (gpt_loss(model(xm), ym) / MICRO).backward()
                for n, p in model.named_parameters():
                    total[n] += p.grad.float()
                model.zero_grad(set_to_none=True)
            total[EMBED] = total[HEAD] = total[EMBED] + total[HEAD]
            sums.append(total)
        with torch.no_grad():
            for n, p in model.named_parameters():
                masters[n] -= LR * (sum(s[n] for s in sums) / data)
                p.copy_(masters[n])
    return {n: t.float() for n, t in model.state_dict().items()}


def _pipeline(stage: int, accum: torch.dtype | None, schedule: str = "1f1b"):
    grid = Grid(pipe=2)
    sched = make_schedule(schedule, MICRO)
    model = PipelineModule(gpt_specs(CFG), grid=grid, loss_fn=gpt_loss, compile=False, num_chunks=sched.num_chunks,
                           placement=sched.placement).to(torch.bfloat16)
    config = ZeroConfig(stage=stage, grad_accum_dtype=accum, reduce_dtype=accum)
    opt = ZeroOptimizer(LossScaler(torch.optim.SGD(model.parameters(), lr=LR), dynamic=False, init_scale=1.0),
                        group=grid.data_group, config=config, module=model if stage == 3 else None)
    runner = PipelineRunner(model, sched, optimizer=opt)
    share = BATCH // grid.data_size
    for step in range(STEPS):
        mine = slice(grid.data_rank * share, (grid.data_rank + 1) * share)
        runner.train_step(*(t[mine] for t in _batch(step)))
        assert opt.step() is True
        opt.zero_grad()
    with opt.gathered_parameters():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _differing(results, truth) -> tuple[int, int]:
    """(elements that differ from the truth on any rank: of the tied weight, of every other weight)."""
    mapping = single_process_names(gpt_specs(CFG))
    tied, other, seen = 0, 0, set()
    for params in results:
        for name, value in params.items():
            for single in mapping(name):
                seen.add(single)
                differ = int((value != truth[single]).sum())
                if single in (EMBED, HEAD):
                    tied += differ
                else:
                    other += differ
    assert seen == set(truth), set(truth) - seen
    return tied, other


@pytest.mark.parametrize("stage, schedule", [(0, "1f1b"), (1, "1f1b"), (2, "1f1b"), (3, "1f1b"), (0, "zb_h1"),
                                             (1, "zbv")])
def test_pipeline_sums_in_fp32_as_one_process(stage, schedule):
    """pipe 2 x data 2, ZeRO 0-3, 1F1B over 4 micro-batches, two steps: every weight, the tied embedding
    too, equals the truth (each stage sums its use of the tied weight in fp32 before the tie group adds
    them up; 0 differing elements here, at every stage although stages 2-3 reduce each micro-batch as its
    bucket fills while stages 0-1 reduce the step's sum once; under a split backward too, whose W assigns the
    Linear weights' .grad without hooks). Summing in bf16 moves ~10% of the elements
    by an ulp (thousands per rank), so a budget of 1/20 of that, for the tied weight and the others
    apart, leaves room for a CPU whose kernels round a few elements otherwise and still fails bf16 sums."""
    truth = run(_truth, 1, 2)[0]  # in a worker: its kernels reduce with the same threads
    tied, other = _differing(run(_pipeline, 4, stage, torch.float32, schedule, timeout=180), truth)
    bf16_tied, bf16_other = _differing(run(_pipeline, 4, stage, None, schedule, timeout=180), truth)
    assert bf16_other > 1000 and bf16_tied > 100, f"summing in bf16 must land elsewhere ({bf16_tied}, {bf16_other})"
    assert other * 20 <= bf16_other and tied * 20 <= bf16_tied, (tied, other, bf16_tied, bf16_other)


def test_ds_config_reads_data_types_with_deepspeeds_meaning():
    def zero(**top) -> ZeroConfig:
        return parse_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, **top},
                            world_size=1).zero

    assert (zero().grad_accum_dtype, zero().reduce_dtype) == (None, None)
    assert zero(data_types={"grad_accum_dtype": "fp32"}).grad_accum_dtype == torch.float32
    assert zero(data_types={"grad_accum_dtype": "bf16", "param_dtype": "bfloat16"}).grad_accum_dtype is None
    assert zero(communication_data_type="fp32").reduce_dtype == torch.float32
    assert zero(communication_data_type="bf16").reduce_dtype is None
    fp32_model = parse_config({"train_micro_batch_size_per_gpu": 1, "data_types": {"grad_accum_dtype": "float32"}},
                              world_size=1)
    assert fp32_model.zero.grad_accum_dtype is None
    for top, match in (({"data_types": {"grad_accum_dtype": "int8"}}, r'\["grad_accum_dtype"\] = .int8.: expected'),
                       ({"data_types": {"grad_accum_dtype": "fp16"}}, r"narrower than, or not comparable with, the "
                                                                      r"model's bf16.*use \"fp32\""),
                       ({"data_types": {"param_dtype": "fp16"}}, r"param_dtype.*differs from the enabled precision"),
                       ({"data_types": {"buffer_dtype": "bf16"}}, r"buffer_dtype.*casting the model's buffers"),
                       ({"communication_data_type": 16}, r"communication_data_type.*expected \"fp32\"")):
        with pytest.raises(ConfigError, match=match):
            zero(**top)


def test_a_narrower_sum_is_refused_before_any_collective():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"grad_accum_dtype=torch.bfloat16.*dtype torch.float32.*use torch.float32"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), config=ZeroConfig(stage=1,
                                                                                      grad_accum_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"ZeroConfig\(reduce_dtype=torch.int8\): expected torch.float32"):
        ZeroConfig(reduce_dtype=torch.int8)
