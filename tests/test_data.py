"""Token data: the stdlib corpus, user files, the held-out split, deterministic sharding and resume."""

import os

import numpy as np
import pytest
import torch

from pipezero.train.data import ShardedBatches, TokenData, corpus_hash, load_tokens, stdlib_files


def _data(n=1000, seq_len=8):
    return TokenData(torch.arange(n), seq_len, val_fraction=0.1, source="synthetic")  # token = position


def test_stdlib_corpus_is_deterministic_bytes_of_the_os_directory():
    files = stdlib_files()
    assert files == sorted(files) and all(f.parent == files[0].parent for f in files)
    assert any(f.name == "os.py" for f in files) and os.path.samefile(files[0].parent,
                                                                      os.path.dirname(os.__file__))
    data = TokenData.stdlib(seq_len=64)
    assert data.source == f"stdlib:{corpus_hash(files)}"
    assert data.tokens.dtype == torch.uint8 and data.tokens.numel() == sum(f.stat().st_size for f in files)
    head = files[0].read_bytes()[:100]
    assert bytes(data.tokens[:100].tolist()) == head
    assert corpus_hash(files) != corpus_hash(files[1:])


def test_windows_are_shifted_by_one_and_split_holds_out_the_tail():
    data = _data()
    x, y = data.windows("train", torch.tensor([0, 5]))
    assert x.dtype == torch.int64 and x.shape == (2, 8)
    torch.testing.assert_close(x[1], data.tokens[40:48].long())
    torch.testing.assert_close(y, torch.stack([data.tokens[1:9], data.tokens[41:49]]).long())
    cut = int(1000 * 0.9)
    assert data.num_windows("train") == (cut - 1) // 8 and data.num_windows("val") == (1000 - cut - 1) // 8
    _, last_y = data.windows("train", torch.arange(data.num_windows("train")))
    assert int(last_y.max()) < cut  # training never sees a held-out token
    vx, _ = data.windows("val", torch.tensor([0]))
    torch.testing.assert_close(vx[0], data.tokens[cut:cut + 8].long())


@pytest.mark.parametrize("dp", [2, 3])
def test_ranks_together_take_exactly_the_single_process_batch(dp):
    data = _data()
    single = ShardedBatches(data, batch_size=2 * dp, seed=7)
    ranks = [ShardedBatches(data, batch_size=2, data_rank=r, data_degree=dp, seed=7) for r in range(dp)]
    seen = set()
    for step in range(single.steps_per_epoch + 2):  # crosses into the second epoch
        whole_x, whole_y = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), whole_x, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_y, rtol=0, atol=0)
        if step < single.steps_per_epoch:
            starts = set(whole_x[:, 0].tolist())  # token = position, so this is the window
            assert len(starts) == 2 * dp and not (starts & seen)  # no window twice within an epoch
            seen |= starts
    assert single.state_dict() == {"epoch": 1, "step": 2, "global_batch": single.batch_size,
                                   "corpus": data.fingerprint(), "seed": 7}


def test_epochs_reshuffle_and_seed_matters():
    data = _data()
    a = ShardedBatches(data, batch_size=4, seed=1)
    first = a.next_batch()[0]
    a.load_state_dict({"epoch": 1, "step": 0})
    assert not torch.equal(a.next_batch()[0], first)
    assert not torch.equal(ShardedBatches(data, batch_size=4, seed=2).next_batch()[0], first)
    plain = ShardedBatches(data, batch_size=4, shuffle=False).next_batch()[0]
    torch.testing.assert_close(plain[:, 0], torch.tensor([0, 8, 16, 24]))


def test_resume_continues_with_the_next_batch():
    data = _data()
    run = ShardedBatches(data, batch_size=3, data_rank=1, data_degree=2, seed=5)
    for _ in range(4):
        run.next_batch()
    state = run.state_dict()
    expect = [run.next_batch() for _ in range(3)]
    resumed = ShardedBatches(data, batch_size=3, data_rank=1, data_degree=2, seed=5)
    resumed.load_state_dict(state)
    for want in expect:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_resume_on_another_corpus_or_seed_is_refused():
    """A position means nothing in another data order: a resume with another --data-path (or seq_len,
    or seed) is refused naming what differs, instead of training on from a step of another order."""
    data = _data()
    run = ShardedBatches(data, batch_size=3, seed=5)
    run.next_batch()
    state = run.state_dict()
    other = TokenData(data.tokens.flip(0).contiguous(), data.seq_len)
    for resumed, word in ((ShardedBatches(other, batch_size=3, seed=5), "corpus"),
                          (ShardedBatches(data, batch_size=3, seed=6), "seed 5, here 6")):
        with pytest.raises(ValueError, match=f"another data order \\({word}"):
            resumed.load_state_dict(state)
    older = {k: state[k] for k in ("epoch", "step", "global_batch")}  # written before the check: taken as the same
    ShardedBatches(data, batch_size=3, seed=5).load_state_dict(older)


def test_user_files(tmp_path):
    text = tmp_path / "book.txt"
    text.write_bytes("héllo wörld\n".encode() * 50)
    assert load_tokens(text).tolist()[:3] == list("héllo".encode())[:3]
    ids = np.arange(600, dtype=np.uint16) % 500
    ids.tofile(tmp_path / "tok.bin")
    np.save(tmp_path / "tok.npy", ids.astype(np.int32))
    want = torch.from_numpy(ids.astype(np.int64))
    torch.testing.assert_close(load_tokens(tmp_path / "tok.bin", vocab_size=500), want)
    torch.testing.assert_close(load_tokens(tmp_path / "tok.npy", vocab_size=500), want)
    data = TokenData.from_file(tmp_path / "tok.npy", seq_len=4, vocab_size=500)
    assert data.source.endswith("tok.npy") and data.num_windows("val") >= 1


@pytest.mark.parametrize("name, content, words", [
    ("tok.bin", np.array([1, 300], dtype=np.uint16), ["tok.bin", "[1, 300]", "vocabulary has"]),
    ("odd.bin", b"abc", ["odd.bin", "3 bytes"]),
    ("two.npy", np.zeros((2, 2), dtype=np.int64), ["two.npy", "1-D integer array"]),
    ("float.npy", np.zeros(4, dtype=np.float32), ["float.npy", "float32"]),
    ("missing.txt", None, ["missing.txt", "not a file"]),
])
def test_bad_user_files(tmp_path, name, content, words):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif name.endswith(".npy"):
        np.save(path, content)
    elif content is not None:
        content.tofile(path)
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        load_tokens(path)
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_too_little_data_and_bad_shard_arguments():
    with pytest.raises(ValueError, match="too few.*seq_len=64"):
        TokenData(torch.arange(100), 64)
    data = _data()
    with pytest.raises(ValueError, match="data_rank=2.*data_degree=2"):
        ShardedBatches(data, 2, data_rank=2, data_degree=2)
    with pytest.raises(ValueError, match="fewer than one global batch of 100 x 2"):
        ShardedBatches(data, 100, data_rank=0, data_degree=2)
