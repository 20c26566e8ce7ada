"""Mixed precision with a Hugging Face model in a pipeline equals the same recipe in one process.

The recipe is pipezero's: the model's weights in bf16 or fp16, fp32 master weights (ZeRO's
shards) for AdamW, and for fp16 a dynamic LossScaler. The truth is transformers' own model in
one process with that recipe written in plain PyTorch: low-precision weights, fp32 master
copies that AdamW steps, the loss multiplied by the scale before backward and the gradients
divided by it in fp32. In fp16 one data rank of the first stage sees infinite gradients at
step SKIP: every rank must skip that step and halve the scale, as the truth skips it.

Tolerance: the pipeline sums micro-batch gradients and reduces them in the model's dtype
while the truth takes the whole batch at once, so the two round differently. The yardstick
is the recipe's own spread: the same recipe in one process with the batch split into the
pipeline's 4 micro-batches (gradients accumulated in the model's dtype) lands some distance
from the whole-batch recipe; the pipeline must stay within twice that distance of the
whole-batch recipe, in the losses and in the parameters (distance over all of a rank's
parameters relative to how far training moved them). A budget set from one machine's
numbers failed on another CPU (its reductions round differently); the spread moves with the
machine. Measured on an AMD EPYC: the pipeline at 1.5x the spread in bf16 (losses and
parameters), 0.3x and 0.7x in fp16;
with ZeRO's masters in the model's dtype instead of fp32, bf16 lands at 3.3x the parameter
spread and fp16 at nan; with the overflow agreed only per rank, the first stage skips alone
and the run fails.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner  # noqa: E402
from pipezero.pipe.hf import HFDecoderLayer, causal_lm_loss, hf_layer_specs, hf_state_dict  # noqa: E402
from pipezero.precision import LossScaler  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroOptimizer  # noqa: E402
from test_hf import LR, _batch, _checkpoint, _mine, _model  # noqa: E402

STEPS, SKIP, SCALE = 5, 2, 2.0 ** 8


def _poison_first_stage(model: PipelineModule, grid: Grid, now: list[bool]) -> None:
    """While now[0], data rank 1 of the first stage gets infinite gradients in its first decoder layer.

    The first stage, because the last one's infinities would travel back through the pipeline
    to every rank anyway: only the world-wide agreement makes the other stage skip too.
    """
    if grid.pipe_rank == 0 and grid.data_rank == 1:
        layer = next(m for m in model.modules() if isinstance(m, HFDecoderLayer))
        weight = next(layer.parameters())
        weight.register_hook(lambda grad: grad * float("inf") if now[0] else grad)


def _train_pipe(path: str, dtype: torch.dtype, stage: int):
    grid = Grid(pipe=2)
    fp16 = dtype == torch.float16
    model = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=causal_lm_loss, partition_method="uniform")
    model.to(dtype)
    overflow_now = [False]
    if fp16:
        _poison_first_stage(model, grid, overflow_now)
    scaler = LossScaler(torch.optim.AdamW(model.parameters(), lr=LR), init_scale=SCALE if fp16 else 1.0,
                        dynamic=fp16, hysteresis=1)
    opt = ZeroOptimizer(scaler, stage=stage, group=grid.data_group)
    runner = PipelineRunner(model, OneFOneB(num_microbatches=4), optimizer=opt)
    losses, stepped = [], []
    for step in range(STEPS):
        ids, targets = _batch(step)
        overflow_now[0] = step == SKIP
        losses.append(runner.train_step(_mine(ids, grid), _mine(targets, grid)).item())
        stepped.append(opt.step())
        opt.zero_grad()
    return losses, stepped, scaler.loss_scale, {n: t.float() for n, t in hf_state_dict(model).items()}


def _recipe(family: str, dtype: torch.dtype, microbatches: int = 1):
    """The recipe in plain PyTorch, one process: (losses, parameters under the model's names).

    With microbatches > 1 the batch is split and the gradients accumulate in the model's
    dtype, as the pipeline's do: the same arithmetic in another rounding order.
    """
    model = _model(family).to(dtype)
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in params.items()}
    opt = torch.optim.AdamW(masters.values(), lr=LR)
    scale = SCALE if dtype == torch.float16 else 1.0
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        model.zero_grad()
        overflow = dtype == torch.float16 and step == SKIP
        parts = []
        for part_ids, part_targets in zip(ids.chunk(microbatches), targets.chunk(microbatches)):
            loss = causal_lm_loss(model(part_ids).logits, part_targets)
            parts.append(loss.item())
            if not overflow:
                (loss * scale / microbatches).backward()
        losses.append(sum(parts) / microbatches)
        if overflow:  # no update, the scale halves
            scale /= 2
            continue
        for n, m in masters.items():
            m.grad = params[n].grad.float() / scale
        opt.step()
        with torch.no_grad():
            for n, m in masters.items():
                params[n].copy_(m)
    return losses, {n: t.detach().float() for n, t in model.state_dict().items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """|a - b| over the names of a, relative to how far b moved from start."""
    apart = sum(((a[n] - b[n]) ** 2).sum() for n in a)
    moved = sum(((b[n] - start[n]) ** 2).sum() for n in a)
    return (apart / moved).sqrt().item()


@pytest.mark.parametrize("family, dtype, stage", [
    ("llama", torch.bfloat16, 1),   # untied
    ("qwen2", torch.float16, 2),    # tied embedding and head across the two stages; forced overflow
])
def test_pipe2_data2_mixed_precision_matches_one_process(family, dtype, stage, tmp_path_factory):
    skip = SKIP if dtype == torch.float16 else None
    start = {n: t.detach().clone() for n, t in _model(family).state_dict().items()}
    losses, params = _recipe(family, dtype)
    split_losses, split_params = _recipe(family, dtype, microbatches=4)
    loss_budget = 2 * max(abs(a - b) for a, b in zip(losses, split_losses))
    path = _checkpoint(family, str(tmp_path_factory.getbasetemp()))
    for rank, (got, stepped, scale, state) in enumerate(run(_train_pipe, 4, path, dtype, stage, timeout=300)):
        assert stepped == [i != skip for i in range(STEPS)], f"rank {rank}: {stepped}"
        assert scale == (SCALE / 2 if dtype == torch.float16 else 1.0), f"rank {rank}: scale {scale}"
        loss_error = max(abs(a - b) for a, b in zip(got, losses))
        assert loss_error <= loss_budget, f"rank {rank}: losses {got}, recipe {losses}, budget {loss_budget:.2e}"
        budget = 2 * _distance({n: split_params[n] for n in state}, params, start)
        error = _distance(state, params, start)
        assert error <= budget, f"rank {rank}: {error:.4f} from the recipe, budget {budget:.4f}"
