"""NVTX ranges: in schedule order around every action, around ZeRO collectives and the optimizer
step while profiling; nothing pushed and no label formatted when off.

torch.cuda.nvtx needs CUDA, so the tests replace its push/pop with recorders (and let
`profiling()` believe CUDA is there); the runner and ZeroOptimizer are the real ones.
"""

import re

import torch
from torch import nn

from harness import run
from pipezero.comm import nvtx_range, profiling, profiling_enabled
from test_pipe_runner import batch, loss_fn, specs

ACTION = re.compile(r"^\d+[FBIW]\d+$")


def _record() -> tuple[list, list]:
    """Replace torch.cuda.nvtx's push/pop with recorders; return (pushed labels, pops)."""
    pushed, popped = [], []
    torch.cuda.nvtx.range_push = lambda label: pushed.append(label)
    torch.cuda.nvtx.range_pop = lambda: popped.append(1)
    return pushed, popped


def _with_cuda_flag(on: bool):
    """profiling(on) entered as if CUDA were available (the flag is read on entry only)."""
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        ctx = profiling(on)
        ctx.__enter__()
    finally:
        torch.cuda.is_available = real
    return ctx


def _traced_steps(on: bool) -> dict:
    """A pipe 2 step (ZeroBubbleH1) and a data 2 ZeRO-2 step with profiling on or off."""
    from pipezero.pipe import PipelineModule, PipelineRunner, ZeroBubbleH1
    from pipezero.topology import Grid
    from pipezero.zero import ZeroOptimizer

    real = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    pushed, popped = _record()
    ctx = _with_cuda_flag(on)
    try:
        grid = Grid(pipe=2)
        sched = ZeroBubbleH1(num_microbatches=4)
        model = PipelineModule(specs(2), grid=grid, loss_fn=loss_fn)
        PipelineRunner(model, sched).train_step(*batch(0, 4))
        actions = [x for x in pushed if ACTION.match(x)]
        expected = [str(a) for a in sched.actions(2)[grid.pipe_rank]]
        del pushed[:]
        data = Grid(pipe=1, data=2)
        torch.manual_seed(0)
        lin = nn.Linear(8, 4)
        opt = ZeroOptimizer(torch.optim.Adam(lin.parameters()), stage=2, group=data.data_group)
        lin(torch.randn(3, 8)).sum().backward()
        opt.step()
        return {"actions": actions, "expected": expected, "zero": list(pushed), "pops": len(popped),
                "on": profiling_enabled()}
    finally:
        ctx.__exit__(None, None, None)
        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = real


def test_ranges_follow_the_schedule_and_wrap_collectives_and_the_step():
    for r in run(_traced_steps, 2, True):
        assert r["on"]
        assert r["actions"] == r["expected"]                  # every action, in this rank's schedule order
        assert "reduce_scatter" in r["zero"] and "all_gather" in r["zero"] and "optimizer.step" in r["zero"]
        assert r["zero"].index("reduce_scatter") < r["zero"].index("optimizer.step")


def test_off_pushes_nothing_and_formats_nothing():
    for r in run(_traced_steps, 2, False):
        assert not r["on"] and r["actions"] == [] and r["zero"] == [] and r["pops"] == 0

    class Loud:
        def __str__(self):
            raise AssertionError("a label was formatted while profiling is off")

    with nvtx_range(Loud()):
        pass
