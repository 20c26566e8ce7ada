"""build(): the seed's ds_config and a pipeline config become explicit parts; bad combinations raise."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from harness import run

ROOT = Path(__file__).resolve().parents[1]
SEED_CONFIG = ROOT / "examples" / "configs" / "seed_ds_config.json"
sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPTConfig, gpt_loss, gpt_specs  # noqa: E402

TINY = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def _seed_parts() -> dict:
    """The seed's config verbatim, on its MLP: ZeRO-3 + offload + fp16 dynamic scaling, one step."""
    from pipezero.train.build import build

    parts = build(str(SEED_CONFIG), model=_mlp(), hidden_size=512)
    x = torch.randn(32, 784, dtype=parts.dtype)
    y = torch.randint(0, 10, (32,))
    loss = nn.functional.cross_entropy(parts.module(x).float(), y)
    parts.optimizer.backward(loss)
    stepped = parts.optimizer.step()
    return {"repr": repr(parts.optimizer), "stage": parts.optimizer.stage, "scale": parts.scaler.loss_scale,
            "batch": parts.config.batch, "runner": parts.runner, "dtype": parts.dtype, "stepped": stepped,
            "finite": bool(torch.isfinite(loss))}


def test_seed_config_builds_the_chain():
    got = run(_seed_parts, 1)[0]
    assert got["stage"] == 3 and got["runner"] is None
    assert got["repr"].startswith("ZeroOptimizer(stage=3, LossScaler(dynamic")
    assert got["batch"].train_batch_size == 32 and got["batch"].micro_batch_size == 32
    assert got["dtype"] in (torch.float16, torch.bfloat16)  # fp16, or bf16 where the CPU lacks fp16
    assert got["finite"]
    # an fp16 run starts at 2**16: the first step may overflow and halve the scale, never anything else
    assert got["scale"] == 2.0 ** 16 if got["stepped"] else got["scale"] == 2.0 ** 15


def _pipeline_parts(schedule: str) -> tuple[str, str, int, int]:
    from pipezero.train.build import build

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2}, "pipeline": {"stages": 2, "schedule": schedule},
           "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10}}}
    parts = build(cfg, specs=gpt_specs(TINY), loss_fn=gpt_loss)
    x = torch.randint(0, 256, (8, 8))
    loss = parts.runner.train_step(x, x)
    parts.optimizer.step()
    parts.scheduler.step()
    dtypes = {p.dtype for p in parts.module.parameters()}
    return (repr(parts.optimizer), type(parts.schedule).__name__, parts.module.num_chunks,
            parts.grid.data_size, dtypes == {torch.bfloat16}, bool(torch.isfinite(loss)))


@pytest.mark.parametrize("schedule, cls, chunks", [("1f1b", "OneFOneB", 1), ("zbv", "ZeroBubbleV", 2)])
def test_pipeline_config_builds_module_schedule_runner(schedule, cls, chunks):
    for opt, name, num_chunks, data, bf16, finite in run(_pipeline_parts, 4, schedule):
        assert opt == "ZeroOptimizer(stage=2, LossScaler(off, clip=1, AdamW))"
        assert (name, num_chunks, data, bf16, finite) == (cls, chunks, 2, True, True)


def _bounds_from_config_costs() -> list[int]:
    from pipezero.train.build import build

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "pipeline": {"stages": 2, "partition_method": [0, 1, 1, 0, 3]}}  # embed, 2 blocks, norm, head
    return build(cfg, specs=gpt_specs(TINY), loss_fn=gpt_loss).module.bounds


def test_pipeline_partition_costs_from_the_config():
    """A list of per-layer costs in ds_config's pipeline section reaches the partition: the
    expensive head gets a stage of its own."""
    assert run(_bounds_from_config_costs, 2) == [[0, 4, 5], [0, 4, 5]]  # the free norm joins stage 0


BAD = [  # (build kwargs, config changes, words the error must contain)
    ({"specs": "gpt", "model": "mlp"}, {}, ["exactly one of specs= ", "model="]),
    ({}, {}, ["exactly one of specs="]),
    ({"specs": "gpt", "loss_fn": None}, {}, ["loss_fn="]),
    ({"model": "mlp"}, {"pipeline": {"stages": 2}}, ["stages", "specs="]),
    ({"specs": "gpt"}, {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, ["auto", "hidden_size="]),
    ({"specs": "short"}, {"pipeline": {"stages": 2, "schedule": "zbv"}}, ["3 layers", "2 pipeline stages x 2 chunks"]),
    ({"model": "not a module"}, {}, ["expected an nn.Module"]),
    ({"specs": "gpt"}, {"pipeline": {"stages": 3}}, ["stages", "3", "does not divide the world size 4"]),
]


def _build_errors() -> list[str]:
    from pipezero.train.build import build

    out = []
    for kwargs, changes, _ in BAD:
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, **changes}
        args = {"loss_fn": gpt_loss, **kwargs}
        for key, value in list(args.items()):
            args[key] = {"gpt": gpt_specs(TINY), "short": gpt_specs(TINY)[:3], "mlp": _mlp()}.get(value, value) \
                if isinstance(value, str) else value
        try:
            build(cfg, **args)
            out.append("built")
        except (ValueError, TypeError) as err:
            out.append(f"{type(err).__name__}: {err}")
    return out


def test_bad_combinations_raise_on_every_rank_before_any_collective():
    # 4 ranks: an error raised on some ranks only would leave the others hanging in Grid()
    results = run(_build_errors, 4, timeout=180)
    for rank_messages in results:
        for (_, _, words), message in zip(BAD, rank_messages):
            for word in words:
                assert word in message, f"{word!r} not in {message!r}"
    assert results[0] == results[3]


def test_cli_simulate_prints_grid_bubble_memory_and_writes_png(tmp_path, capsys):
    from pipezero.train.cli import main

    png = tmp_path / "zbv.png"
    assert main(["simulate", "--schedule", "zbv", "--stages", "4", "--microbatches", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 3" in out and "0F0" in out and "1W7" in out
    assert "bubble 0.059" in out and "peak live activations" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_train_without_examples_says_where_to_get_them(monkeypatch, tmp_path):
    import pipezero
    from pipezero.train import cli

    monkeypatch.setattr(pipezero, "__file__", str(tmp_path / "site-packages" / "pipezero" / "__init__.py"))
    with pytest.raises(FileNotFoundError, match="clone the repository"):
        cli.examples_dir()


def _seeded_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    return model


def _engine_run(engine, optimizer, seed_style: bool = False) -> list[float]:
    """Four steps, each data rank on its share of every batch; the mean loss per step.
    seed_style: the seed guide's spelling (inputs `.to(engine.local_rank)`, optimizer.zero_grad())."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(4):
        x, y = _batch(step)
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        inputs, labels = x[mine], y[mine]
        if seed_style:
            inputs, labels = inputs.to(engine.local_rank), labels.to(engine.local_rank)
            optimizer.zero_grad()
        loss = nn.functional.cross_entropy(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(full.item() / world)
    return losses


def _engine_losses(stage: int) -> list[float]:
    """The DeepSpeed-shaped loop through initialize()."""
    from pipezero.train import initialize

    model = _seeded_mlp()
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": stage}, "gradient_clipping": 0.5}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, optimizer, _, _ = initialize(model=model, optimizer=opt, config=cfg)
    return _engine_run(engine, optimizer)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _plain_losses() -> list[float]:
    """The single-process truth: plain PyTorch, clipping at 0.5."""
    model = _seeded_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    truth = []
    for step in range(4):
        x, y = _batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        truth.append(loss.item())
    return truth


def test_initialize_engine_matches_plain_pytorch():
    for losses in run(_engine_losses, 2, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_plain_losses()), rtol=0, atol=1e-5)


def _seed_loop_losses() -> list[float]:
    """The seed guide's loop as written (section 3.3): a DDP-wrapped model, `config_params=`,
    `engine.train()`, inputs `.to(engine.local_rank)`, ZeRO-3 with "auto" sizes and no hidden_size."""
    from pipezero.train import initialize

    model = nn.parallel.DistributedDataParallel(_seeded_mlp())
    cfg = {"train_batch_size": 8, "gradient_clipping": 0.5,
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"}}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, optimizer, _, _ = initialize(model=model, model_parameters=model.parameters(), optimizer=opt,
                                         config_params=cfg)
    engine.train()
    return _engine_run(engine, optimizer, seed_style=True)


def test_the_seed_loop_runs_with_only_the_import_changed():
    for losses in run(_seed_loop_losses, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_plain_losses()), rtol=0, atol=1e-5)


def test_model_width_reads_the_config_else_the_common_linear_input():
    from types import SimpleNamespace

    from pipezero.train.build import model_width

    seed_mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    assert model_width(seed_mlp) == 784  # a tie: the larger width
    block = nn.ModuleDict({"qkv": nn.Linear(64, 192), "proj": nn.Linear(64, 64), "up": nn.Linear(64, 256),
                           "down": nn.Linear(256, 64), "head": nn.Linear(64, 1000)})
    assert model_width(block) == 64  # the residual width, not the MLP's or the head's
    block.config = SimpleNamespace(hidden_size=96)
    assert model_width(block) == 96
    assert model_width(nn.Sequential(nn.ReLU())) is None


def _engine_stop_and_resume(directory: str, stage: int):
    """DeepSpeed's save_checkpoint / load_checkpoint on the engine, mid-run under accumulation."""
    import torch.distributed as dist

    from pipezero.train import initialize

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 4}}}

    def engine():
        model = _seeded_mlp()
        return initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg)[0]

    def train(e, micro_batches) -> list[float]:
        losses = []
        for i in micro_batches:
            x, y = _batch(10 * i + dist.get_rank())
            loss = nn.functional.cross_entropy(e(x[:2]), y[:2])
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        return losses
    straight = train(engine(), range(8))
    first = engine()
    losses = train(first, range(4))
    with pytest.raises(ValueError, match="tag='best'"):
        first.save_checkpoint(directory, tag="best")
    with pytest.raises(TypeError, match="client_state"):
        first.save_checkpoint(directory, client_state={"t": torch.ones(1)})
    with pytest.raises(TypeError, match=r"client_state\['best'\]\[1\] is a dict key"):  # JSON would load "1"
        first.save_checkpoint(directory, client_state={"best": {1: 0.5}})
    first.save_checkpoint(directory, client_state={"epoch": 3})
    second = engine()
    path, client = second.load_checkpoint(directory)
    steps = (second.global_steps, second.micro_steps)
    return straight, losses + train(second, range(4, 8)), client, steps, path


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_checkpoint_resumes_as_if_never_stopped(tmp_path, stage):
    for straight, resumed, client, steps, path in run(_engine_stop_and_resume, 2, str(tmp_path), stage):
        assert resumed == straight and client == {"epoch": 3} and steps == (2, 4), (straight, resumed)
        assert path.endswith("step_00000002")
