"""ZeRO-3 inside the pipeline: pipe 2 x data 2 at stage 3 equals one process and the same grid at stage 2.

The tied-embedding model of test_pipe_runner (embedding and head tied across stages, or both
on rank 0 under the V placement), every parameter partitioned (persistence threshold 0),
Adam, three steps with different sequence lengths. Both settings of reshard_after_forward.
The same runs count the first step's all-gathers and reduce-scatters (comm's TRAFFIC) and the
most parameters whole at once, against what the planner predicts from the rank's action list
(train/plan/zero3.py).
"""

import pytest
import torch

from harness import run
from pipezero.comm import TRAFFIC
from pipezero.pipe.gathering import plan_gathers
from pipezero.pipe.module import PipelineModule
from pipezero.pipe.schedule.registry import make_schedule
from pipezero.pipe.runner import PipelineRunner
from pipezero.topology import Grid
from pipezero.train.plan.zero3 import pipeline_gathers
from pipezero.zero import ZeroConfig, ZeroOptimizer
from test_pipe_runner import assert_parity, batch, loss_fn, specs

STEPS, SIZE, BLOCKS, LR, SEQS = 3, 8, 4, 0.01, [4, 6, 3]


def train_zero(stage: int, name: str, m: int, reshard: bool, every_microbatch: bool = False, chunks=None):
    grid = Grid(pipe=2)
    sched = make_schedule(name, m, chunks)
    model = PipelineModule(specs(_blocks(chunks)), grid=grid, loss_fn=loss_fn, num_chunks=sched.num_chunks,
                           placement=sched.placement)
    layers, tied = _layers(model)  # while every parameter is whole
    config = ZeroConfig(stage=stage, stage3_param_persistence_threshold=0,
                        reduce_every_microbatch=every_microbatch)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=LR), group=grid.data_group,
                        module=model if stage == 3 else None, config=config)
    runner = PipelineRunner(model, sched, optimizer=opt, reshard_after_forward=reshard)
    share, losses, peak = SIZE // grid.data_size, [], [0]
    need = opt.need_params

    def counting(params, upcoming=()):  # the most elements whole at once: after each need
        need(params, upcoming)
        peak[0] = max(peak[0], opt.gathered_numel())
    opt.need_params = counting
    for step in range(STEPS):
        ids, targets = batch(step, SIZE, SEQS[step])
        mine = slice(grid.data_rank * share, (grid.data_rank + 1) * share)
        TRAFFIC.reset()
        losses.append(runner.train_step(ids[mine], targets[mine]).item())
        if step == 0:
            traffic = {k: (v["calls"], v["bytes"] // 4) for k, v in TRAFFIC.snapshot().items() if "p2p" not in k}
            first_peak = peak[0]
        if stage == 3:  # every chunk partitioned again once the step's actions are done
            assert all(p.numel() == 0 for p in model.parameters()), [p.shape for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    with opt.gathered_parameters():  # an evaluation inside must leave the parameters whole
        ids, targets = batch(STEPS, SIZE, SEQS[0])
        evaluated = runner.eval_step(ids[mine], targets[mine]).item()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    measured = (traffic.get("all_gather", (0, 0)), first_peak, traffic.get("reduce_scatter", (0, 0)))
    chunks = [a.chunk for a in sched.actions(grid.pipe_size)[grid.pipe_rank]]
    predicted = pipeline_gathers(chunks, layers, reshard, tied)
    return losses, params, evaluated, measured, predicted


def _layers(model: PipelineModule) -> tuple[dict, dict]:
    """(chunk -> {layer: elements}, tied to another rank: {layer: elements}), a layer named as its parameters
    are ("layers.3", "tied.embed"): the planner's view of the stage (each layer one bucket)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tied = {id(p) for p in model.tied_parameters()}
    layers, across = {}, {}
    for c in range(model.num_chunks):
        for p in model.chunk_parameters(c):
            name = names[id(p)].rsplit(".", 2 if names[id(p)].startswith("layers.") else 1)[0]
            into = across if id(p) in tied else layers.setdefault(c, {})
            into[name] = into.get(name, 0) + p.numel()
    return layers, across


def _blocks(chunks) -> int:
    return BLOCKS if chunks is None else 2 * chunks  # every virtual stage of pipe 2 gets a layer


def both_stages(name: str, m: int, reshard: bool, every_microbatch: bool = False, chunks=None):
    return [train_zero(stage, name, m, reshard, every_microbatch, chunks) for stage in (3, 2)]


@pytest.mark.parametrize("name, m, reshard, every_microbatch, chunks", [
    ("OneFOneB", 4, False, False, None),
    ("Interleaved1F1B", 4, False, False, None),
    ("Interleaved1F1B", 4, True, False, None),
    ("Interleaved1F1B", 4, True, False, 4),     # 4 chunks a rank: resharding holds less (344 elements, not 416)
    ("ZeroBubbleV", 4, False, False, None),        # split weight backward, V placement
    ("ZeroBubbleV", 4, True, True, None),
    ("DualPipeV", 4, True, False, None),
])
def test_stage3_pipeline_equals_one_process_and_stage2(name, m, reshard, every_microbatch, chunks):
    results = run(both_stages, 4, name, m, reshard, every_microbatch, chunks, timeout=300)
    stage3 = [r[0][:2] for r in results]
    assert_parity(stage3, _blocks(chunks), STEPS, SIZE, LR, "adam", SEQS)
    for rank, ((*_, (gathers, peak, reduces), want), _) in enumerate(results):
        assert gathers == (want.calls, want.elements), (rank, "all-gathers (calls, elements)", gathers, want)
        assert peak == want.peak, (rank, "elements whole at once", peak, want)
        if not every_microbatch:  # the planner's ds_config leaves reduce_every_microbatch off
            assert reduces == (want.reduce_calls, want.reduce_elements), (rank, "reduce-scatters", reduces, want)
    for (losses3, params3, eval3, *_), (losses2, params2, eval2, *_) in results:
        torch.testing.assert_close(torch.tensor(losses3 + [eval3]), torch.tensor(losses2 + [eval2]), rtol=1e-6, atol=1e-6)
        for n, value in params3.items():
            torch.testing.assert_close(value, params2[n], rtol=1e-6, atol=1e-6, msg=n)


def test_gather_plan_follows_the_schedule():
    """Whole through the step: released after the chunk's last action; reshard: whenever another chunk runs next."""
    chunks = [0, 0, 1, 0, 1, 1]
    whole = plan_gathers(chunks, reshard_after_forward=False)
    assert whole.release == ((), (), (), (0,), (), (1,))
    assert whole.prefetch == (1, 1, 0, 1, None, None)
    assert plan_gathers(chunks, reshard_after_forward=True).release == ((), (0,), (1,), (0,), (), (1,))


def _tensor_parallel_stage3_error() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    module = torch.nn.Module()
    module.weight = weight
    try:
        ZeroOptimizer(torch.optim.Adam([weight]), stage=3, module=module)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_tensor_parallel_with_stage3_is_refused():
    message = run(_tensor_parallel_stage3_error, 1)[0]
    assert "does not take tensor-parallel" in message and "stage 1 or 2" in message, message
