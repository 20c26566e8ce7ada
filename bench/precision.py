"""Per-step cost of LossScaler versus torch.amp.GradScaler on the same parameters and Adam.

    python bench/precision.py                    # CPU, gloo, 2 processes
    python bench/precision.py --device cuda      # one process per GPU, nccl

Each timed step restores the same (scaled) gradients, then runs one optimizer step the given way;
the table shows ms per step (best of --repeats, ranks started together by a barrier), the overhead over a plain Adam step, and the ratio of our overhead to
GradScaler's (< 1: ours is cheaper). LossScaler also agrees on overflow over the whole world (one
small all-reduce), which GradScaler does not do; the no-op row is the bf16/fp32 path.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipezero.precision import LossScaler
from launch import finish_rank, init_rank  # bench/launch.py (bench/ is on sys.path when run as a script)

SCALE = 2.0 ** 16


def gpt_shapes(layers: int, d: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT: embeddings, then per block norms, attention and MLP."""
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (1024, d)] + block * layers + [(d,), (d,)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_all(variants: dict, restore, device: torch.device, repeats: int) -> dict[str, float]:
    """Fastest seconds of restore(scale) + step() per variant over `repeats`, the variants interleaved
    round-robin; the minimum is the estimate least disturbed by other work on a shared machine."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats + 2):  # two warm-up rounds (Adam state, kernels)
        for name, (step, scale) in variants.items():
            _sync(device)
            dist.barrier()  # every rank starts the step together, as in training
            start = time.perf_counter()
            restore(scale)
            step()
            _sync(device)
            if repeat >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def _variants(params: list[torch.Tensor], device: torch.device) -> dict:
    """name -> (step function, the scale the restored gradients carry)."""
    def adam():
        return torch.optim.Adam(params, lr=1e-6, foreach=True)

    plain = adam()
    ours = LossScaler(adam(), init_scale=SCALE)
    ours_clip = LossScaler(adam(), init_scale=SCALE, clip_grad_norm=1e9)
    noop = LossScaler(adam(), init_scale=1, dynamic=False)
    torch_opt, torch_clip_opt = adam(), adam()
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=10 ** 9)
    clip_scaler = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=10 ** 9)
    for s in (scaler, clip_scaler):
        s.scale(torch.ones((), device=device))  # GradScaler sets its scale up lazily

    def grad_scaler():
        scaler.step(torch_opt)
        scaler.update()

    def grad_scaler_clip():
        clip_scaler.unscale_(torch_clip_opt)
        torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True)
        clip_scaler.step(torch_clip_opt)
        clip_scaler.update()

    return {"Adam alone": (plain.step, 1.0),
            "GradScaler + Adam": (grad_scaler, SCALE),
            "LossScaler(dynamic) + Adam": (ours.step, SCALE),
            "GradScaler + clip_grad_norm_": (grad_scaler_clip, SCALE),
            "LossScaler(dynamic, clip)": (ours_clip.step, SCALE),
            "LossScaler(off) [bf16 path]": (noop.step, 1.0)}


def _bench_model(shapes, device: torch.device, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    unscaled = [torch.randn(s, generator=gen).to(device) * 1e-3 for s in shapes]
    saved = {1.0: unscaled, SCALE: [g * SCALE for g in unscaled]}
    for p, g in zip(params, unscaled):
        p.grad = g.clone()
    grads = [p.grad for p in params]
    return _time_all(_variants(params, device), lambda scale: torch._foreach_copy_(grads, saved[scale]),
                     device, repeats)


_PEERS = {"LossScaler(dynamic) + Adam": "GradScaler + Adam",
          "LossScaler(dynamic, clip)": "GradScaler + clip_grad_norm_"}


def _print(title: str, results: dict[str, float]) -> None:
    base = results["Adam alone"]
    print(f"\n{title}")
    print(f"{'way':<30}{'ms/step':>10}{'overhead ms':>13}{'vs Adam':>9}{'overhead / torch':>18}")
    for name, seconds in results.items():
        if name.startswith("("):
            print(f"{name:<30}{seconds * 1e3:>10.2f}")
            continue
        peer = _PEERS.get(name)
        ratio = f"{(seconds - base) / (results[peer] - base):>18.2f}" if peer else ""
        print(f"{name:<30}{seconds * 1e3:>10.2f}{(seconds - base) * 1e3:>13.2f}{seconds / base:>9.3f}{ratio}")


def _worker(rank: int, world: int, port: int, args) -> None:
    device = init_rank(rank, world, port, args.device)
    models = {"GPT 4x128 (small tensors)": (4, 128, 4096), "GPT 4x256": (4, 256, 4096)}
    if args.device == "cuda":
        models["GPT 12x768 (~110M)"] = (12, 768, 32000)
    for name, (layers, d, vocab) in models.items():
        shapes = gpt_shapes(layers, d, vocab)
        results = _bench_model(shapes, device, args.repeats)
        results["(a 2-number all_reduce alone)"] = _time_all(
            {"": (lambda: dist.all_reduce(torch.zeros(2, device=device)), 1.0)}, lambda _: None, device,
            args.repeats)[""]
        if rank == 0:
            numel = sum(torch.Size(s).numel() for s in shapes)
            _print(f"{name}: {len(shapes)} tensors, {numel / 1e6:.1f}M params, {world} x {args.device} "
                   f"({dist.get_backend()}), best of {args.repeats}", results)
    finish_rank()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from pipezero.topology.env import _free_port

    torch.set_num_threads(1)
    mp.spawn(_worker, args=(args.world, _free_port(), args), nprocs=args.world)


if __name__ == "__main__":
    main()
