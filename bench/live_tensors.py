"""What is alive at the peak: every tensor allocation of a run, attributed by shape, dtype, op and place.

    python bench/live_tensors.py                       # pipezero-offload, scaled TinyLlama, 16K tokens, CPU
    python bench/live_tensors.py --run pipezero-full --length 32768 --top 30

A TorchDispatchMode sees every op's outputs; each new storage is an allocation (its bytes, the op, the
module whose forward ran it, the autograd node whose backward ran it, the phase: forward, recompute,
backward), freed when its storage object dies (a weak reference's callback; torch keeps a storage's
Python object for as long as the storage lives). The peak is the most bytes alive at once over one
step (after a warm-up step, so the optimizer's state is there); the report lists what is alive then.

The memory kit's offload moves each checkpointed run's inputs to pinned host memory and copies them
back on a side stream (pipe/memory/offload.py). On CPU there is no stream: HostOffload keeps a plain
copy and hands it back as it is. `simulated_offload` runs the CUDA path's allocations on CPU instead
(the host copies counted as host memory, each copy back a new tensor made when the run before it is
prefetched), so the CPU peak is the GPU's, up to the kernels' own workspaces.

The scaled shape keeps TinyLlama's structure (6 layers of hidden 256, 8 heads of 32 and 2 key-value
heads, intermediate 2.75 x hidden, vocab 4,000; fused loss chunks of 2^25 logits, MLP tiles of 2,048
rows). Each allocation is extrapolated to TinyLlama at --to tokens by its dims (SCALE_DIMS: the scaled
length becomes --to, hidden 256 becomes 2,048, ...; a dim that is none of those and longer than 128 is
a document's part of the row, and there are --to / length times more of them; a layer's weights count
22 / 6 times), and the peak of the extrapolated run is found at its own moment. The scaled run tiles
its MLP and norms where the full run at --to tokens tiles them (so --load needs the --save run's --to).
At 16K scaled tokens it predicted the H100's 10.93 / 19.60 / 54.26 GiB at 32K / 128K / 512K (bench/
RESULTS.md) as 10.77 / 19.26 / 53.91 GiB.

The norms' tiles keep their count, not their rows: the scaled run's --length / 512 tiles stand for as
many of 16,384 rows, and their input gradients, alive together until the split's backward joins them
(d elements a token at the full run), are extrapolated right only where --to / 16,384 is that count:
--length = --to / 32 (16K for 512K, 32K for 1M, 4K for 128K); the report says so otherwise. For the
code since the norms are tiled (offloaded run, --length --to / 32): 13.51 / 29.03 / 49.72 GiB at 128K /
512K / 1M (at 16K scaled tokens, 15.01 and 47.72 at 128K and 1M); tests/test_plan_kit.py holds them.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipezero.pipe import tiled_mlp

__all__ = ["Alloc", "LiveTensors"]


@dataclass(slots=True)
class Alloc:
    """One storage: its bytes, where it was made, when it was made and freed (op counters)."""

    nbytes: int
    shape: tuple
    dtype: torch.dtype
    op: str
    module: str
    node: str
    phase: str
    host: bool
    born: int
    died: int = -1


@dataclass
class LiveTensors(TorchDispatchMode):
    """Records every allocation made under it; `peak()` finds the most bytes alive at once afterwards."""

    allocs: list[Alloc] = field(default_factory=list)
    now: int = 0
    start: int = 0
    _host: bool = False
    _modules: list[str] = field(default_factory=list)
    _names: dict[int, str] = field(default_factory=dict)
    _seen: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.now += 1
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._see(t, str(func.overloadpacket.__name__))
        return out

    def _see(self, t: torch.Tensor, op: str) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen or storage.nbytes() == 0:
            return
        node = torch._C._current_autograd_node()
        module = self._modules[-1] if self._modules else ""
        phase = "forward" if node is None else ("recompute" if self._modules else "backward")
        a = Alloc(storage.nbytes(), tuple(t.shape), t.dtype, op, module,
                  type(node).__name__ if node is not None else "", phase, self._host, self.now)
        self.allocs.append(a)
        self._seen.add(key)
        weakref.finalize(storage, self._free, key, a)

    def _free(self, key: int, a: Alloc) -> None:
        self._seen.discard(key)
        a.died = self.now

    def reset_peak(self) -> None:
        """Look for the peak from here on (e.g. after a warm-up step, the optimizer's state made)."""
        self.start = self.now

    @contextmanager
    def host(self) -> Iterator[None]:
        """Allocations made inside are host memory (not counted in the device's peak)."""
        before, self._host = self._host, True
        try:
            yield
        finally:
            self._host = before

    @contextmanager
    def modules(self, root: torch.nn.Module) -> Iterator[None]:
        """Name each allocation by the innermost of root's modules whose forward runs."""
        self._names = {id(m): name or "root" for name, m in root.named_modules()}

        def pre(m, args):
            self._modules.append(self._names.get(id(m), type(m).__name__))

        def post(m, args, out):
            if self._modules:
                self._modules.pop()
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                   torch.nn.modules.module.register_module_forward_hook(post, always_call=True)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def peak(self, size: Callable[[Alloc], float] = lambda a: a.nbytes) -> tuple[float, int, list[Alloc]]:
        """(bytes, op counter, the device allocations alive then) at the most `size` alive at once since
        reset_peak(); an allocation is alive from the op that made it to the op during which it was freed."""
        delta: dict[int, float] = defaultdict(float)
        device = [a for a in self.allocs if not a.host and (a.died < 0 or a.died >= self.start)]
        for a in device:
            delta[max(a.born, self.start)] += size(a)
            if a.died >= 0:
                delta[a.died + 1] -= size(a)
        best, at, running = -1.0, self.start, 0.0
        for t in sorted(delta):
            running += delta[t]
            if running > best and t <= self.now:
                best, at = running, t
        return best, at, [a for a in device if a.born <= at and (a.died < 0 or a.died >= at)]


# -- the run: the pipezero paths of bench/long_context.py at a scaled shape ---------------------------------
SCALED = dict(vocab_size=4000, hidden_size=256, intermediate_size=704, num_hidden_layers=6,
              num_attention_heads=8, num_key_value_heads=2)
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4)
NORM_TILE = 512  # the norms' tile rows in the scaled run, standing for NORM_TILE_ROWS at the full shape
SCALE_DIMS = {256: 2048, 704: 5632, 4000: 32000, 8: 32, 32: 64, 64: 256, 2: 4, 4: 8, 2048: 2048,
              NORM_TILE: tiled_mlp.NORM_TILE_ROWS}
LOSS_ROWS = (2**25 // 4000, 2**25 // 32000)  # the fused loss's chunk rows, scaled and full
LAYER_SHAPES = {(704, 256), (256, 704), (256, 256), (64, 256)}  # a layer's weights (their grads, Adam's state)
LAYERS = TINYLLAMA["num_hidden_layers"] / SCALED["num_hidden_layers"]
NORM_TILE_FROM_ROWS = tiled_mlp.NORM_TILE_FROM_ROWS  # the full run's (mirror_tiling changes the module's)


def extrapolate(a: Alloc, length: int, to: int) -> float:
    """a's bytes at TinyLlama's shape and `to` tokens."""
    floating = a.dtype.is_floating_point
    n = float(torch.finfo(a.dtype).bits // 8 if floating else a.nbytes / max(1, _numel(a.shape)))
    if a.shape in LAYER_SHAPES:  # one of the scaled model's layers: 22 of them at the full shape
        n *= LAYERS
    loss_chunk = len(a.shape) == 2 and a.shape[1] == 4000  # [rows, vocab]: the fused loss's chunk of rows
    for d in a.shape:
        if loss_chunk and d != 4000:
            n *= LOSS_ROWS[1]
        elif d == length:
            n *= to
        elif d in SCALE_DIMS:
            n *= SCALE_DIMS[d]
        elif d > 128:  # a document's slice of the sequence: there are to / length times more of them
            n *= d * to / length
        else:
            n *= d
    return n


def _numel(shape: tuple) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def report(tracker: LiveTensors, length: int, to: int, top: int) -> None:
    """The measured peak, then the extrapolated one (its own moment) with what is alive then, grouped."""
    measured, at, _ = tracker.peak()
    if note := tile_count_note(length, to):
        print(note)
    full, full_at, alive = tracker.peak(lambda a: extrapolate(a, length, to))
    print(f"measured peak {measured / 2**20:.1f} MiB ({measured / length:.0f} B/token) at op {at}; "
          f"extrapolated to TinyLlama's shape at {to} tokens: peak {full / 2**30:.2f} GiB at op {full_at} "
          f"(of {tracker.now})")
    groups: dict[tuple, list[Alloc]] = defaultdict(list)
    for a in alive:
        groups[(a.phase, a.module, a.node, a.op, a.shape, str(a.dtype).removeprefix("torch."))].append(a)
    rows = sorted(groups.items(), key=lambda kv: -sum(extrapolate(a, length, to) for a in kv[1]))
    print(f"{'full GiB':>9} {'MiB':>8} {'n':>3}  phase      module / backward node / op / shape dtype")
    for (phase, module, node, op, shape, dtype), items in rows[:top]:
        mib = sum(a.nbytes for a in items) / 2**20
        gib = sum(extrapolate(a, length, to) for a in items) / 2**30
        print(f"{gib:9.2f} {mib:8.2f} {len(items):>3}  {phase:<10} {module or '-'} / {node or '-'} / {op} / "
              f"{list(shape)} {dtype}")
    rest = [a for _, g in rows[top:] for a in g]
    if rest:
        print(f"{sum(extrapolate(a, length, to) for a in rest) / 2**30:9.2f} "
              f"{sum(a.nbytes for a in rest) / 2**20:8.2f}      ({len(rows) - top} more groups)")


def tile_count_note(length: int, to: int) -> str:
    """Empty where the scaled run's norm tiles are as many as the full run's at `to` tokens; else the --length
    that makes them so (their gradients waiting for the join are extrapolated by their count)."""
    full_rows = SCALE_DIMS[NORM_TILE]
    if to < NORM_TILE_FROM_ROWS or length * full_rows == to * NORM_TILE:
        return ""
    return (f"note: {length // NORM_TILE} norm tiles stand for {to // full_rows} at {to} tokens (their input "
            f"gradients are extrapolated by the count): --length {to * NORM_TILE // full_rows} keeps it")


def mirror_tiling(to: int) -> None:
    """Tile the scaled run's MLP and norms where TinyLlama's run at `to` tokens tiles them (the MLP's tiles
    keep their 2,048 rows, the norms' are NORM_TILE rows standing for theirs)."""
    tiled_mlp.TILE_FROM_ROWS = 1 if to >= tiled_mlp.TILE_FROM_ROWS else 10**12
    tiled_mlp.NORM_TILE_FROM_ROWS = 1 if to >= tiled_mlp.NORM_TILE_FROM_ROWS else 10**12
    tiled_mlp.NORM_TILE_ROWS = NORM_TILE


@contextmanager
def simulated_offload(tracker: LiveTensors) -> Iterator[None]:
    """HostOffload's CUDA allocations on CPU: host copies counted as host memory, and each copy back a new
    tensor made when prefetched (on CPU HostOffload hands its copy back as it is). Follows the private
    layout of pipe/memory/offload.py's _Stashed (host, on_device): keep the two in step."""
    from pipezero.pipe.memory import offload

    cls = offload._Stashed
    saved = cls.__init__, cls.prefetch, cls.fetch

    def init(self, t, stream):
        with tracker.host():
            saved[0](self, t, stream)

    def prefetch(self):
        if self.on_device is None:
            self.on_device = self.host.clone()

    def fetch(self):
        self.prefetch()
        out, self.on_device = self.on_device, None
        return out
    cls.__init__, cls.prefetch, cls.fetch = init, prefetch, fetch
    try:
        yield
    finally:
        cls.__init__, cls.prefetch, cls.fetch = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", default="pipezero-offload",
                   choices=("pipezero", "pipezero-full", "pipezero-offload"))
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--to", type=int, default=2**20, help="tokens to extrapolate to (TinyLlama's shape)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--save", default=None, help="also pickle the allocations here (re-report with --load)")
    p.add_argument("--load", default=None,
                   help="report a --save'd run (made with the same --to) instead of running")
    args = p.parse_args()
    if args.load:
        with open(args.load, "rb") as f:
            tracker = LiveTensors(**pickle.load(f))
        report(tracker, args.length, args.to, args.top)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import long_context
    from transformers import LlamaConfig

    config = LlamaConfig(**SCALED, max_position_embeddings=args.length, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    mirror_tiling(args.to)
    tracker = LiveTensors()
    with tracker:
        dtype = getattr(torch, args.dtype)
        module, step = long_context.pipezero_parts(config, torch.device("cpu"), dtype, args.run)
        ids, positions = long_context._row(args.length, config.vocab_size, torch.device("cpu"))
        with tracker.modules(module), simulated_offload(tracker):
            step(ids, positions)
            tracker.reset_peak()
            step(ids, positions)
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(dict(allocs=tracker.allocs, now=tracker.now, start=tracker.start), f)
    report(tracker, args.length, args.to, args.top)


if __name__ == "__main__":
    main()
