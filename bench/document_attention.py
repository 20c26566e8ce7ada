"""Attention over a packed row of documents: one flash varlen call against one SDPA call per document.

    python bench/document_attention.py                 # CPU smoke: 8K tokens, the per-document loop
    python bench/document_attention.py --device cuda   # TinyLlama's heads at 32K..512K tokens, bf16

Forward + backward of causal attention within each document of one packed row (documents of
256..4,096 tokens end to end, as bench/long_context.py packs them), TinyLlama's attention: 32
query heads over 4 key/value heads of 64. Runs: `loop` (pipe/document_attention.py's per-document
SDPA, grouped heads as they are), `varlen` (the same module's one flash varlen call, CUDA only),
`flex` (FlexAttention with a document-causal block mask, compiled: what torchtitan does), and
`masked` (SDPA with the [T, T] block-diagonal mask: what transformers' sdpa path does; only where
the mask fits). Each the median of the rounds (CUDA events); the first differences against `loop`
are printed so a faster kernel is also checked for the same answer.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from long_context import packed_positions  # bench/, beside this file
from timing import median_seconds

from pipezero.pipe import document_attention as docatt

HEADS, KV_HEADS, DIM = 32, 4, 64


def _loop(q, k, v, docs):
    """document_attention's per-document SDPA path, whatever the device would pick."""
    pieces = [F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
              for a, b, c in zip(q.split(_sizes(docs), dim=2), k.split(_sizes(docs), dim=2),
                                 v.split(_sizes(docs), dim=2))]
    return torch.cat(pieces, dim=2)


def _sizes(docs) -> list[int]:
    return [hi - lo for _, lo, hi in docs.spans]


def _varlen(q, k, v, docs):
    return docatt._varlen_attention(q, k, v, docs, None)


def _flex_runner(positions: torch.Tensor, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = (positions[0] == 0).cumsum(0).to(device)
    length = positions.shape[1]

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(document_causal, None, None, length, length, device=device)
    attend = torch.compile(flex_attention)
    return lambda q, k, v, docs: attend(q, k, v, block_mask=mask, enable_gqa=True)


def _masked(positions: torch.Tensor):
    doc = (positions[0] == 0).cumsum(0)

    def attend(q, k, v, docs):
        d = doc.to(q.device)
        mask = (d[:, None] == d[None, :]).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return attend


def measure(run: str, length: int, device, dtype, rounds: int) -> tuple[float, float, float]:
    """(seconds per forward + backward, peak GiB, max |out - loop's out|) of one run at one length."""
    positions = packed_positions(length)
    docs = docatt.documents_from_positions(positions.to(device))
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, length, DIM, device=device, dtype=dtype, generator=gen, requires_grad=True)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    attend = {"loop": _loop, "varlen": _varlen, "masked": _masked(positions)}.get(run)
    attend = attend or _flex_runner(positions, device)
    grad = torch.randn(1, HEADS, length, DIM, device=device, dtype=dtype, generator=gen)

    def step():
        out = attend(q, k, v, docs)
        torch.autograd.grad(out, (q, k, v), grad)
        return out

    with torch.no_grad():
        diff = (attend(q, k, v, docs) - _loop(q, k, v, docs)).abs().max().item()
    step()  # warm-up (and flex's compilation)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = median_seconds(step, device, rounds)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return seconds, peak, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--runs", nargs="+", default=None, choices=("loop", "varlen", "flex", "masked"))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    lengths = args.lengths or ([32768, 131072, 524288] if cuda else [8192])
    runs = args.runs or (["loop", "varlen", "flex", "masked"] if cuda else ["loop"])
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{name}, torch {torch.__version__}, {HEADS} / {KV_HEADS} heads of {DIM}, {dtype}, "
          f"documents of 256..4,096 tokens; forward + backward, median of {args.rounds}")
    print("| run | tokens | ms | x loop | peak GiB | max diff vs loop |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        base = None
        for run in runs:
            if run == "masked" and length * length > 2**31:  # a [T, T] mask over 2 GiB: not run
                print(f"| {run} | {length:,} | mask of {length * length / 2**30:.0f} GiB: not run | | | |")
                continue
            try:
                seconds, peak, diff = measure(run, length, device, dtype, args.rounds)
            except (torch.OutOfMemoryError, RuntimeError) as e:
                print(f"| {run} | {length:,} | {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | |")
                continue
            base = seconds if run == "loop" else base
            ratio = f"{base / seconds:.2f}x" if base else ""
            print(f"| {run} | {length:,} | {seconds * 1e3:.1f} | {ratio} | {peak:.2f} | {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
