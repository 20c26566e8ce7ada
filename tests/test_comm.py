"""comm/: p2p bit-exactness, paired 1F1B-like exchanges, bucketed all-reduce vs per-tensor ones."""

import warnings

import pytest
import torch
import torch.distributed as dist

from harness import run
from pipezero.comm import (P2P, TRAFFIC, CommTimeout, all_gather, all_reduce, all_reduce_coalesced, plan_buckets,
                           reduce_scatter)


def _payload(step, src):
    g = torch.Generator().manual_seed(1000 * step + src)
    a = torch.randn(3, 5, generator=g)
    b = torch.randint(-50, 50, (7,), generator=g)
    c = torch.randn(2, 2, 2, generator=g).to(torch.bfloat16)
    d = torch.rand(4, generator=g) > 0.5
    return a.requires_grad_(), b, c, d


def _ring(steps, early=False):
    """Each rank sends to the next and receives from the previous; with early=True each
    step's receive is posted during the step before (post_early), once the stream is known."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p2p = P2P()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    posted = []
    for step in range(steps):
        got = p2p.exchange(sends=[(nxt, "ring", _payload(step, rank))], recvs=[(prv, "ring")])[0]
        if early and step + 1 < steps:
            p2p.post_early([(prv, "ring")])
            posted.append(len(p2p._early))
        want = _payload(step, prv)
        assert [t.dtype for t in got] == [t.dtype for t in want]
        assert got[0].requires_grad and not got[1].requires_grad
        for g, w in zip(got, want):
            assert torch.equal(g, w.detach())
    p2p.drain()  # sends complete in the background until drained
    return posted if early else True


@pytest.mark.parametrize("world", [2, 4])
def test_tuples_of_mixed_dtypes_bit_exact(world):
    assert all(run(_ring, world, 3))


def test_receives_posted_early_arrive_in_order_bit_exact():
    """gloo: receives of known streams post one step ahead and the exchange takes them (the
    first step's stream is new, so from then on one receive waits posted each step)."""
    assert run(_ring, 2, 4, True) == [[1, 1, 1]] * 2


def _early_mismatch():
    p2p = P2P()
    peer = 1 - dist.get_rank()
    p2p.exchange(sends=[(peer, "a", torch.ones(2))], recvs=[(peer, "a")])
    p2p.post_early([(peer, "a")])
    with pytest.raises(RuntimeError, match="posted early"):
        p2p.exchange(recvs=[(peer, "b")])
    got = p2p.exchange(sends=[(peer, "a", torch.full((2,), 2.0))], recvs=[(peer, "a")])  # takes the early one
    p2p.drain()
    return got[0][0].tolist()


def test_an_exchange_that_skips_early_receives_is_an_error():
    assert run(_early_mismatch, 2) == [[2.0, 2.0]] * 2


def _one_f_one_b(m):
    """Activations flow down, gradients up, with paired send/recv as in 1F1B's steady state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    p2p = P2P()
    prv, nxt = rank - 1, rank + 1
    first, last = rank == 0, rank == world - 1
    warmup = min(world - rank - 1, m)
    acts, seen = [], []
    fwd_i = bwd_i = 0

    def forward():
        nonlocal fwd_i
        x = torch.full((2,), float(fwd_i)) if first else p2p.exchange(recvs=[(prv, "act")])[0][0]
        acts.append(x + 1)
        fwd_i += 1
        return x + 1

    for _ in range(warmup):
        y = forward()
        if not last:
            p2p.exchange(sends=[(nxt, "act", (y,))])
    for _ in range(m - warmup):
        y = forward()
        if last:
            grad = y * 0 + bwd_i
        else:
            grad = p2p.exchange(sends=[(nxt, "act", (y,))], recvs=[(nxt, "grad")])[0][0]
        seen.append(grad[0].item())
        if not first:
            p2p.exchange(sends=[(prv, "grad", (grad,))])
        bwd_i += 1
    while bwd_i < m:
        grad = y * 0 + bwd_i if last else p2p.exchange(recvs=[(nxt, "grad")])[0][0]
        seen.append(grad[0].item())
        if not first:
            p2p.exchange(sends=[(prv, "grad", (grad,))])
        bwd_i += 1
    p2p.drain()
    return seen


def test_paired_exchange_under_1f1b_pattern():
    results = run(_one_f_one_b, 4, 6)
    assert all(r == [float(i) for i in range(6)] for r in results)


def _silent_peer():
    if dist.get_rank() == 0:
        try:
            P2P(timeout_s=1).exchange(recvs=[(1, "act3")])
        except CommTimeout as e:
            return str(e)
    return None  # rank 1 never sends


def test_timeout_names_rank_peer_and_stream():
    msg = run(_silent_peer, 2, discard=True)[0]
    assert "rank 0" in msg and "'act3' from rank 1" in msg


def _tensors(seed):
    """Odd-sized tensors of several dtypes holding dyadic values, so every summation order is exact
    (gloo sums a large bucket and a small tensor in different orders at world 3)."""
    g = torch.Generator().manual_seed(seed)

    def dyadic(*shape):
        return torch.randint(-1000, 1000, shape, generator=g) / 64

    sizes = [7, 1, 33, 128, 5, 64, 3]
    return [dyadic(s) for s in sizes] + [dyadic(3, 3).to(torch.bfloat16), dyadic(11).double()]


def _coalesced_vs_plain(bucket_bytes):
    rank, world = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warnings in the user's face
        mine = _tensors(rank)
        reference = [t.clone() for t in mine]
        for t in reference:
            all_reduce(t)
        summed = [t.clone() for t in mine]
        all_reduce_coalesced(summed, bucket_bytes=bucket_bytes).wait()
        for s, r in zip(summed, reference):
            assert torch.equal(s, r), (s, r)

        averaged = [t.clone() for t in mine]
        all_reduce_coalesced(averaged, bucket_bytes=bucket_bytes, average=True).wait()
        for a, r in zip(averaged, reference):
            torch.testing.assert_close(a, r / world)
    return True


@pytest.mark.parametrize("world, bucket_bytes", [(1, 256), (2, 64), (3, 10**6), (4, 256)])
def test_bucketed_all_reduce_equals_plain(world, bucket_bytes):
    assert all(run(_coalesced_vs_plain, world, bucket_bytes))


def _flat_collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    TRAFFIC.reset()
    x = torch.arange(12, dtype=torch.float32) + rank
    out = torch.empty(12 // world)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warnings in the user's face
        reduce_scatter(out, x, average=True)
        expected = (torch.arange(12, dtype=torch.float32) * world + sum(range(world))) / world
        torch.testing.assert_close(out, expected.chunk(world)[rank])
        full = torch.empty(12)
        all_gather(full, out)
    torch.testing.assert_close(full, expected)
    return TRAFFIC.snapshot(), TRAFFIC.by_group()


def test_flat_collectives_and_traffic():
    snap, by_group = run(_flat_collectives, 2)[0]
    assert snap["reduce_scatter"]["bytes"] == 48 and snap["all_gather"]["calls"] == 1
    assert by_group["all_gather@world"] == 48


def test_plan_buckets_groups_dtypes_and_caps_size():
    ts = [torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10), torch.zeros(100)]
    assert plan_buckets(ts, 80) == [[0, 2], [1], [3]]
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets(ts, 0)
