"""Per-rank bytes of model state under ZeroOptimizer against the ZeRO paper's formulas.

Byte model per parameter (Psi parameters, N data ranks, Adam: two fp32 moments):
  fp32 model (the fp32 parameter is its own master):  params 4, grads 4, optimizer state 8
  bf16 model (fp32 master weights):                  params 2, grads 2, optimizer state 4 + 8 = 12
  stage 0: P + G + S      stage 1: P + G + S/N      stage 2: P + (G + S)/N      stage 3: (P + G + S)/N
(Rajbhandari et al. 2020, section 5: 16*Psi, 4*Psi + 12*Psi/N, 2*Psi + 14*Psi/N, 16*Psi/N for bf16.)

Counted from the live tensors of the process (unique storages, found through the garbage
collector) after a backward pass whose reductions are done, with optimizer state from a
previous step: exactly the tensors that stay alive across steps, plus the gradients.
"""

import gc

import pytest

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from harness import run
from pipezero.zero import ZeroConfig, ZeroOptimizer

BYTES = {torch.float32: (4, 4, 8), torch.bfloat16: (2, 2, 12)}


def expected(stage: int, dtype: torch.dtype, psi: int, n: int) -> float:
    p, g, s = BYTES[dtype]
    return psi * {0: p + g + s, 1: p + g + s / n, 2: p + (g + s) / n, 3: (p + g + s) / n}[stage]


def _storages() -> dict[int, int]:
    """Unique storages' bytes; a compile's fake tensors, still alive in a reused worker (torch 2.11), hold none."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            for t in (obj, obj.grad):
                if t is not None and t.numel() and not is_fake(t):
                    s = t.untyped_storage()
                    found[s.data_ptr()] = s.nbytes()
    return found


def _measure(stage: int, dtype: torch.dtype, x: torch.Tensor, before: dict[int, int]):
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).to(dtype)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), module=model,
                        config=ZeroConfig(stage=stage, stage3_param_persistence_threshold=0))
    for _ in range(2):                         # the first step creates the optimizer state
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.wait_grad_sync()
        if _ == 0:
            opt.step()
    after = _storages()
    live = sum(n for ptr, n in after.items() if ptr not in before)
    return live, sum(p.numel() for p in model.parameters()) if stage < 3 else 4 * (256 * 256 + 256)


CASES = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in (torch.float32, torch.bfloat16)]


def _measure_all():
    torch.manual_seed(0)
    x = {dtype: torch.randn(4, 256, dtype=dtype) for dtype in BYTES}
    before = _storages()     # what lives before any model: not model state
    return [_measure(stage, dtype, x[dtype], before) for stage, dtype in CASES]


def test_model_state_bytes_match_zero_formulas():
    wrong = []
    for rank, results in enumerate(run(_measure_all, 4)):
        for (stage, dtype), (live, psi) in zip(CASES, results):
            want = expected(stage, dtype, psi, 4)
            if abs(live - want) > 0.05 * want:
                wrong.append(f"stage {stage} {dtype} rank {rank}: {live} bytes live, ZeRO formula "
                             f"{want:.0f} ({live / want:.3f}x)")
    assert not wrong, "\n".join(wrong)


def _saved_parameter_bytes(offload: bool) -> tuple[int, int]:
    """Stage 3: storages of gathered parameters that autograd saved during forward, and the bytes
    they still hold once forward is over (the units have been released)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=0, offload_param=offload,
                                          offload_optimizer=offload))
    whole = opt.gatherer.partitioned
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        gathered = {b.flat.untyped_storage().data_ptr() for b in whole if b.flat is not None}
        if t.untyped_storage().data_ptr() in gathered:
            saved.append(t.untyped_storage())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(torch.randn(8, 3, 64)).square().mean()
    held = sum(s.nbytes() for s in saved)
    loss.backward()             # the backward gathers refill the storages those views read
    opt.step()
    return len(saved), held


@pytest.mark.parametrize("world,offload", [(2, False), (1, True)])
def test_saved_views_do_not_keep_gathered_parameters_alive(world, offload):
    """A Linear saves weight.t(), a view of the gathered buffer: releasing the unit after its
    forward must free that memory too, not only drop the parameter (ZeRO-3's whole point)."""
    for count, held in run(_saved_parameter_bytes, world, offload):
        assert count >= 3 and held == 0          # the first Linear saves no weight: its input needs no grad
