"""Per-rank model state of a ZeRO-3 pipeline rank against the ZeRO formula applied to its stage.

pipe 2 x data 2, eight Linear(256, 256) layers (four per rank, two chunks of two under the
interleaved schedule), fp32 Adam, every parameter partitioned. After a step (optimizer state
exists) and the next train_step (gradients reduce-scattered, every chunk released), the live
storages that are not there before the model is built must be (P + G + S) / N bytes per
parameter of this rank's stage: 16 * Psi / 2 (Rajbhandari et al. 2020, section 5),
measured as tests/test_zero_memory.py measures the data-parallel case.
"""

import pytest
import torch
from torch import nn

from harness import run
from pipezero.pipe import LayerSpec, PipelineModule, PipelineRunner
from pipezero.pipe.schedule.registry import make_schedule
from pipezero.topology import Grid
from pipezero.zero import ZeroConfig, ZeroOptimizer
from test_zero_memory import _storages, expected

WIDTH, LAYERS = 256, 8


def _measure(name: str, reshard: bool) -> tuple[int, int]:
    grid = Grid(pipe=2)
    sched = make_schedule(name, 4)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    before = _storages()
    model = PipelineModule([LayerSpec(nn.Linear, WIDTH, WIDTH) for _ in range(LAYERS)], grid=grid,
                           loss_fn=nn.functional.mse_loss, num_chunks=sched.num_chunks, placement=sched.placement)
    psi = sum(p.numel() for p in model.parameters())  # whole until the optimizer partitions them
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), group=grid.data_group, module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    runner = PipelineRunner(model, sched, optimizer=opt, reshard_after_forward=reshard)
    for step in range(2):                             # the first step creates the optimizer state
        opt.zero_grad()
        runner.train_step(x, y)
        opt.wait_grad_sync()
        if step == 0:
            opt.step()
    live = sum(n for ptr, n in _storages().items() if ptr not in before)
    return live, psi


@pytest.mark.parametrize("name, reshard", [("OneFOneB", False), ("Interleaved1F1B", True)])
def test_stage3_pipeline_rank_state_matches_zero_formula(name, reshard):
    wrong = []
    for rank, (live, psi) in enumerate(run(_measure, 4, name, reshard, timeout=300)):
        want = expected(3, torch.float32, psi, 2)
        if abs(live - want) > 0.05 * want:
            wrong.append(f"rank {rank}: {live} bytes live, ZeRO-3 formula for its {psi} parameters "
                         f"{want:.0f} ({live / want:.3f}x)")
    assert not wrong, "\n".join(wrong)
