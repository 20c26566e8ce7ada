"""Point-to-point transfers between pipeline ranks: tensors and tuples of tensors.

Each stream (one direction of one logical flow between two ranks, named by a key such as
"act0") sends its metadata (count, dtypes, shapes, requires_grad) on its first transfer
and reuses it afterwards; `variable_shapes=True` re-sends it every time (variable-length
inputs). All sends and receives of one `exchange` go out as one batched isend/irecv, so
paired transfers (send activation + receive gradient) never deadlock.
"""

from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

from pipezero.comm.traffic import TRAFFIC

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_META_LEN = 512  # int64 words: room for a tuple of dozens of tensors


class CommTimeout(TimeoutError):
    """A transfer did not complete in time; the message names the operation and peers."""


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
    """Send and receive tuples of tensors between ranks, with cached per-stream metadata."""

    def __init__(self, group=None, variable_shapes: bool = False, timeout_s: float = 300.0,
                 device: torch.device | str | None = None):
        self.group = group
        self.variable_shapes = variable_shapes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device(device) if device is not None else _default_device(group)
        self._sent: set[tuple[int, str]] = set()
        self._meta: dict[tuple[int, str], list] = {}

    def exchange(self, sends: Sequence[Send] = (), recvs: Sequence[Recv] = ()) -> list[tuple[torch.Tensor, ...]]:
        """Run all sends and receives as one batch; return the received tuples in `recvs` order."""
        sends = [(peer, key, tuple(ts) if isinstance(ts, (tuple, list)) else (ts,)) for peer, key, ts in sends]
        self._exchange_meta(sends, recvs)
        buffers = [[torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in self._meta[(p, k)]]
                   for p, k in recvs]
        ops, labels = [], []
        for peer, key, tensors in sends:
            for t in tensors:
                ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), peer, self.group))
                TRAFFIC.add("p2p_send", t.numel() * t.element_size(), group=f"{self._me()}->{peer}")
            labels.append(f"send {key!r} to rank {peer}")
        for (peer, key), bufs in zip(recvs, buffers):
            ops += [dist.P2POp(dist.irecv, b, peer, self.group) for b in bufs]
            TRAFFIC.add("p2p_recv", sum(b.numel() * b.element_size() for b in bufs), group=f"{peer}->{self._me()}")
            labels.append(f"recv {key!r} from rank {peer}")
        self._run(ops, labels, "p2p")
        out = []
        for (peer, key), bufs in zip(recvs, buffers):
            for b, (dtype, grad, _) in zip(bufs, self._meta[(peer, key)]):
                if grad and b.is_floating_point():
                    b.requires_grad_(True)
            out.append(tuple(bufs))
        return out

    def send(self, peer: int, key: str, tensors) -> None:
        self.exchange(sends=[(peer, key, tensors)])

    def recv(self, peer: int, key: str) -> tuple[torch.Tensor, ...]:
        return self.exchange(recvs=[(peer, key)])[0]

    # -- metadata ---------------------------------------------------------------------
    def _exchange_meta(self, sends: list, recvs: Sequence[Recv]) -> None:
        need_send = [(p, k, ts) for p, k, ts in sends if self.variable_shapes or (p, k) not in self._sent]
        need_recv = [(p, k) for p, k in recvs if self.variable_shapes or (p, k) not in self._meta]
        if not need_send and not need_recv:
            return
        ops, labels = [], []
        for peer, key, tensors in need_send:
            ops.append(dist.P2POp(dist.isend, encode_meta(tensors).to(self.device), peer, self.group))
            labels.append(f"send metadata {key!r} to rank {peer}")
            self._sent.add((peer, key))
        bufs = [torch.empty(_META_LEN, dtype=torch.int64, device=self.device) for _ in need_recv]
        for (peer, key), buf in zip(need_recv, bufs):
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
            labels.append(f"recv metadata {key!r} from rank {peer}")
        self._run(ops, labels, "p2p metadata")
        for (peer, key), buf in zip(need_recv, bufs):
            self._meta[(peer, key)] = decode_meta(buf.cpu())

    def _run(self, ops: list, labels: list[str], what: str) -> None:
        if not ops:
            return
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait(self.timeout)
        except RuntimeError as e:
            raise CommTimeout(f"rank {self._me()}: {what} did not complete within "
                              f"{self.timeout.total_seconds():.0f}s: {'; '.join(labels)} ({e})") from e

    @staticmethod
    def _me() -> int:
        return dist.get_rank()


def _default_device(group) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
