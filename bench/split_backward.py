"""Zero-bubble's split backward on one chunk: deferred Linear GEMMs vs torch's graph split.

    python bench/split_backward.py                  # CPU, one thread, micro-batch 1 and 4
    python bench/split_backward.py --device cuda --layers 6 --d-model 2048 --heads 16 --seq 2048

A chunk of examples/gpt.py blocks runs forward and backward three ways, the same weights and
inputs: F + B, one ordinary backward (what 1F1B runs); F + I + W the way torch.distributed.pipelining
splits it (stage_backward_input / stage_backward_weight: a Python walk of the graph and one
autograd call per parameter group each microbatch), the peer a user of torch's zero-bubble
schedules gets; and F + I + W as pipezero's runner splits it (pipe/deferred_linear.py: the
Linear layers keep their weight GEMMs for W). A split schedule only wins if its split costs
about what B costs: the table prints milliseconds (fastest of --repeats, variants
interleaved) and each split's time over F + B.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from gpt import Block, GPTConfig  # noqa: E402
from pipezero.pipe.deferred_linear import WeightSink, collecting, defer_linear_weights  # noqa: E402
from pipezero.pipe.split_backward import _stage_backward_input, _stage_backward_weight  # noqa: E402


def _chunk(args, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq)
    return torch.nn.Sequential(*[Block(cfg, i) for i in range(args.layers)]).to(device, dtype)


def _variants(chunk: torch.nn.Module, x0: torch.Tensor, grad: torch.Tensor) -> dict:
    chunk_d = copy.deepcopy(chunk)
    assert defer_linear_weights(chunk_d), "the chunk has no nn.Linear to defer"
    params = list(chunk.parameters())

    def b():
        x = x0.clone().requires_grad_()
        torch.autograd.backward([chunk(x)], [grad])

    def torch_split():
        x = x0.clone().requires_grad_()
        _, groups = _stage_backward_input([chunk(x)], [grad], [x], iter(params))
        _stage_backward_weight(iter(params), groups)

    def deferred():
        x, sink = x0.clone().requires_grad_(), WeightSink()
        with collecting(sink):
            out = chunk_d(x)
        torch.autograd.backward([out], [grad])
        sink.apply()

    return {"F+B": b, "torch": torch_split, "deferred": deferred}


def _time(variants: dict, device: torch.device, repeats: int, inner: int) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = {name: float("inf") for name in variants}
    for fn in variants.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / inner)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=6, help="blocks in the chunk")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--microbatch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    torch.manual_seed(0)
    chunk = _chunk(args, device, dtype)
    print(f"torch {torch.__version__} {device} {dtype}: {args.layers} blocks of GPT d_model {args.d_model}, "
          f"heads {args.heads}, seq {args.seq}")
    print("| micro-batch | F+B ms | F+I+W torch ms | F+I+W deferred ms | torch / (F+B) | deferred / (F+B) |")
    print("|---|---|---|---|---|---|")
    for mb in args.microbatch:
        x0 = torch.randn(mb, args.seq, args.d_model, device=device, dtype=dtype)
        grad = torch.randn_like(x0)
        ms = {k: 1e3 * v for k, v in _time(_variants(chunk, x0, grad), device, args.repeats, args.inner).items()}
        b, t, d = ms["F+B"], ms["torch"], ms["deferred"]
        print(f"| {mb} | {b:.2f} | {t:.2f} | {d:.2f} | {t / b:.2f} | {d / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
