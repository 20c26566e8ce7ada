"""pipe x data x tensor together: the GPT example trained on a 3D grid equals one process.

The truth is examples/gpt.py's GPT trained with plain Adam on the whole batch in one process.
Each grid builds the same layers through PipelineModule with gpt_tensor_plan() (every Block's
qkv/fc column-wise, proj/out row-wise over the tensor axis), wraps Adam in a LossScaler (with
clipping, so the global grad norm must count every tensor shard once and every replicated
weight once) and a ZeroOptimizer over the data axis, and must give the same loss every step
and the same final parameters (split ones compared whole, through whole_tensor()).
"""

import functools
import sys
from pathlib import Path

import pytest
import torch

from harness import run
from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
from pipezero.pipe.tensor_parallel import is_replicated, whole_tensor
from pipezero.precision import LossScaler
from pipezero.topology import Grid
from pipezero.train.checkpoint.state import single_process_names
from pipezero.zero import ZeroOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, gpt_loss, gpt_specs, gpt_tensor_plan  # noqa: E402

CFG = GPTConfig(vocab_size=32, n_layer=2, n_head=4, d_model=16, seq_len=8, seed=1)
STEPS, BATCH, LR, CLIP = 3, 8, 1e-2, 0.05  # CLIP is below the grad norm: clipping is active


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=gen)
    return ids, torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=gen)


@functools.cache
def _truth() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = GPT(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        loss = gpt_loss(model(ids), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: t.clone() for n, t in model.state_dict().items()}  # the tied weight under both names


def _train(pipe: int, tensor: int, stage: int, schedule: str, compiled: bool = False):
    from pipezero.pipe.compile import CompileConfig

    grid = Grid(pipe=pipe, tensor=tensor)
    sched = make_schedule(schedule, 2 if schedule == "1f1b" else 4)
    model = PipelineModule(gpt_specs(CFG), grid=grid, loss_fn=gpt_loss, tensor_plan=gpt_tensor_plan(),
                           num_chunks=sched.num_chunks, placement=sched.placement,
                           compile=CompileConfig(backend="aot_eager") if compiled else False)
    opt = LossScaler(torch.optim.Adam(model.parameters(), lr=LR), dynamic=False, init_scale=1.0,
                     clip_grad_norm=CLIP)
    if stage is not None:   # else Adam and the clipping see the split parameters themselves
        opt = ZeroOptimizer(opt, stage=stage, group=grid.data_group, module=model if stage == 3 else None)
    runner = PipelineRunner(model, sched, optimizer=opt)
    losses, share = [], BATCH // grid.data_size
    for step in range(STEPS):
        ids, targets = _batch(step)
        mine = slice(grid.data_rank * share, (grid.data_rank + 1) * share)
        losses.append(runner.train_step(ids[mine], targets[mine]).item())
        assert opt.step() is True
        opt.zero_grad()
    sharded = sorted(n for n, p in model.named_parameters() if not is_replicated(p))
    params = {n: whole_tensor(p).detach().clone() for n, p in model.named_parameters()}
    return losses, params, sharded


def _check(results, tensor: int) -> None:
    losses, params = _truth()
    mapping = single_process_names(gpt_specs(CFG))
    seen = set()
    for rank_losses, rank_params, sharded in results:
        torch.testing.assert_close(rank_losses, losses, rtol=1e-5, atol=1e-5)
        if tensor > 1:
            assert any(n.endswith("qkv.weight") for n in sharded) or not any("qkv" in n for n in rank_params)
        for name, value in rank_params.items():
            for single in mapping(name):
                torch.testing.assert_close(value, params[single], rtol=1e-5, atol=1e-5, msg=name)
                seen.add(single)
    assert seen == set(params), set(params) - seen


@pytest.mark.parametrize("world, pipe, tensor, stage, schedule, compiled", [
    (2, 1, 2, None, "1f1b", False),  # tensor 2, no ZeRO: the clip norm over the grads' local shards
    (4, 1, 2, 2, "1f1b", False),   # tensor 2 x data 2, ZeRO-2
    (4, 2, 2, 1, "zbv", False),    # pipe 2 x tensor 2, ZeRO-1 over a data group of one; weight GEMMs deferred to W
    (4, 1, 2, 0, "1f1b", False),   # tensor 2 x data 2, ZeRO-0: the shards' .grad are views of the all-reduce buffer
    (8, 2, 2, 2, "1f1b", False),   # pipe 2 x data 2 x tensor 2
    (4, 1, 2, 3, "1f1b", False),   # tensor 2 x data 2, ZeRO-3: each tensor rank's shards partitioned over data
    (4, 1, 2, 2, "1f1b", True),    # the Blocks and the loss compiled (traced: the hooks' all-reduces in the graph)
])
def test_3d_parity(world, pipe, tensor, stage, schedule, compiled):
    # compiled: the workers go afterwards (a compile leaves fake tensors that the memory tests' scans of
    # live tensors, run next in the same pool, cannot read)
    _check(run(_train, world, pipe, tensor, stage, schedule, compiled, timeout=180, discard=compiled), tensor)


def _bad_plans(tensor: int) -> list[str]:
    """Each bad plan must fail on EVERY rank (before a collective could hang), naming the numbers."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    grid = Grid(pipe=2, tensor=tensor)
    three_heads = GPTConfig(vocab_size=32, n_layer=2, n_head=3, d_model=12, seq_len=8)
    cases = [(three_heads, gpt_tensor_plan()),                           # 3 heads over 2 tensor ranks
             (CFG, lambda m: {"weight_holder": ColwiseParallel()} if type(m).__name__ == "Block" else None),
             (CFG, lambda m: {} if type(m).__name__ != "Embedding" else {"": ColwiseParallel()})]  # tied layer
    messages = []
    for cfg, plan in cases:
        try:
            PipelineModule(gpt_specs(cfg), grid=grid, loss_fn=gpt_loss, tensor_plan=plan)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_bad_plans_fail_on_every_rank():
    for messages in run(_bad_plans, 4, 2):
        assert len(messages) == 3, messages
        assert "qkv (Linear) splits heads=3 over tensor degree 2" in messages[0]
        assert "names 'weight_holder'" in messages[1]
        assert "TiedLayerSpec" in messages[2] and "replicated" in messages[2]


# -- checkpoints -------------------------------------------------------------------------------
def _config(pipe: int) -> dict:
    return {"train_batch_size": BATCH, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "pipeline": {"stages": pipe}}


def _step(parts, step: int) -> float:
    ids, targets = _batch(step)
    share = BATCH // parts.grid.data_size
    mine = slice(parts.grid.data_rank * share, (parts.grid.data_rank + 1) * share)
    loss = parts.runner.train_step(ids[mine], targets[mine]).item()
    parts.optimizer.step()
    parts.optimizer.zero_grad()
    return loss


def _whole_params(parts) -> dict[str, torch.Tensor]:
    return {n: whole_tensor(p).detach().clone() for n, p in parts.module.named_parameters()}


def _save_then_reload(directory: str):
    """Train 2 steps at tensor 2 x data 2, save; continue one step there and on two reloaded grids."""
    from pipezero.train.build import build
    from pipezero.train.checkpoint.state import load_state, save_state

    def parts_of(pipe, tensor):
        return build(_config(pipe), specs=gpt_specs(CFG), loss_fn=gpt_loss, tensor=tensor,
                     tensor_plan=gpt_tensor_plan())
    parts = parts_of(1, 2)
    for step in range(2):
        _step(parts, step)
    save_state(parts, directory, 2)
    out = {"saved": (_step(parts, 2), _whole_params(parts))}
    for pipe, tensor in [(1, 2), (2, 1)]:   # the same grid; tensor 1 (pipe 2 x data 2)
        parts = parts_of(pipe, tensor)
        assert load_state(parts, directory)["step"] == 2
        out[(pipe, tensor)] = (_step(parts, 2), _whole_params(parts))
    return out


def test_checkpoint_from_tensor_2_reloads_at_tensor_1_and_2(tmp_path):
    results = run(_save_then_reload, 4, str(tmp_path), timeout=120)
    merged: dict = {}
    for rank_out in results:
        for key, (loss, params) in rank_out.items():
            merged.setdefault(key, [loss, {}])[1].update(params)
    loss, params = merged.pop("saved")
    assert len(params) == 2 + 12 * CFG.n_layer + 2, sorted(params)   # every parameter came back
    for key, (other_loss, other_params) in merged.items():
        torch.testing.assert_close(other_loss, loss, rtol=1e-6, atol=1e-6, msg=str(key))
        assert other_params.keys() == params.keys()
        for name in params:
            torch.testing.assert_close(other_params[name], params[name], rtol=1e-5, atol=1e-6,
                                       msg=f"{key} {name}")
