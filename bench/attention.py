"""Which scaled_dot_product_attention kernel is fastest for the shapes of issue 31's models.

    python bench/attention.py                 # CPU smoke: small shapes, the kernels CPU has
    python bench/attention.py --device cuda   # the 1.1B Llama's and the 1.34B GPT's attention, bf16

Causal attention forward + backward, one micro-batch, each SDPA backend torch has forced in
turn (torch.nn.attention.sdpa_kernel) beside torch's own choice; grouped-query attention
(the Llama: 32 query heads over 4 key/value heads) both with `enable_gqa=True` and with the
keys and values repeated to every query head first (transformers' repeat_kv). Timed with
CUDA events, median of the rounds; TFLOP/s counts the causal half: forward 2 x 2 x B x H x
S^2 x D / 2, backward 2.5 x that.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def _inputs(batch, heads, kv_heads, seq, dim, device, dtype):
    def make(h):
        return torch.randn(batch, h, seq, dim, device=device, dtype=dtype, requires_grad=True)
    return make(heads), make(kv_heads), make(kv_heads)


def _attend(q, k, v, gqa: str) -> torch.Tensor:
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if gqa == "enable_gqa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]  # transformers' repeat_kv: every query head gets its own copy
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _time(fn, device, repeats: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


def measure(shape: dict, backend: str, gqa: str, device, dtype, rounds: int, repeats: int) -> float | None:
    """Median seconds of one forward + backward, or None when the backend refuses the inputs."""
    q, k, v = _inputs(**shape, device=device, dtype=dtype)
    grad = torch.randn_like(q)

    def step():
        out = _attend(q, k, v, gqa)
        out.backward(grad)

    chosen = BACKENDS[backend]
    try:
        with sdpa_kernel([chosen]) if chosen is not None else contextlib.nullcontext():
            step()
            times = [_time(step, device, repeats) for _ in range(rounds)]
    except RuntimeError as err:
        print(f"  {backend} / {gqa}: not available ({str(err).splitlines()[0][:120]})")
        return None
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seq = 2048 if cuda else 128
    shapes = {"Llama 1.1B (32 q / 4 kv heads, d 64)": dict(batch=4, heads=32, kv_heads=4, seq=seq, dim=64),
              "GPT 1.34B (16 heads, d 128)": dict(batch=4, heads=16, kv_heads=16, seq=seq, dim=128)}
    backends = [b for b in BACKENDS if cuda or b in ("default", "math", "flash")]
    print(f"SDPA causal forward + backward, {dtype}, {args.device}, torch {torch.__version__}, "
          f"median of {args.rounds} x {args.repeats}")
    print("| shape | backend | GQA | ms | TFLOP/s | vs default |")
    print("|---|---|---|---|---|---|")
    for label, shape in shapes.items():
        flops = 3.5 * 2 * shape["batch"] * shape["heads"] * shape["seq"] ** 2 * shape["dim"]  # causal half
        ways = ["enable_gqa", "repeat_kv"] if shape["kv_heads"] != shape["heads"] else ["-"]
        for gqa in ways:
            base = None
            for backend in backends:
                sec = measure(shape, backend, gqa, device, dtype, args.rounds, args.repeats)
                if sec is None:
                    continue
                base = base or sec
                print(f"| {label} | {backend} | {gqa} | {sec * 1e3:.3f} | {flops / sec / 1e12:.0f} | "
                      f"{base / sec:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
