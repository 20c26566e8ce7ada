"""Issue 29 item 4: a job composed by hand checkpoints through save_state / load_state, no ZeroOptimizer needed.

A plain torch optimizer, a LossScaler or a LossScaler(MasterWeights) chain, with an LR scheduler, in
`HandParts`: a resume equals the uninterrupted run bitwise (losses, parameters, loss scale). A plain
optimizer's state is written in the layout ZeroOptimizer consolidates into, so a checkpoint of a plain
job on one process resumes under ZeRO-1 over data 2, and ZeRO-1's checkpoint resumes the plain job:
both within 1e-6 of the uninterrupted plain run (two data ranks average their halves' gradients, one
process takes the whole batch's: float rounding apart, the same numbers).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from pipezero.chain import ChainWrapper
from pipezero.precision import LossScaler, MasterWeights
from pipezero.train.checkpoint import CheckpointError
from pipezero.train.checkpoint.state import load_state, save_state
from pipezero.train.checkpoint.state_parts import HandParts
from pipezero.zero import ZeroConfig, ZeroOptimizer

BATCH = 8


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _job(kind: str, seed: int = 0) -> HandParts:
    model = _model(seed)
    if kind == "master":  # bf16 model, fp32 masters
        model = model.to(torch.bfloat16)
        opt = LossScaler(MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2)), check_finite=True)
    elif kind == "scaler":  # fp16's dynamic scaler on an fp32 model: its scale moves and must resume
        opt = LossScaler(torch.optim.AdamW(model.parameters(), lr=1e-2), init_scale=2.0 ** 8, scale_window=2)
    elif kind == "zero1":
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), stage=1, group=dist.group.WORLD)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return HandParts(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))


def _train(parts: HandParts, start: int, stop: int) -> list[float]:
    """Steps start..stop-1 on batch i (this data rank's share of it); the whole batch's mean loss per step."""
    rank, world = parts.grid.data_rank, parts.grid.data_size
    dtype = next(parts.module.parameters()).dtype
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = []
    for i in range(start, stop):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(BATCH, 8, generator=g)[share], torch.randn(BATCH, 4, generator=g)[share]
        loss = (parts.module(x.to(dtype)).float() - y).square().mean()
        if isinstance(parts.optimizer, ChainWrapper):
            parts.optimizer.backward(loss)
        else:
            loss.backward()
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad()
        whole = loss.detach().clone()
        if world > 1:
            dist.all_reduce(whole)
            whole /= world
        losses.append(whole.item())
    return losses


def _params(parts: HandParts) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in parts.module.parameters()]


@pytest.mark.parametrize("kind", ["plain", "scaler", "master"])
def test_a_hand_composed_job_resumes_as_if_never_stopped(tmp_path, kind):
    straight = _job(kind)
    _train(straight, 0, 3)
    save_state(straight, tmp_path, 3)
    losses = _train(straight, 3, 6)
    resumed = _job(kind, seed=1)
    meta = load_state(resumed, tmp_path)
    assert meta["step"] == 3 and meta["chain_links"] == {"plain": [], "scaler": ["LossScaler"],
                                                          "master": ["LossScaler", "MasterWeights"]}[kind]
    assert _train(resumed, 3, 6) == losses
    for a, b in zip(_params(straight), _params(resumed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()
    if kind != "plain":
        assert resumed.optimizer.loss_scale == straight.optimizer.loss_scale
    weights_only = _job(kind, seed=1)  # the optimizer state matters: without it the run differs
    load_state(weights_only, tmp_path, optimizer=False)
    assert _train(weights_only, 3, 6) != losses


def test_another_chain_is_refused_naming_its_links(tmp_path):
    plain = _job("plain")
    _train(plain, 0, 1)
    save_state(plain, tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"the links \[\] .* this one \['LossScaler'\]"):
        load_state(_job("scaler"), tmp_path)
    with pytest.raises(TypeError, match="HandParts\\(optimizer=Sequential\\)"):
        HandParts(_model(), _model())


def _zero_leg(directory: str) -> tuple[list[float], list[torch.Tensor], list]:
    """ZeRO-1 over data 2 resumes the plain job's step-2 checkpoint, trains steps 2-3 and saves step 4."""
    parts = _job("zero1", seed=1)
    load_state(parts, f"{directory}/plain")
    losses = _train(parts, 2, 4)
    save_state(parts, f"{directory}/zero", 4)
    state = [(torch.as_tensor(s["exp_avg"]).clone(), float(s["step"])) for _, s in parts.optimizer.per_parameter_state()]
    return losses, _params(parts), state


def test_a_plain_checkpoint_resumes_under_zero1_data2_and_back(tmp_path):
    straight = _job("plain")
    _train(straight, 0, 2)
    save_state(straight, tmp_path / "plain", 2)
    losses = _train(straight, 2, 4)
    after_zero = _params(straight)
    moments = [(s["exp_avg"].clone(), float(s["step"])) for s in straight.optimizer.state.values()]
    losses += _train(straight, 4, 6)
    results = run(_zero_leg, 2, str(tmp_path))
    for zero_losses, params, state in results:
        torch.testing.assert_close(zero_losses, losses[:2], rtol=1e-6, atol=1e-6)
        for a, b in zip(params, after_zero, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for (m, step), (ref_m, ref_step) in zip(state, moments, strict=True):
            torch.testing.assert_close(m, ref_m, rtol=1e-5, atol=1e-6)
            assert step == ref_step == 4.0
    back = _job("plain", seed=1)
    assert load_state(back, tmp_path / "zero")["grid"] == {"pipe": 1, "data": 2, "tensor": 1}
    torch.testing.assert_close(_train(back, 4, 6), losses[2:], rtol=1e-6, atol=1e-6)
    for a, b in zip(_params(back), _params(straight), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# -- a pipeline's hand chain: each stage's masters come back from its own weights --------------------------
def _pipe_job(seed: int):
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    from test_grad_dtypes import CFG, gpt_loss, gpt_specs

    grid = Grid(pipe=2)
    torch.manual_seed(seed)
    model = PipelineModule(gpt_specs(CFG), grid=grid, loss_fn=gpt_loss, compile=False).to(torch.bfloat16)
    opt = LossScaler(MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2)))
    runner = PipelineRunner(model, OneFOneB(num_microbatches=2), optimizer=opt)
    return HandParts(model, opt, grid=grid), runner


def _pipe_steps(parts: HandParts, runner, start: int, stop: int) -> list[float]:
    losses = []
    for i in range(start, stop):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 64, (4, 9), generator=g)
        losses.append(runner.train_step(tokens[:, :-1], tokens[:, 1:]).item())
        parts.optimizer.step()
        parts.optimizer.zero_grad()
    return losses


def _pipe_resume(directory: str):
    from safetensors import safe_open

    straight, runner = _pipe_job(0)
    _pipe_steps(straight, runner, 0, 2)
    path = save_state(straight, directory, 2)
    losses = _pipe_steps(straight, runner, 2, 4)
    resumed, runner = _pipe_job(1)
    load_state(resumed, directory)
    with safe_open(f"{path}/rank_{dist.get_rank():05d}.safetensors", "pt") as f:
        keys = list(f.keys())
    return losses, _pipe_steps(resumed, runner, 2, 4), _params(straight), _params(resumed), keys


def test_a_pipeline_hand_chain_with_masters_resumes_as_if_never_stopped(tmp_path):
    """pipe 2, bf16 model, LossScaler(MasterWeights(AdamW)) without ZeRO: each stage's masters resume from its
    own stage's weights (they were saved as rank 0's numbered masters, which stage 1 could not load), bitwise,
    and the checkpoint holds each master once (as model/<name>, not again in the chain's state)."""
    for losses, again, params, resumed, keys in run(_pipe_resume, 2, str(tmp_path)):
        assert again == losses
        for a, b in zip(params, resumed, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not [k for k in keys if k.startswith("chain.")], keys


# -- a torch LR scheduler over a pipeline's layer-wise param groups ------------------------------------------
def _layerwise_job(seed: int, kind: str):
    """pipe 2, fp32, one param group per layer with lr halving by layer index (layer-wise lr decay), so the
    stages hold different numbers of groups with different lrs; a torch scheduler over them."""
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    from test_grad_dtypes import CFG, gpt_loss, gpt_specs

    grid = Grid(pipe=2)
    model = PipelineModule(gpt_specs(CFG), grid=grid, loss_fn=gpt_loss, compile=False, seed=seed)
    layers: dict[int, list] = {}
    for name, p in model.named_parameters():  # "layers.<i>...."; the tied embedding counts as layer 0
        layers.setdefault(int(name.split(".")[1]) if name.startswith("layers.") else 0, []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "lr": 1e-2 * 0.5 ** i} for i, ps in sorted(layers.items())])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)) if kind == "lambda" else \
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    return HandParts(model, opt, scheduler, grid=grid), PipelineRunner(model, OneFOneB(num_microbatches=2),
                                                                       optimizer=opt)


def _scheduled_steps(parts: HandParts, runner, start: int, stop: int) -> list[float]:
    """Steps start..stop-1, each followed by a scheduler step; the losses, then every local group's lr."""
    losses = []
    for i in range(start, stop):
        tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(i))
        losses.append(runner.train_step(tokens[:, :-1], tokens[:, 1:]).item())
        parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad()
    return losses + [g["lr"] for g in parts.optimizer.param_groups]


def _layerwise_resume(directory: str) -> list[tuple[list[float], list[float]]]:
    out = []
    for kind in ("lambda", "cosine"):
        straight, runner = _layerwise_job(0, kind)
        _scheduled_steps(straight, runner, 0, 2)
        save_state(straight, f"{directory}/{kind}", 2)
        truth = _scheduled_steps(straight, runner, 2, 4)
        resumed, runner = _layerwise_job(1, kind)
        load_state(resumed, f"{directory}/{kind}")
        out.append((truth, _scheduled_steps(resumed, runner, 2, 4)))
    return out


def test_a_torch_scheduler_over_each_stages_own_param_groups_resumes(tmp_path):
    """pipe 2, a LambdaLR / CosineAnnealingLR over layer-wise lrs: each stage resumes with its own groups'
    base lrs (the meta held rank 0's scheduler state, so stage 1 took stage 0's base_lrs: a shorter list
    crashed its next scheduler.step(), one of equal length trained it with stage 0's lrs)."""
    for per_kind in run(_layerwise_resume, 2, str(tmp_path)):
        for truth, resumed in per_kind:
            assert resumed == truth


# -- a checkpoint refused on one stage changes nothing on the others -------------------------------------------
def _scaled_pipe_job(n_layer: int):
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    from test_grad_dtypes import CFG, gpt_loss, gpt_specs

    grid = Grid(pipe=2)
    specs = gpt_specs(dataclasses.replace(CFG, n_layer=n_layer))
    model = PipelineModule(specs, grid=grid, loss_fn=gpt_loss, compile=False, partition_method="uniform")
    opt = LossScaler(torch.optim.AdamW(model.parameters(), lr=1e-2), init_scale=2.0 ** 10, scale_window=1)
    return HandParts(model, opt, grid=grid), PipelineRunner(model, OneFOneB(num_microbatches=2), optimizer=opt)


def _refused_on_the_last_stage(directory: str) -> tuple[float, float, str]:
    saved, runner = _scaled_pipe_job(2)
    for i in range(2):  # scale_window=1: the scale grows every step
        tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(i))
        runner.train_step(tokens[:, :-1], tokens[:, 1:])
        saved.optimizer.step()
        saved.optimizer.zero_grad()
    save_state(saved, directory, 2)
    other, _ = _scaled_pipe_job(3)  # one block more: only the last stage lacks names in the checkpoint
    before = other.optimizer.loss_scale
    with pytest.raises(CheckpointError, match="does not fit the model") as err:
        load_state(other, directory)
    return before, other.optimizer.loss_scale, str(err.value)


def test_a_checkpoint_refused_on_one_stage_loads_nothing_on_the_others(tmp_path):
    """pipe 2, LossScaler chain: a checkpoint of a 2-block model onto 3 blocks is refused on every rank, and no
    rank keeps any of it (stage 0, whose names fit, had loaded the checkpoint's loss scale before the ranks
    agreed: a job that went on after the error scaled its loss differently on each stage)."""
    for before, after, message in run(_refused_on_the_last_stage, 2, str(tmp_path)):
        assert after == before == 2.0 ** 10, (before, after)
        assert "missing ['model/layers.3." in message


# -- each rank's own random generators ------------------------------------------------------------------------
def _draws_after_resume(directory: str) -> tuple[list[float], list[float]]:
    import random

    rank = dist.get_rank()
    parts = _job("plain")
    random.seed(100 + rank)  # e.g. a per-rank data shuffle
    torch.manual_seed(200 + rank)
    random.gauss(0, 1)  # leaves the second normal of the pair cached
    save_state(parts, directory, 1)
    truth = [random.random(), random.gauss(0, 1), torch.rand(1).item()]
    random.seed(0)
    torch.manual_seed(0)
    load_state(_job("plain", seed=1), directory)
    return truth, [random.random(), random.gauss(0, 1), torch.rand(1).item()]


def test_every_rank_resumes_its_own_python_random_state(tmp_path):
    """data 2: each rank continues its own `random` stream (the meta held rank 0's, so after a resume
    rank 1 drew rank 0's numbers: per-rank shuffles became the same on every data rank)."""
    results = run(_draws_after_resume, 2, str(tmp_path))
    for truth, resumed in results:
        assert resumed == truth
    assert results[0][0] != results[1][0]


# -- ZeroOptimizer's state resumes where its optimizer steps (fused Adam's device, the host) ---------------
def _zero_job(device: str, seed: int, **zero) -> HandParts:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=not zero)
    return HandParts(model, ZeroOptimizer(adam, config=ZeroConfig(**{"stage": 1, **zero})))


def _zero_steps(parts: HandParts, start: int, stop: int) -> list[float]:
    device = next(parts.module.parameters()).device
    losses = []
    for i in range(start, stop):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(BATCH, 8, generator=g).to(device), torch.randn(BATCH, 4, generator=g).to(device)
        loss = (parts.module(x) - y).square().mean()
        loss.backward()
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        losses.append(loss.item())
    return losses


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device, zero", [
    ("cpu", {}), pytest.param("cuda", {}, marks=_CUDA),                           # fused AdamW
    ("cpu", {"stage": 2, "offload_optimizer": True}),                            # the host steps
    ("cpu", {"offload_optimizer": True, "delayed_param_update": True}),
], ids=["fused-cpu", "fused-cuda", "offload", "offload-delayed"])
def test_zero_state_resumes_where_its_optimizer_steps(tmp_path, device, zero):
    """ZeroOptimizer put the loaded `step` where the checkpoint had it (the CPU), and torch's fused CUDA
    Adam refused it at the first step after a resume (the main job on a GPU: `state_steps is on cpu`);
    now torch's own loader places each value as the group needs. The offloaded optimizer (on the host,
    with or without the delayed update) resumes bitwise too."""
    straight = _zero_job(device, 0, **zero)
    _zero_steps(straight, 0, 2)
    save_state(straight, tmp_path, 2)
    losses = _zero_steps(straight, 2, 4)
    resumed = _zero_job(device, 1, **zero)
    load_state(resumed, tmp_path)
    assert _zero_steps(resumed, 2, 4) == losses
    for opt in (straight.optimizer, resumed.optimizer):
        opt.apply_delayed_update()
    for a, b in zip(_params(straight), _params(resumed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
