"""comm/p2p.py's variable_shapes: one stream, a new size every transfer, only the dims sent beside the data.

Two ranks pass tuples (float activation, int64 segment ids) of a different sequence length
each time, both ways in one exchange (the pairing the pipeline uses), and early receives are
skipped (their sizes are unknown); every tensor arrives whole and equal. A stream whose dtype
or number of dims changes is refused naming it. (Without variable_shapes the second size is
received into the first one's buffer and gloo aborts both processes: checked by hand, not here.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import run
from pipezero.comm import P2P


def _payload(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = 3 + (step * 5 + rank) % 7
    gen = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(2, length, 4, generator=gen), torch.randint(0, 9, (2, length), generator=gen)


def _exchange(variable: bool) -> str:
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    p2p = P2P(None, variable_shapes=variable, timeout_s=10)
    try:
        for step in range(5):
            p2p.post_early([(peer, "a")])  # a no-op under variable shapes
            got = p2p.exchange([(peer, "a", _payload(step, me))], [(peer, "a")])[0]
            for t, want in zip(got, _payload(step, peer)):
                torch.testing.assert_close(t, want, rtol=0, atol=0)
        p2p.drain()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"failed: {type(err).__name__}: {err}"
    if variable:
        try:
            p2p.exchange([(peer, "a", (torch.zeros(2, 3, 4), torch.zeros(2, 3)))], [])  # int64 -> float
        except ValueError as err:
            return str(err)
    return "ok"


def test_variable_shapes_stream_every_size_and_refuse_a_new_dtype():
    for answer in run(_exchange, 2, True, timeout=120):
        assert "stream 'a'" in answer and "only sizes may vary" in answer, answer
