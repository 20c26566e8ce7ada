"""Checkpoints: round trip, two-rank merge and reshard, crash mid-save, corruption, consolidated export."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness import run
from pipezero.train.checkpoint import files as ck
from pipezero.train.checkpoint import (CheckpointError, export_consolidated, load_checkpoint, rng_state, save_checkpoint,
                                       set_rng_state)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b16": torch.randn(5, generator=g).to(torch.bfloat16),
            "count": torch.arange(7), "rng.torch_cpu": torch.get_rng_state()}


def test_round_trip_latest_and_step(tmp_path):
    first, second = _state(0), _state(1)
    save_checkpoint(tmp_path, 10, first, {"data": {"epoch": 0, "step": 10}})
    save_checkpoint(tmp_path, 20, second, {"data": {"epoch": 1, "step": 2}}, grid={"pipe": 1, "data": 1})
    got = load_checkpoint(tmp_path)
    assert got.step == 20 and got.meta == {"data": {"epoch": 1, "step": 2}}
    assert got.tensors.keys() == second.keys()
    for key, value in second.items():
        torch.testing.assert_close(got.tensors[key], value, rtol=0, atol=0)
        assert got.tensors[key].dtype == value.dtype
    older = load_checkpoint(tmp_path, step=10)
    torch.testing.assert_close(older.tensors["w"], first["w"], rtol=0, atol=0)
    assert json.loads((got.path / "manifest.json").read_text())["grid"] == {"pipe": 1, "data": 1}
    only = load_checkpoint(tmp_path, names={"w"})
    assert list(only.tensors) == ["w"]


def test_views_of_one_buffer_and_pruning(tmp_path):
    assert ck.latest_step(tmp_path) is None
    flat = torch.arange(20.0)  # e.g. ZeRO shards: views into one flat buffer
    views = {"a": flat[2:6], "b": flat[10:20].view(2, 5), "c": flat[::2]}
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, views, {})
    assert ck.latest_step(tmp_path) == 3
    for key, value in load_checkpoint(tmp_path).tensors.items():
        torch.testing.assert_close(value, views[key], rtol=0, atol=0)
    removed = ck.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in removed] == ["step_00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 5, _state(0), {})
    save_checkpoint(tmp_path, 5, _state(1), {})
    torch.testing.assert_close(load_checkpoint(tmp_path).tensors["w"], _state(1)["w"], rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000005"]


def test_bad_arguments():
    with pytest.raises(TypeError, match="meta must be plain JSON"):
        save_checkpoint("/nonexistent", 1, {}, {"t": torch.zeros(1)})
    with pytest.raises(TypeError, match=r"tensors\['x'\]"):
        save_checkpoint("/nonexistent", 1, {"x": [1.0]}, {})
    with pytest.raises(ValueError, match="rank=2, world=2"):
        save_checkpoint("/nonexistent", 1, {}, {}, rank=2, world=2)


@pytest.mark.parametrize("stage", ["write", "seal"])
def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch, stage):
    save_checkpoint(tmp_path, 1, _state(0), {"ok": 1})

    def boom(*args, **kwargs):
        raise OSError("disk died")

    if stage == "write":  # a rank dies while writing its file
        real = ck.save_file

        def half(tensors, path, metadata=None):
            real(tensors, path, metadata=metadata)
            Path(path).write_bytes(Path(path).read_bytes()[:50])
            boom()
        monkeypatch.setattr(ck, "save_file", half)
    else:  # rank 0 dies after the manifest, before the rename
        real_replace = ck.os.replace

        def seal_dies(src, dst):
            if Path(src).name.startswith(".tmp-"):  # the rename that would publish the checkpoint
                assert (Path(src) / "manifest.json").is_file()
                boom()
            real_replace(src, dst)
        monkeypatch.setattr(ck.os, "replace", seal_dies)
    with pytest.raises(OSError, match="disk died"):
        save_checkpoint(tmp_path, 2, _state(1), {"ok": 2})
    monkeypatch.undo()
    assert (tmp_path / ".tmp-step_00000002").is_dir()  # the partial save exists but is never read
    got = load_checkpoint(tmp_path)
    assert got.step == 1 and got.meta == {"ok": 1}
    torch.testing.assert_close(got.tensors["w"], _state(0)["w"], rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="step_00000002"):
        load_checkpoint(tmp_path, step=2)
    save_checkpoint(tmp_path, 2, _state(1), {"ok": 2})  # the next save clears the leftovers
    assert load_checkpoint(tmp_path).step == 2 and not (tmp_path / ".tmp-step_00000002").exists()


# -- two ranks: each saves its own part under global names -----------------------------------------

def _save_two_ranks(directory):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = GPT(CFG)
    names = sorted(model.state_dict())
    mine = {k: v for i, (k, v) in enumerate(sorted(model.state_dict().items())) if i % 2 == rank}
    mine["shared.step"] = torch.tensor([7])  # saved by both ranks: the lowest rank's copy wins
    save_checkpoint(directory, 3, mine, {"rank_count": 2}, rank=rank, world=2,
                    grid={"pipe": 2, "data": 1, "tensor": 1})
    return len(names)


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("two_rank")
    run(_save_two_ranks, 2, str(directory))
    return directory


def test_two_ranks_merge_and_load_into_single_process_model(two_rank_ckpt):
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, seed=5))  # other weights
    truth = GPT(CFG).state_dict()
    got = load_checkpoint(two_rank_ckpt, expected=model.state_dict(), strict=False)
    assert got.meta == {"rank_count": 2} and got.step == 3
    assert sorted(p.name for p in got.path.iterdir()) == ["manifest.json", "rank_00000.safetensors",
                                                          "rank_00001.safetensors"]
    model.load_state_dict({k: v for k, v in got.tensors.items() if k in truth})
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, truth[key], rtol=0, atol=0)


def _load_other_half(directory):
    """Each rank of a new grid loads only the names it now owns (here: the other rank's half)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    truth = GPT(CFG).state_dict()
    mine = {k for i, k in enumerate(sorted(truth)) if i % 2 != rank}
    got = load_checkpoint(directory, names=mine, expected={k: truth[k] for k in mine}, strict=True)
    assert set(got.tensors) == mine
    for key in mine:
        torch.testing.assert_close(got.tensors[key], truth[key], rtol=0, atol=0)
    return len(mine)


def test_each_rank_loads_only_its_new_share(two_rank_ckpt):
    counts = run(_load_other_half, 2, str(two_rank_ckpt))
    assert sum(counts) == len(GPT(CFG).state_dict())


def _corrupt(src, dst, how):
    shutil.copytree(src, dst)
    step = dst / "step_00000003"
    rank1 = step / "rank_00001.safetensors"
    if how == "checksum":
        data = bytearray(rank1.read_bytes())
        data[-3] ^= 0xFF
        rank1.write_bytes(bytes(data))
    elif how == "truncated":
        rank1.write_bytes(rank1.read_bytes()[:-10])
    elif how == "missing":
        rank1.unlink()
    elif how == "manifest":
        (step / "manifest.json").write_text("{not json")
    elif how == "version":
        manifest = json.loads((step / "manifest.json").read_text())
        (step / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    elif how == "latest":
        (dst / "latest").unlink()
    return dst


@pytest.mark.parametrize("how, words", [
    ("checksum", ["rank_00001.safetensors", "bad checksum"]),
    ("truncated", ["rank_00001.safetensors", "truncated"]),
    ("missing", ["rank_00001.safetensors", "missing rank file"]),
    ("manifest", ["manifest.json", "not valid JSON"]),
    ("version", ["manifest.json", "format_version 99"]),
    ("latest", ["no checkpoint here", "latest"]),
])
def test_corruption_is_refused_naming_the_file(two_rank_ckpt, tmp_path, how, words):
    bad = _corrupt(two_rank_ckpt, tmp_path / "copy", how)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(bad)
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_wrong_model_is_refused(two_rank_ckpt):
    other = GPT(GPTConfig(n_layer=3, n_head=2, d_model=16, seq_len=8)).state_dict()
    with pytest.raises(CheckpointError, match=r"missing \['layers.3"):
        load_checkpoint(two_rank_ckpt, expected=other, strict=False)
    with pytest.raises(CheckpointError, match=r"unexpected \['shared.step'\]"):
        load_checkpoint(two_rank_ckpt, expected=GPT(CFG).state_dict())
    wide = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=8)).state_dict()
    pattern = r"rank_0000.\.safetensors: tensor 'layers.0.weight' has shape \(256, 16\).*wants \(256, 32\)"
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(two_rank_ckpt, expected=wide, strict=False)


def test_export_consolidated_loads_with_plain_safetensors(tmp_path):
    model = GPT(CFG)
    path = export_consolidated(tmp_path / "model.safetensors", model.state_dict())
    fresh = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, seed=9))
    fresh.load_state_dict(load_file(str(path)))  # strict: every key, the tied one included
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert fresh.layers[0].weight is fresh.layers[-1].weight


def test_rng_state_round_trip(tmp_path):
    import random

    tensors, state = rng_state()
    save_checkpoint(tmp_path, 0, tensors, state)
    expect = (torch.rand(3), random.random())
    got = load_checkpoint(tmp_path)
    set_rng_state(got.tensors, got.meta)
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1]


# -- exact resume of a single-process run: model, AdamW, LR schedule, data position, RNG ----------

def test_flatten_state_round_trip_without_pickle(tmp_path):
    from pipezero.train.checkpoint.flatten import flatten_state, unflatten_state

    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "foreach": None}],
             "scaler": {"scale": float("inf"), "window": 7, "name": "dyn"}}
    tensors, skeleton = flatten_state(state, "optim")
    assert sorted(tensors) == ["optim/state/0/exp_avg", "optim/state/0/step"]
    save_checkpoint(tmp_path, 1, tensors, {"optim": skeleton})
    got = load_checkpoint(tmp_path)
    back = unflatten_state(got.tensors, got.meta["optim"])
    assert back["param_groups"] == state["param_groups"] and back["scaler"] == state["scaler"]
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["exp_avg"], torch.ones(2))
    with pytest.raises(TypeError, match="cannot go into a checkpoint without pickle"):
        flatten_state({"x": object()}, "bad")


def _train(steps, directory=None, save_at=None, resume=False):
    from pipezero.train.checkpoint.flatten import flatten_state, unflatten_state
    from pipezero.train.config import parse_config
    from pipezero.train.config.optim import build_optimizer, build_scheduler
    from pipezero.train.data import ShardedBatches, TokenData
    from gpt import gpt_loss

    cfg = parse_config({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                        "scheduler": {"type": "WarmupCosineLR", "params": {
                            "warmup_num_steps": 2, "total_num_steps": 8, "warmup_type": "linear"}}})
    model = GPT(CFG)
    opt = build_optimizer(cfg.optimizer, model.parameters())
    sched = build_scheduler(cfg.scheduler, opt)
    data = ShardedBatches(TokenData(torch.arange(4000) % 256, CFG.seq_len), 4, seed=1)
    start, losses = 0, []
    if resume:
        got = load_checkpoint(directory)
        model.load_state_dict({k[6:]: v for k, v in got.tensors.items() if k.startswith("model/")})
        opt.load_state_dict(unflatten_state(got.tensors, got.meta["optim"]))
        sched.load_state_dict(got.meta["sched"])
        data.load_state_dict(got.meta["data"])
        set_rng_state(got.tensors, got.meta["rng"])
        start = got.step
    for step in range(start, steps):
        x, y = data.next_batch()
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        if step + 1 == save_at:
            opt_t, opt_j = flatten_state(opt.state_dict(), "optim")
            rng_t, rng_j = rng_state()
            model_t = {f"model/{k}": v for k, v in model.state_dict().items()}
            meta = {"optim": opt_j, "sched": sched.state_dict(), "data": data.state_dict(), "rng": rng_j}
            save_checkpoint(directory, step + 1, {**model_t, **opt_t, **rng_t}, meta)
    return losses


def test_resume_is_exact(tmp_path):
    whole = _train(6)
    first = _train(3, tmp_path, save_at=3)
    rest = _train(6, tmp_path, resume=True)
    assert first + rest == whole  # bit for bit
    assert whole[-1] < whole[0]
