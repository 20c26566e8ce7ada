"""Issue 28's checkpoint / optimizer data-loss faults, on the public API, in as few spawned worlds as possible.

One 2-rank world runs every distributed case in turn (each returns what the test asserts):
ZeRO-3 save -> load in the job that wrote it (item 1), frozen parameters at every ZeRO stage and in
a pipeline and in the exported model (item 2), unused parameters left alone by the optimizer at
every stage (item 12). The single-process cases (scaler rule, Adagrad, DeepSpeed arguments, model
config on resume, the engine's tag) run in one 1-rank world.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness import run


def _engine(stage: int, model: nn.Module, **extra):
    from pipezero.train import initialize

    cfg = {"train_batch_size": 4, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, **extra}
    engine, *_ = initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                            config=cfg)
    return engine


def _mlp(seed: int = 0, frozen: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if frozen:
        model[0].requires_grad_(False)
    return model


def _steps(engine, n: int = 2) -> None:
    import torch.distributed as dist

    for i in range(n):
        g = torch.Generator().manual_seed(10 * i + dist.get_rank())
        loss = engine(torch.randn(2, 8, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()


def _whole(engine) -> dict[str, torch.Tensor]:
    with engine.optimizer.gathered_parameters():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _zero3_same_job(directory: str) -> list:
    """Item 1: save then load in the job that wrote it, and into a fresh job with other weights."""
    engine = _engine(3, _mlp())
    _steps(engine)
    engine.save_checkpoint(directory)
    saved = _whole(engine)
    engine.load_checkpoint(directory)
    fresh = _engine(3, _mlp(seed=5))
    fresh.load_checkpoint(directory)
    return [saved, _whole(engine), _whole(fresh)]


def _frozen(directory: str, stage: int) -> list:
    """Item 2: frozen weights saved and loaded (a fresh job has other frozen values)."""
    engine = _engine(stage, _mlp(frozen=True))
    _steps(engine)
    engine.save_checkpoint(directory)
    fresh = _engine(stage, _mlp(seed=5, frozen=True))
    fresh.load_checkpoint(directory)
    return [_whole(engine), _whole(fresh)]


class FrozenLinear(nn.Linear):
    """A pipeline layer whose weights do not train (e.g. a frozen embedding under LoRA)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.requires_grad_(False)


_PIPE_SPECS = [(FrozenLinear, 8, 8), (nn.Linear, 8, 8), (nn.Linear, 8, 8), (nn.Linear, 8, 4)]


def _pipe_parts(seed: int):
    import torch.nn.functional as F
    from pipezero.pipe import LayerSpec
    from pipezero.train.build import build

    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2},
           "zero_optimization": {"stage": 1}}
    return build(cfg, specs=[LayerSpec(*s) for s in _PIPE_SPECS], loss_fn=F.mse_loss, seed=seed)


def _frozen_pipe(directory: str) -> list:
    """Item 2 in a pipeline: each stage saves its frozen layers; the export holds them all."""
    from pipezero.pipe import LayerSpec
    from pipezero.train.checkpoint.state import export_model, load_state, save_state

    parts = _pipe_parts(0)
    g = torch.Generator().manual_seed(3)
    parts.runner.train_step(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
    parts.optimizer.step()
    save_state(parts, directory, 1)
    fresh = _pipe_parts(7)
    load_state(fresh, directory)
    saved = {n: p.detach().clone() for n, p in parts.module.named_parameters()}
    loaded = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    exported = None
    if parts.grid.rank == 0:
        from safetensors.torch import load_file
        path = export_model(directory, f"{directory}/model.safetensors", [LayerSpec(*s) for s in _PIPE_SPECS])
        exported = sorted(load_file(str(path)))
    return [saved, loaded, exported]


class WithSpare(nn.Module):
    """An MLP with a layer its forward never uses (torch leaves its .grad None)."""

    def __init__(self):
        super().__init__()
        self.net, self.spare = _mlp(), nn.Linear(4, 4)

    def forward(self, x):
        return self.net(x)


def _unused(stage: int) -> list:
    """Item 12: AdamW with weight decay must not touch `spare`; a step() without backward touches nothing."""
    engine = _engine(stage, WithSpare())
    before = _whole(engine)
    _steps(engine, 3)
    trained = _whole(engine)
    engine.step()  # no backward since the last step
    return [before, trained, _whole(engine)]


def _adagrad(stage: int) -> list:
    """Item 15: Adagrad (its state made in __init__) under ZeRO, against torch's Adagrad in one process."""
    import copy

    import torch.distributed as dist
    from pipezero.zero import ZeroOptimizer

    model = _mlp()
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, initial_accumulator_value=0.1)  # noqa: E731
    opt, ref_opt = ZeroOptimizer(make(model), stage=stage, module=model), make(ref)
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        mine = x.chunk(dist.get_world_size())[dist.get_rank()]
        model(mine).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with opt.gathered_parameters():
        return [{n: p.detach().clone() for n, p in model.named_parameters()}, dict(ref.named_parameters())]


def _try(fn, *args):
    """fn's result, or its error as text: one failing case fails its own test, not the whole world's."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported by the test that reads it
        return f"{type(err).__name__}: {err}"


def _world(directory: str) -> dict:
    from pathlib import Path

    root = Path(directory)
    out = {"zero3": _try(_zero3_same_job, str(root / "zero3")), "frozen_pipe": _try(_frozen_pipe, str(root / "pipe")),
           "hand_zero": _try(_hand_composed, str(root / "hand"), 2)}
    for stage in range(4):
        out[f"frozen{stage}"] = _try(_frozen, str(root / f"frozen{stage}"), stage)
        out[f"unused{stage}"] = _try(_unused, stage)
        out[f"adagrad{stage}"] = _try(_adagrad, stage)
    return out


def _result(world: list, key: str) -> list:
    """Every rank's result of one case (its error, if it raised, fails the test that reads it)."""
    results = [r[key] for r in world]
    for r in results:
        assert not isinstance(r, str), r
    return results


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run(_world, 2, str(tmp_path_factory.mktemp("state")), timeout=300)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_zero3_checkpoint_loads_in_the_job_that_wrote_it(world):
    for saved, reloaded, fresh in _result(world, "zero3"):
        assert saved["0.weight"].shape == (16, 8)
        _same(saved, reloaded)
        _same(saved, fresh)


@pytest.mark.parametrize("stage", range(4))
def test_frozen_parameters_are_saved_and_loaded(world, stage):
    for saved, fresh in _result(world, f"frozen{stage}"):
        _same(saved, fresh)


def test_frozen_pipeline_layers_are_saved_and_exported(world):
    for saved, fresh, _ in _result(world, "frozen_pipe"):
        _same(saved, fresh)
    exported = world[0]["frozen_pipe"][2]
    assert exported == sorted(f"layers.{i}.{n}" for i in range(4) for n in ("bias", "weight"))


@pytest.mark.parametrize("stage", range(4))
def test_unused_parameters_are_left_alone(world, stage):
    for before, trained, idle in _result(world, f"unused{stage}"):
        spare = {k: v for k, v in before.items() if k.startswith("spare.")}
        _same(spare, {k: trained[k] for k in spare})  # torch: no decay without a gradient
        assert not torch.equal(before["net.0.weight"], trained["net.0.weight"])
        _same(trained, idle)  # torch and DeepSpeed stage 0: step() without backward changes nothing


@pytest.mark.parametrize("stage", range(4))
def test_adagrad_is_sharded_like_torch(world, stage):
    for mine, ref in _result(world, f"adagrad{stage}"):
        for key in ref:
            torch.testing.assert_close(mine[key], ref[key].detach(), rtol=1e-5, atol=1e-6, msg=key)


# -- one process: the loss-scale rule, the engine's DeepSpeed arguments and counters, the model config ------
def _scaler_resumes(directory: str) -> dict:
    """Item 7: what loss scale a resume trains at, for each (saved, configured) scaler."""
    from pathlib import Path

    kinds = {"fp32": {}, "dynamic": {"fp16": {"enabled": True}},
             "static128": {"fp16": {"enabled": True, "loss_scale": 128}},
             "static256": {"fp16": {"enabled": True, "loss_scale": 256}}}
    out = {}
    for saved, resumed in [("fp32", "dynamic"), ("static128", "static256"), ("dynamic", "dynamic"),
                           ("dynamic", "static256")]:
        where = Path(directory) / f"{saved}-{resumed}"
        engine = _engine(0, _mlp(), **kinds[saved])
        engine.parts.scaler.scale_state.scale = 1024.0 if saved == "dynamic" else engine.parts.scaler.loss_scale
        engine.save_checkpoint(where)
        fresh = _engine(0, _mlp(), **kinds[resumed])
        fresh.load_checkpoint(where)
        out[f"{saved}->{resumed}"] = fresh.parts.scaler.loss_scale
    return out


def _engine_counters(directory: str) -> dict:
    """Item 9 (ours; the DeepSpeed comparison is in tests/test_initialize_deepspeed.py)."""
    engine = _engine(1, _mlp())
    _steps(engine, 3)
    engine.optimizer.param_groups[0]["lr"] = 0.123  # changed by hand
    engine.save_checkpoint(directory, tag=1)
    fresh = _engine(1, _mlp())
    path, _ = fresh.load_checkpoint(directory, tag=1)
    return {"global_steps": fresh.global_steps, "lr": fresh.optimizer.param_groups[0]["lr"], "path": path}


def _deepspeed_arguments(directory: str) -> dict:
    """Item 20: DeepSpeed's initialize / save / load arguments, taken with its meaning or refused clearly."""
    import argparse
    import json
    from pathlib import Path

    from pipezero.train import initialize

    out = {}
    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    path = Path(directory) / "ds_config.json"
    path.write_text(json.dumps(cfg))
    model = _mlp()
    data = torch.utils.data.TensorDataset(torch.randn(12, 8))
    engine, opt, loader, sched = initialize(
        args=argparse.Namespace(deepspeed_config=str(path), local_rank=0), model=model,
        model_parameters=model.parameters(), training_data=data,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    out["loader"] = [len(b[0]) for b in loader]
    out["scheduler"] = type(sched).__name__ if sched is engine.lr_scheduler else None
    for x, in loader:
        engine.backward(engine(x).square().mean())
        engine.step()
    out["lr"] = opt.param_groups[0]["lr"]
    root = Path(directory) / "ckpt"
    engine.save_checkpoint(root, tag=1)
    engine.save_checkpoint(root, tag=2, save_latest=False)
    out["latest"] = (root / "latest").read_text().strip()
    moments = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    fresh, fresh_opt, *_ = initialize(model=_mlp(seed=3), config=cfg)
    fresh.load_checkpoint(root, tag=2, load_optimizer_states=False)
    out["no_optimizer_state"] = not fresh_opt.state
    out["weights"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.module.parameters()))
    fresh.load_checkpoint(root, tag=2)
    mine = fresh_opt.state[fresh_opt.param_groups[0]["params"][0]]
    out["optimizer_state"] = all(torch.equal(mine[k], v) for k, v in moments.items())
    for name, call in {"mpu": lambda: initialize(model=_mlp(), config=cfg, mpu=object()),
                       "strict": lambda: fresh.load_checkpoint(root, load_module_strict=False),
                       "custom": lambda: fresh.load_checkpoint(root, custom_load_fn=print)}.items():
        try:
            call()
            out[name] = "accepted"
        except (TypeError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def _model_config_checked(directory: str) -> dict:
    """Item 11: the API and train_gpt's resume refuse a checkpoint of a model with other settings."""
    import sys
    from pathlib import Path

    from pipezero.train.checkpoint import CheckpointError
    from pipezero.train.checkpoint.state import load_state, save_state

    engine = _engine(0, _mlp())
    save_state(engine.parts, Path(directory) / "api", 1, model_config={"n_head": 2, "d_model": 16})
    out = {}
    try:
        load_state(engine.parts, Path(directory) / "api", model_config={"n_head": 4, "d_model": 16})
        out["api"] = "loaded"
    except CheckpointError as err:
        out["api"] = str(err)
    load_state(engine.parts, Path(directory) / "api", model_config={"d_model": 16, "n_head": 2})  # the same
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "examples"))
    import train_gpt
    tiny = ["--pipe", "1", "--layers", "1", "--d-model", "16", "--seq-len", "8", "--batch-size", "2",
            "--micro-batches", "1", "--eval-interval", "100", "--steps-per-print", "100", "--save-interval", "1",
            "--out", str(Path(directory) / "gpt")]
    train_gpt.main([*tiny, "--heads", "2", "--steps", "1"])
    try:
        train_gpt.main([*tiny, "--heads", "4", "--steps", "2"])
        out["train_gpt"] = "resumed"
    except CheckpointError as err:
        out["train_gpt"] = str(err)
    return out


def _hand_composed(directory: str, zero_stage: int | None) -> list:
    """Issue 29 item 4: a chain built by hand (no build(), no Parts) saves its things and resumes exactly."""
    from pipezero.precision import LossScaler, MasterWeights
    from pipezero.train.checkpoint.saveable import load_things, save_things
    from pipezero.zero import ZeroOptimizer

    def job():
        model = _mlp().to(torch.bfloat16)
        opt = LossScaler(MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2)), check_finite=True)
        if zero_stage is not None:
            model = _mlp()
            opt = ZeroOptimizer(LossScaler(torch.optim.Adam(model.parameters(), lr=1e-2)), stage=zero_stage)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return model, opt, sched

    def train(model, opt, sched, steps):
        losses = []
        for i in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).to(next(model.parameters()).dtype)
            loss = model(x).float().square().mean()
            opt.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    model, opt, sched = job()
    train(model, opt, sched, 2)
    save_things(directory, 2, {"model": model, "optimizer": opt, "scheduler": sched}, meta={"note": "hand"})
    straight = train(model, opt, sched, 2)
    model, opt, sched = job()
    meta = load_things(directory, {"model": model, "optimizer": opt, "scheduler": sched})
    return [straight, train(model, opt, sched, 2), meta]


def _solo(directory: str) -> dict:
    from pathlib import Path

    root = Path(directory)
    return {"scaler": _try(_scaler_resumes, str(root / "scaler")), "counters": _try(_engine_counters, str(root / "c")),
            "deepspeed": _try(_deepspeed_arguments, directory), "model_config": _try(_model_config_checked, directory),
            "hand": _try(_hand_composed, str(root / "hand"), None)}


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    return run(_solo, 1, str(tmp_path_factory.mktemp("solo")), timeout=300)


def test_a_configured_dynamic_scaler_is_not_overridden_by_a_no_op_checkpoint(solo):
    scales = _result(solo, "scaler")[0]
    assert scales == {"fp32->dynamic": 2.0 ** 16,      # a fresh fp16 run's scale, not the fp32 run's 1.0
                      "static128->static256": 256.0,   # a static scale is configuration
                      "dynamic->dynamic": 1024.0,      # a dynamic trajectory continues
                      "dynamic->static256": 256.0}


def test_engine_tag_names_the_checkpoint_and_counters_resume(solo):
    got = _result(solo, "counters")[0]
    assert got["global_steps"] == 3 and got["lr"] == 0.123 and got["path"].endswith("step_00000001")


def test_deepspeed_arguments_are_taken_or_refused_clearly(solo):
    got = _result(solo, "deepspeed")[0]
    assert got["loader"] == [4, 4, 4] and got["scheduler"] == "StepLR" and got["lr"] == 1e-2 * 0.5 ** 3
    assert got["latest"] == "step_00000001"
    assert got["no_optimizer_state"] and got["weights"] and got["optimizer_state"]
    assert "mpu=" in got["mpu"] and "tensor=" in got["mpu"]
    assert "load_module_strict=False" in got["strict"] and "custom_load_fn" in got["custom"]


def test_resume_with_another_model_config_is_refused(solo):
    got = _result(solo, "model_config")[0]
    assert "n_head=2 (here 4)" in got["api"]
    assert "n_head=2 (here 4)" in got["train_gpt"]


@pytest.mark.parametrize("where", ["solo", "world"])
def test_a_hand_composed_chain_saves_its_things_and_resumes_exactly(solo, world, where):
    results = _result(solo, "hand") if where == "solo" else _result(world, "hand_zero")
    for straight, resumed, meta in results:
        assert resumed == straight and meta == {"note": "hand", "step": 2}
