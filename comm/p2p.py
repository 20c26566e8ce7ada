"""Point-to-point transfers between pipeline ranks: tensors and tuples of tensors.

A stream is one direction of one logical flow between two ranks, named by a key such as
"act0". Its first transfer travels with its metadata (count, dtypes, shapes, requires_grad)
on a side channel (tag 1 of the same gloo group, or a gloo twin group beside nccl), posted at
once; later transfers of known streams go out as one batch of sends and receives
(Megatron's send-forward-recv-backward pairing, so paired transfers never deadlock). Only
then are new streams received, one by one in the sender's order: both sides agree on which
channel carries a message, and each channel keeps the per-pair order that order-matching
transports (nccl) need. Sends complete in the background; `drain()` waits for them (at the
end of a pipeline step). Shapes that change start new streams: a new P2P, or a new key; or,
with `variable_shapes=True`, every later transfer of a stream is preceded by its dims alone
(one small int64 message on the side channel, tag 2): micro-batches of different sequence
lengths flow through one stream, with no new group and no metadata beyond the dims.

Receiving early: gloo moves a message only once its receive is posted (a receive posted late
costs a round trip, ~0.2 ms here, on the critical path), so `post_early(recvs)` posts the
next action's receives of known streams while this one computes; `exchange()` then takes
them, in the same order. On nccl a posted receive would occupy the GPU while it waits, so
there it is a no-op.

Waiting: on gloo a receive blocks the CPU until it completes or `timeout_s` passes. On nccl
it only orders the compute stream behind the transfer, so the CPU keeps queueing kernels
(a wait with a timeout would block the CPU and poll, leaving the GPU idle after every
receive); `drain()` then checks the step's transfers against `timeout_s` once.
"""

from __future__ import annotations

import datetime
import time
from typing import Sequence

import torch
import torch.distributed as dist

from pipezero.comm.traffic import TRAFFIC
from pipezero.topology.device import process_device

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_META_LEN = 512  # int64 words: room for a tuple of dozens of tensors
_DIMS_TAG = 2    # variable shapes: a known stream's dims, before its data


class CommTimeout(TimeoutError):
    """A transfer did not complete in time; the message names the operation and peers."""


class PeerLost(ConnectionError):
    """A peer closed its connection mid-transfer (it crashed or exited): reported at once, not
    after the timeout; the message names the operation and peers."""


def is_peer_lost(err: BaseException) -> bool:
    """Whether a transport error says a peer went away (rather than that a wait timed out)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and "timed out" not in text and "timeout" not in text and any(
        w in text for w in ("closed", "reset by peer", "broken pipe", "connection refused"))


def peer_lost(err: BaseException, what: str, start: float) -> PeerLost:
    """The PeerLost to raise for `err`, met `what` was under way since time.monotonic() = start."""
    return PeerLost(f"rank {dist.get_rank()}: a peer closed its connection {time.monotonic() - start:.1f}s into "
                    f"{what} (it crashed or exited; its own error is in its log): {err}")


Send = tuple[int, str, Sequence[torch.Tensor]]  # (peer global rank, stream key, tensors)
Recv = tuple[int, str]                           # (peer global rank, stream key)


def encode_meta(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Pack count, dtype, requires_grad and shape of each tensor into a fixed-size int64 tensor."""
    words = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"p2p cannot send dtype {t.dtype}; supported: {_DTYPES}")
        words += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(words) > _META_LEN:
        raise ValueError(f"p2p metadata of {len(tensors)} tensors needs {len(words)} words > {_META_LEN}; "
                         "send fewer or flatter tensors")
    return torch.tensor(words + [0] * (_META_LEN - len(words)), dtype=torch.int64)


def decode_meta(meta: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    words, out, i = meta.tolist(), [], 1
    for _ in range(words[0]):
        dtype, grad, ndim = _DTYPES[words[i]], bool(words[i + 1]), words[i + 2]
        out.append((dtype, grad, tuple(words[i + 3:i + 3 + ndim])))
        i += 3 + ndim
    return out


class P2P:
    """Send and receive tuples of tensors between ranks, with per-stream metadata sent once."""

    def __init__(self, group=None, side_group=None, timeout_s: float = 300.0,
                 device: torch.device | str | None = None, variable_shapes: bool = False):
        self.group, self.variable_shapes = group, variable_shapes
        self.side = group if side_group is None else side_group
        self.tag = 1 if self.side is group else 0
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device(device) if device is not None else process_device(group)
        self.side_device = self.device if self.side is group else torch.device("cpu")
        self._sent: set[tuple[int, str]] = set()
        self._sent_kinds: dict[tuple[int, str], list] = {}  # variable shapes: (dtype, ndim) per tensor
        self._meta: dict[tuple[int, str], list] = {}
        self._pending: list = []  # sends (and, on nccl, receives) not yet known to be complete
        self._early: list = []    # ((peer, key), buffers, works) posted by post_early, oldest first
        self.stream_ordered = self.device.type == "cuda"  # nccl: wait() orders the stream, the CPU goes on

    def exchange(self, sends: Sequence[Send] = (), recvs: Sequence[Recv] = ()) -> list[tuple[torch.Tensor, ...]]:
        """Post all sends and receives; return the received tuples in `recvs` order.

        Receives are complete on return; sends may still be in flight until `drain()`.
        """
        sends = [(peer, key, tuple(ts) if isinstance(ts, (tuple, list)) else (ts,)) for peer, key, ts in sends]
        new = [self._is_new_send(peer, key) for peer, key, _ in sends]
        self._send_new([s for s, is_new in zip(sends, new) if is_new])
        if self.variable_shapes:
            self._send_dims([s for s, is_new in zip(sends, new) if not is_new])
        early = self._take_early(recvs)  # posted already: nothing to post or pair below
        known = [not early and self._is_known_recv(peer, key) for peer, key in recvs]
        if self.variable_shapes:
            self._receive_dims([r for r, k in zip(recvs, known) if k])
        out = [bufs for bufs, _ in early] if early else \
            [self._buffers(peer, key, self.device) if k else None for (peer, key), k in zip(recvs, known)]
        paired_peers = {peer for (peer, _), k in zip(recvs, known) if k}
        old = [s for s, is_new in zip(sends, new) if not is_new]
        lone = [self._send_op(t, peer) for peer, _, ts in old if peer not in paired_peers for t in ts]
        self._pending += dist.batch_isend_irecv(lone) if lone else []  # nobody waits on these here
        paired = [self._send_op(t, peer) for peer, _, ts in old if peer in paired_peers for t in ts]
        num_sends = len(paired)
        paired += [dist.P2POp(dist.irecv, b, peer, self.group)
                   for (peer, _), bufs, k in zip(recvs, out, known) if k for b in bufs]
        works = dist.batch_isend_irecv(paired) if paired else []
        if len(works) == len(paired):  # one work per operation (gloo): sends complete in the background
            self._pending += works[:num_sends]
            works = works[num_sends:]
        if early:
            works = [w for _, ws in early for w in ws]
        _count(sends, [b for bufs in out if bufs for b in bufs], recvs)
        for i, (peer, key) in enumerate(recvs):
            if out[i] is None:
                out[i] = self._receive_new(peer, key)
        if self.stream_ordered:
            for work in works:
                work.wait()
            self._pending += works  # checked against the timeout at drain()
        else:
            self._wait(works, sends, recvs)
        for (peer, key), bufs in zip(recvs, out):
            for b, (_, grad, _) in zip(bufs, self._meta[(peer, key)]):
                if grad and b.is_floating_point():
                    b.requires_grad_(True)
        return out

    def post_early(self, recvs: Sequence[Recv]) -> None:
        """Post these receives now, for the next exchange() to take (gloo, known streams only:
        all or none, so messages of one peer are still received in the order they were sent)."""
        if self.stream_ordered or self.variable_shapes or not all(self._is_known_recv(p, k) for p, k in recvs):
            return  # variable shapes: the buffers' sizes come with each transfer
        for peer, key in recvs:
            bufs = self._buffers(peer, key, self.device)
            ops = [dist.P2POp(dist.irecv, b, peer, self.group) for b in bufs]
            self._early.append(((peer, key), bufs, dist.batch_isend_irecv(ops) if ops else []))

    def drain(self) -> None:
        """Wait for every send still in flight (and, on nccl, check the receives); call it
        before dropping the P2P (gloo drops the unsent messages of a destroyed send)."""
        pending, self._pending = self._pending, []
        self._wait(pending, [], [])

    def _take_early(self, recvs: Sequence[Recv]) -> list | None:
        """The early receives of exactly these streams, or None when none were posted."""
        if not self._early:
            return None
        posted = [stream for stream, _, _ in self._early[:len(recvs)]]
        if posted != list(recvs):
            raise RuntimeError(f"p2p: receives posted early for {posted} but the exchange wants {list(recvs)}; "
                               "post_early() must name the next exchange's receives")
        taken, self._early = self._early[:len(recvs)], self._early[len(recvs):]
        return [(bufs, works) for _, bufs, works in taken]

    # -- streams ------------------------------------------------------------------------
    def _is_new_send(self, peer: int, key: str) -> bool:
        new = (peer, key) not in self._sent
        self._sent.add((peer, key))
        return new

    def _is_known_recv(self, peer: int, key: str) -> bool:
        return (peer, key) in self._meta

    def _send_op(self, t: torch.Tensor, peer: int) -> dist.P2POp:
        return dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group)

    def _send_new(self, sends: list) -> None:
        ops = []
        for peer, key, tensors in sends:
            self._sent_kinds[(peer, key)] = [(t.dtype, t.dim()) for t in tensors]
            payload = [encode_meta(tensors), *(t.detach() for t in tensors)]
            ops += [dist.P2POp(dist.isend, t.to(self.side_device).contiguous(), peer, self.side, self.tag)
                    for t in payload]
        self._pending += dist.batch_isend_irecv(ops) if ops else []

    def _send_dims(self, sends: list) -> None:
        """Variable shapes: each known stream's dims before its data (tag 2 of the side channel)."""
        ops = []
        for peer, key, tensors in sends:
            meta = [(t.dtype, t.dim()) for t in tensors]
            if meta != self._sent_kinds.setdefault((peer, key), meta):
                raise ValueError(f"p2p stream {key!r} to rank {peer}: its tensors changed count, dtype or number "
                                 f"of dims ({self._sent_kinds[(peer, key)]} -> {meta}); only sizes may vary")
            dims = [d for t in tensors for d in t.shape]
            if dims:
                header = torch.tensor(dims, dtype=torch.int64, device=self.side_device)
                ops.append(dist.P2POp(dist.isend, header, peer, self.side, _DIMS_TAG))
        self._pending += dist.batch_isend_irecv(ops) if ops else []

    def _receive_dims(self, recvs: list) -> None:
        """Variable shapes: the dims of each known stream's next transfer, into its metadata."""
        for peer, key in recvs:
            meta = self._meta[(peer, key)]
            count = sum(len(shape) for _, _, shape in meta)
            if not count:
                continue
            header = torch.empty(count, dtype=torch.int64, device=self.side_device)
            self._wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, peer, self.side, _DIMS_TAG)]),
                       [], [(peer, key)])
            dims, at, fresh = header.tolist(), 0, []
            for dtype, grad, shape in meta:
                fresh.append((dtype, grad, tuple(dims[at:at + len(shape)])))
                at += len(shape)
            self._meta[(peer, key)] = fresh

    def _receive_new(self, peer: int, key: str) -> tuple[torch.Tensor, ...]:
        meta = torch.empty(_META_LEN, dtype=torch.int64, device=self.side_device)
        self._wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, meta, peer, self.side, self.tag)]), [], [(peer, key)])
        self._meta[(peer, key)] = decode_meta(meta.cpu())
        bufs = self._buffers(peer, key, self.side_device)
        if bufs:
            ops = [dist.P2POp(dist.irecv, b, peer, self.side, self.tag) for b in bufs]
            self._wait(dist.batch_isend_irecv(ops), [], [(peer, key)])
        TRAFFIC.add("p2p_recv", sum(b.numel() * b.element_size() for b in bufs), group=f"{peer}->{dist.get_rank()}")
        return tuple(b.to(self.device) for b in bufs)

    def _buffers(self, peer: int, key: str, device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for dtype, _, shape in self._meta[(peer, key)])

    def _wait(self, works: list, sends: Sequence, recvs: Sequence) -> None:
        start = time.monotonic()
        try:
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as e:
            what = [f"send {k!r} to rank {p}" for p, k, _ in sends] + [f"recv {k!r} from rank {p}" for p, k in recvs]
            what = "; ".join(what) or "pending sends"
            if is_peer_lost(e):
                raise peer_lost(e, what, start) from e
            raise CommTimeout(f"rank {dist.get_rank()}: p2p did not complete within "
                              f"{self.timeout.total_seconds():.0f}s: {what} ({e})") from e


def _count(sends: Sequence, known_buffers: Sequence[torch.Tensor], recvs: Sequence) -> None:
    me = dist.get_rank()
    for peer, _, tensors in sends:
        TRAFFIC.add("p2p_send", sum(t.numel() * t.element_size() for t in tensors), group=f"{me}->{peer}")
    if known_buffers:
        TRAFFIC.add("p2p_recv", sum(b.numel() * b.element_size() for b in known_buffers),
                    group=",".join(f"{peer}->{me}" for peer, _ in recvs))
