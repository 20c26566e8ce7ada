"""initialize()'s engine accumulates gradients as DeepSpeed's engine does, checked against DeepSpeed.

A ds_config with gradient_accumulation_steps = 4 and the DeepSpeed loop, `engine.backward(loss);
engine.step()` once per micro-batch: DeepSpeed divides each loss by 4 and steps the optimizer
(and the LR schedule) on every 4th call only. The same loop, config, model and data run through
deepspeed.initialize and through pipezero's initialize, 2 gloo ranks, fp32, ZeRO 0-2: the
losses, the step counters and the final parameters must agree. DeepSpeed is a test-only
dependency (its shared-memory kernel build is switched off, see test_hf_deepspeed.py).
"""

import sys

import pytest
import torch
import torch.nn.functional as F

deepspeed = pytest.importorskip("deepspeed")

from harness import run  # noqa: E402
from test_train_build import _seeded_mlp as _mlp  # noqa: E402

ACCUMULATION, MICRO_BATCHES = 4, 8


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACCUMULATION,
            "zero_optimization": {"stage": stage}, "gradient_clipping": 0.5, "steps_per_print": 10**9,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 3}}}


def _loop(engine, model) -> tuple:
    """The DeepSpeed loop over this rank's micro-batches; per call: loss, micro and global steps."""
    import torch.distributed as dist

    rows = []
    for i in range(MICRO_BATCHES):
        g = torch.Generator().manual_seed(100 * i + dist.get_rank())
        x, y = torch.randn(2, 8, generator=g), torch.randint(0, 4, (2,), generator=g)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        rows.append((loss.item(), engine.micro_steps, engine.global_steps))
    return rows, [p.detach().clone() for p in model.parameters()]


def _accumulate(initialize, stage: int):
    model = _mlp()
    engine, *_ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                            config=_config(stage))
    return _loop(engine, model)


def _on_deepspeed(loop, *args):
    """loop(deepspeed.initialize, *args) in a harness worker (DeepSpeed's globals stay in its workers)."""
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo: no shm kernel to compile
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    return loop(deepspeed.initialize, *args)


def _on_pipezero(loop, *args):
    """loop(pipezero.train.initialize, *args) in a harness worker."""
    from pipezero.train import initialize

    return loop(initialize, *args)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_accumulation_steps_as_deepspeed(stage):
    ours = run(_on_pipezero, 2, _accumulate, stage)
    theirs = run(_on_deepspeed, 2, _accumulate, stage, timeout=300, discard=True)
    for (rows, params), (ds_rows, ds_params) in zip(ours, theirs):
        assert [r[1:] for r in rows] == [r[1:] for r in ds_rows]  # the same boundaries
        torch.testing.assert_close(torch.tensor([r[0] for r in rows]), torch.tensor([r[0] for r in ds_rows]),
                                   rtol=1e-5, atol=1e-6)
        for p, q in zip(params, ds_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _save_tag_and_resume(initialize, directory: str) -> dict:
    """Issue 28 item 9: save with tag=1 after 3 steps, a param group's lr changed by hand; a fresh engine loads it."""
    import torch.distributed as dist

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}

    def engine():
        model = _mlp()
        return initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=config)[0]
    first = engine()
    for i in range(3):
        g = torch.Generator().manual_seed(100 * i + dist.get_rank())
        first.backward(F.cross_entropy(first(torch.randn(2, 8, generator=g)), torch.randint(0, 4, (2,), generator=g)))
        first.step()
    first.optimizer.param_groups[0]["lr"] = 0.123
    first.save_checkpoint(directory, tag=1)
    second = engine()
    second.load_checkpoint(directory, tag=1)
    return {"global_steps": second.global_steps, "lr": second.optimizer.param_groups[0]["lr"],
            "params": [p.detach().clone() for p in second.module.parameters()]}


def test_save_checkpoint_tag_and_hand_set_lr_as_deepspeed(tmp_path):
    ours = run(_on_pipezero, 2, _save_tag_and_resume, str(tmp_path / "ours"))
    theirs = run(_on_deepspeed, 2, _save_tag_and_resume, str(tmp_path / "ds"), timeout=300, discard=True)
    for mine, ds in zip(ours, theirs):
        assert (mine["global_steps"], mine["lr"]) == (ds["global_steps"], ds["lr"]) == (3, 0.123)
        for p, q in zip(mine["params"], ds["params"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _save_on_two(initialize, directory: str) -> None:
    """train_batch_size 8 of micro-batches of 2 on 2 ranks (2 accumulation steps): 7 calls, saved mid-accumulation."""
    import torch.distributed as dist

    engine = _resized_engine(initialize)
    for i in range(7):
        g = torch.Generator().manual_seed(100 * i + dist.get_rank())
        engine.backward(F.cross_entropy(engine(torch.randn(2, 8, generator=g)), torch.randint(0, 4, (2,), generator=g)))
        engine.step()
    engine.save_checkpoint(directory)


def _resized_engine(initialize):
    model = _mlp()
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9}
    return initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=config)[0]


def _load_on_one(initialize, directory: str) -> list:
    """The same train_batch_size on 1 rank (4 accumulation steps); per call after the load: boundary, global_steps."""
    engine = _resized_engine(initialize)
    engine.load_checkpoint(directory)
    rows = [engine.global_steps]
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(F.cross_entropy(engine(torch.randn(2, 8, generator=g)), torch.randint(0, 4, (2,), generator=g)))
        engine.step()
        rows.append((boundary, engine.global_steps))
    return rows


def test_global_steps_resume_on_another_world_size_as_deepspeed(tmp_path):
    """Saved on 2 ranks, loaded on 1 with the same train_batch_size (so other accumulation steps): DeepSpeed
    resumes the saved global_steps and starts a fresh accumulation; so must we."""
    rows = {}
    for name, on in [("ours", _on_pipezero), ("ds", _on_deepspeed)]:
        run(on, 2, _save_on_two, str(tmp_path / name), timeout=300, discard=name == "ds")
        rows[name], = run(on, 1, _load_on_one, str(tmp_path / name), timeout=300, discard=name == "ds")
    assert rows["ours"] == rows["ds"]


def _load_nothing(initialize, directory: str) -> tuple:
    """A resuming loop's first run: load_checkpoint of a directory without `latest` (empty, then absent)."""
    engine = _resized_engine(initialize)
    before = [p.detach().clone() for p in engine.module.parameters()]
    found = [engine.load_checkpoint(directory), engine.load_checkpoint(directory + "/absent")]
    unchanged = all(torch.equal(p, q) for p, q in zip(before, engine.module.parameters()))
    return found, engine.global_steps, unchanged


def test_load_checkpoint_without_latest_returns_none_as_deepspeed(tmp_path):
    ours, = run(_on_pipezero, 1, _load_nothing, str(tmp_path))
    theirs, = run(_on_deepspeed, 1, _load_nothing, str(tmp_path), timeout=300, discard=True)
    assert ours == theirs == ([(None, None), (None, None)], 0, True)


def _tag_from_latest(initialize, directory: str) -> int:
    """Resume the way scripts do it by hand: the tag read from `latest`, passed to load_checkpoint."""
    import os

    first = _resized_engine(initialize)
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        first.backward(F.cross_entropy(first(torch.randn(2, 8, generator=g)), torch.randint(0, 4, (2,), generator=g)))
        first.step()
    first.save_checkpoint(directory)
    with open(os.path.join(directory, "latest")) as f:
        tag = f.read().strip()
    second = _resized_engine(initialize)
    second.load_checkpoint(directory, tag=tag)
    return second.global_steps


def test_the_tag_in_latest_loads_as_deepspeed(tmp_path):
    ours, = run(_on_pipezero, 1, _tag_from_latest, str(tmp_path / "ours"))
    theirs, = run(_on_deepspeed, 1, _tag_from_latest, str(tmp_path / "ds"), timeout=300, discard=True)
    assert ours == theirs == 2


# (stage, bf16 section): fp32 at ZeRO 1-3, and bf16 at stage 0 with check_grad_overflow false, which
# only DeepSpeed's ZeRO optimizers honour (its stage-0 bf16 wrapper tests the gradient norm regardless)
_NONFINITE = [(1, None), (2, None), (3, None), (0, {"enabled": True, "check_grad_overflow": False})]


def _nonfinite_step_skipped(initialize) -> list:
    """No clipping; rank 0's second loss is inf. DeepSpeed skips that step on all ranks in each case of
    _NONFINITE (its optimizers test every step's gradient norm); per case: the losses and the parameters."""
    import torch.distributed as dist

    out = []
    for stage, bf16 in _NONFINITE:
        model = _mlp()
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "gradient_clipping": 0.0, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
                  **({"bf16": bf16} if bf16 else {})}
        dtype = torch.bfloat16 if bf16 else torch.float32  # SGD: Adam's first step is ±lr on bf16 rounding noise
        engine, *_ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        losses = []
        for i in range(3):
            g = torch.Generator().manual_seed(100 * i + dist.get_rank())
            x, y = torch.randn(2, 8, generator=g).to(dtype), torch.randint(0, 4, (2,), generator=g)
            loss = F.cross_entropy(engine(x).float(), y)
            engine.backward(loss * float("inf") if i == 1 and dist.get_rank() == 0 else loss)
            engine.step()
            losses.append(loss.item())
        out.append((losses, [p.detach().float().clone() for p in model.parameters()]))
    return out


def test_a_nonfinite_step_is_skipped_where_deepspeed_skips_it():
    ours = run(_on_pipezero, 2, _nonfinite_step_skipped)
    theirs = run(_on_deepspeed, 2, _nonfinite_step_skipped, timeout=300, discard=True)
    for mine, ds in zip(ours, theirs):
        for (losses, params), (ds_losses, ds_params) in zip(mine, ds):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ds_losses), rtol=1e-5, atol=1e-6)
            for p, q in zip(params, ds_params):
                assert p.isfinite().all()
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


_TORCH_ADAM = [{"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
               {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
               {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False}}]


def _config_optimizer(initialize) -> list:
    """The config's "optimizer" with torch_adam (DeepSpeed builds torch's Adam/AdamW from the params, so
    torch's defaults fill the rest): three steps each; the parameters."""
    import torch.distributed as dist

    out = []
    for section in _TORCH_ADAM:
        model = _mlp()
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": section, "steps_per_print": 10**9}
        engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
        for i in range(3):
            g = torch.Generator().manual_seed(100 * i + dist.get_rank())
            engine.backward(F.cross_entropy(engine(torch.randn(2, 8, generator=g)), torch.randint(0, 4, (2,), generator=g)))
            engine.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_torch_adam_takes_torchs_defaults_as_deepspeed():
    ours, = run(_on_pipezero, 1, _config_optimizer)
    theirs, = run(_on_deepspeed, 1, _config_optimizer, timeout=300, discard=True)
    for section, params, ds_params in zip(_TORCH_ADAM, ours, theirs):
        for p, q in zip(params, ds_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{section}: {m}")
