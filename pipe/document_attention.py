"""Causal attention over packed documents without an s x s mask: memory linear in the sequence.

A packed row holds several documents; each token may attend only to earlier tokens of its
own document. The masked way builds a [T, T] boolean block-diagonal mask, which grows
quadratically and takes SDPA off its flash kernels (an explicit mask means the math or
memory-efficient kernel with the mask read at every score). Here each document is attended
on its own with SDPA's `is_causal=True` (no mask), so:

* on CPU, torch's flash CPU kernel runs per document (scores never whole: linear memory,
  forward and backward); on CUDA, flash (or cuDNN / memory-efficient) attention per document,
  the kernels SDPA picks for a plain causal call;
* the result is the masked result up to float rounding: a masked-out score contributes exactly
  zero to the softmax.

FlexAttention (a document-causal block mask) was the other candidate: its eager fallback
materialises the whole scores (quadratic on CPU, where CI runs) and its fast path needs
torch.compile (minutes of compilation on a 2-core CPU); per-document SDPA is exact and
linear everywhere with no compilation. The cost is one SDPA call per document (a Python loop):
nothing beside the attention of a long document, but launch-bound for hundreds of short ones on
a GPU. So on CUDA, in bf16 / fp16 with a head dim flash takes, every document of the micro-batch
goes through one flash varlen call over the cumulative lengths (`Documents.cu_seqlens`,
torch.nn.attention.varlen.varlen_attn where it takes a causal window and grouped key/value
heads), and the per-document loop serves CPU, fp32 and older torch.

The documents are one `split` of the row (autograd's SplitBackward joins their gradients once; a slice
per document would make a zero-filled gradient of the whole row per document, O(T^2 / document) memory
traffic), grouped key/value heads are attended as they are where the kernel takes them (SDPA's
enable_gqa on the flash kernels; repeated to every query head they were two more [T, hidden] tensors
kept for backward), and the documents' outputs are joined in the [B, T, H, D] layout the output
projection reads (the caller's transpose(1, 2).contiguous() is then free).

`document_attention(q, k, v, docs)` is the single entry point (the Hugging Face layers'
registered attention function and the GPT's Block both call it; a sequence-parallel wrapper
puts its all-to-all around it). `Documents` are the boundaries, found once per micro-batch
from the packed row's position ids (a new document where a position does not follow the
previous one: transformers' rule for packed position ids) or segment ids.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Documents", "document_attention", "documents_from_positions", "documents_from_segments"]


@dataclass(frozen=True, slots=True, eq=False)
class Documents:
    """Where each document of a [B, T] micro-batch lies: spans (row, start, end), end exclusive.

    cu_seqlens: the same over the flattened B * T tokens, int32 on the ids' device (flash varlen's layout);
    longest: the longest document's length; shape: (B, T)."""

    spans: tuple[tuple[int, int, int], ...]
    cu_seqlens: torch.Tensor
    longest: int
    shape: tuple[int, int]

    @property
    def single(self) -> bool:
        """One document per row: plain causal attention is the same thing."""
        rows = {row for row, _, _ in self.spans}
        return len(rows) == len(self.spans)


@torch.compiler.disable  # a host sync and Python ints: a graph break, not a recompilation per layout
def documents_from_starts(starts: torch.Tensor) -> Documents:
    """Documents of a [B, T] boolean tensor, True where a document starts (column 0 always starts one)."""
    if starts.dim() != 2:
        raise ValueError(f"documents: expected [batch, tokens] position or segment ids, got shape "
                         f"{tuple(starts.shape)}")
    batch, tokens = starts.shape
    starts = starts.clone()
    starts[:, 0] = True
    flat = torch.nonzero(starts.flatten()).flatten().tolist()  # one host sync per micro-batch
    bounds = flat + [batch * tokens]
    spans = tuple((lo // tokens, lo % tokens, lo % tokens + hi - lo) for lo, hi in zip(bounds, bounds[1:]))
    cu = torch.tensor(bounds, dtype=torch.int32, device=starts.device)
    return Documents(spans, cu, max(hi - lo for lo, hi in zip(bounds, bounds[1:])), (batch, tokens))


def documents_from_positions(positions: torch.Tensor) -> Documents:
    """A new document wherever a position id is not the previous one + 1 (positions restart per document)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return documents_from_starts(starts)


def documents_from_segments(segments: torch.Tensor) -> Documents:
    """A new document wherever the segment id changes."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return documents_from_starts(starts)


@torch.compiler.disable  # a loop over the micro-batch's documents: traced, it would recompile for each layout
def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents,
                       scale: float | None = None) -> torch.Tensor:
    """Causal attention within each document: q [B, H, T, D], k and v [B, Hkv, T, D] -> [B, H, T, D].

    Hkv may divide H (grouped-query attention: each key/value head serves H / Hkv query heads).
    """
    batch, heads, tokens, dim = q.shape
    if k.shape[0] != batch or k.shape[2] != tokens or heads % k.shape[1]:
        raise ValueError(f"document_attention: q {tuple(q.shape)} and k {tuple(k.shape)} do not fit; expected "
                         f"k [{batch}, H_kv, {tokens}, D] with H_kv dividing {heads}")
    if docs.shape != (batch, tokens):
        raise ValueError(f"document_attention: the documents are of a {docs.shape[0]} x {docs.shape[1]} micro-batch, "
                         f"q of {batch} x {tokens}; make them from this micro-batch's position or segment ids")
    if not docs.single and _varlen_fits(q):
        return _varlen_attention(q, k, v, docs, scale)
    groups = heads // k.shape[1]
    grouped = groups > 1 and _grouped_kernel(q, k, v)
    if groups > 1 and not grouped:  # repeated here: the memory-efficient and cuDNN kernels need equal heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    extra = {"enable_gqa": True} if grouped else {}
    if docs.single:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **extra)
    rows = [(q, k, v)] if batch == 1 else zip(q.split(1), k.split(1), v.split(1))
    out = []
    for row, (qr, kr, vr) in enumerate(rows):
        sizes = [hi - lo for r, lo, hi in docs.spans if r == row]
        pieces = [F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale, **extra).transpose(1, 2)
                  for a, b, c in zip(qr.split(sizes, dim=2), kr.split(sizes, dim=2), vr.split(sizes, dim=2))]
        out.append(torch.cat(pieces, dim=1))  # [1, T, H, D]: the layout the output projection reads
    return (out[0] if batch == 1 else torch.cat(out)).transpose(1, 2)


def _grouped_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Does SDPA attend grouped key/value heads as they are here (enable_gqa: the flash kernels, CPU's and
    CUDA's where it runs)? Elsewhere enable_gqa falls back to the math kernel, quadratic in a document."""
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda":
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)  # no mask, no dropout, causal, gqa
    return torch.backends.cuda.can_use_flash_attention(params)


def _varlen_api() -> bool:
    """Does this torch's varlen_attn take a causal window and grouped heads? (2.10 had is_causal and no
    enable_gqa; the arguments, not the version number, say which call works.)"""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    wanted = {"window_size", "enable_gqa", "scale"}
    return wanted <= set(inspect.signature(varlen_attn).parameters)


_VARLEN_TORCH = _varlen_api()
_HALF = (torch.bfloat16, torch.float16)


def _varlen_fits(q: torch.Tensor) -> bool:
    """Can one flash varlen call attend this micro-batch's documents (CUDA, half precision, flash's head dims)?"""
    dim = q.shape[-1]
    return _VARLEN_TORCH and q.is_cuda and q.dtype in _HALF and dim <= 256 and dim % 8 == 0


def _varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents,
                      scale: float | None) -> torch.Tensor:
    """Every document of the micro-batch in one flash varlen call: [B, H, T, D] in and out (a view of the
    [B, T, H, D] layout the output projection reads)."""
    from torch.nn.attention.varlen import varlen_attn

    batch, heads, tokens, dim = q.shape

    def flat(t: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B * T, H, D]: the documents end to end
        return t.transpose(1, 2).reshape(batch * tokens, t.shape[1], dim)

    out = varlen_attn(flat(q), flat(k), flat(v), docs.cu_seqlens, docs.cu_seqlens, docs.longest, docs.longest,
                      scale=scale, window_size=(-1, 0), enable_gqa=k.shape[1] != heads)  # (-1, 0): causal
    return out.view(batch, tokens, heads, dim).transpose(1, 2)
