"""The MLP (and the norms) in row tiles, each tile recomputed in backward: no [tokens, intermediate] tensor
is whole, and no norm keeps an fp32 copy of its [tokens, hidden] input.

A transformer's MLP works on each token alone, and its intermediate activations (a Llama
MLP keeps four [tokens, intermediate] tensors for backward: gate, silu(gate), up and their
product) dominate a layer's saved activations (intermediate is ~3.5x hidden). Run over
tiles of rows, each tile under torch.utils.checkpoint (non-reentrant), the forward keeps
only the tiles' inputs (views of the MLP's input) and the backward re-runs one tile's
forward at a time before its backward, so at most one tile's intermediate is alive: the
MLP's memory is O(tokens x hidden) + O(tile x intermediate) (DeepSpeed ALST's TiledMLP,
Bekman et al. 2025, arXiv 2506.13996). Being plain autograd, the tiles compose with
everything else that hooks it: ZeRO's gradient hooks, the split backward's deferred weight
GEMMs, tensor-parallel hooks and layer-level activation checkpointing around it.

The cost is one more forward of the MLP (a third of its FLOPs) and a Python loop over tiles. So
tiling is on by default only from TILE_FROM_ROWS tokens in a micro-batch (8,192): there the MLP's
saved tensors are large (TinyLlama's shape: 4 x 8K x 5,632 x 2 bytes = 369 MB per layer in bf16,
8 GB over its 22 layers) and causal attention's quadratic FLOPs take a growing share of the layer
(they equal the MLP's at 3 x intermediate tokens, 17K for TinyLlama), so the recomputation costs
~19% of a TinyLlama layer's FLOPs at 8K, ~10% at 32K and ~4% at 128K, and less on a GPU where
attention runs below the GEMMs' speed. Below 8K the MLP runs whole: there the recomputation would
be measurable and its memory is not what limits the length. Tiles have TILE_ROWS rows (2,048:
GEMMs of that height run at full speed on a GPU). The result is the untiled one up to float
rounding (the weight gradients are summed over tiles);
dropout inside the MLP draws other masks than one untiled call would.

The tiles are one `split` of the rows (autograd's SplitBackward joins the tiles' gradients once), not
one slice each: a slice's gradient is a zero-filled tensor of the whole input, so slices cost the
backward one [tokens, hidden] allocation and addition per tile, O(tokens^2 / tile) memory traffic.

A decoder layer's norms (RMSNorm, LayerNorm: each token alone too) run in tiles of NORM_TILE_ROWS rows
(16,384) from NORM_TILE_FROM_ROWS (65,536). A Llama RMSNorm computes in fp32: whole, it keeps an fp32
copy of its input for backward and its backward makes five more [tokens, hidden] fp32 tensors (at 1M
tokens of TinyLlama's shape, 40 GiB at once: the peak of a checkpointed layer's backward, measured by
bench/live_tensors.py). Tiled, it keeps its bf16 input and output and its backward's fp32 temporaries
are one tile's. The norm is recomputed once more (a few elementwise passes over [tokens, hidden] per
norm), so tiling starts where its memory matters (past 64K tokens), not at 32K, where the memory does
not limit the length and the passes would only cost time.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipezero.pipe.compile import CompileConfig, compiled
from pipezero.pipe.memory.recompute import recomputed_matmuls

__all__ = ["NORM_TILE_FROM_ROWS", "NORM_TILE_ROWS", "TILE_FROM_ROWS", "TILE_ROWS", "tile_mlp", "tile_norm",
           "tiled_rows"]

TILE_FROM_ROWS = 8192  # tokens per micro-batch from which the MLP runs in tiles by default
TILE_ROWS = 2048       # rows per tile
NORM_TILE_FROM_ROWS = 65536  # the same for a decoder layer's norms
NORM_TILE_ROWS = 16384


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_rows: int | None = None,
               from_rows: int | None = None, compile_as: CompileConfig | None = None) -> torch.Tensor:
    """fn(x) for a row-wise fn (each token alone) on x [..., d], in tiles of tile_rows rows (TILE_ROWS) when
    x has at least from_rows rows (TILE_FROM_ROWS) and autograd records (no gradient: fn(x) whole, nothing
    is kept anyway). compile_as: traced inside a compiled layer, the tiles run outside its graph and fn
    is compiled on its own as it says (`_tiles_outside_the_graph`); None: the tiles are traced with it."""
    tile_rows = TILE_ROWS if tile_rows is None else tile_rows
    from_rows = TILE_FROM_ROWS if from_rows is None else from_rows
    if tile_rows < 1:
        raise ValueError(f"tiled_rows(tile_rows={tile_rows}): expected a positive number of rows per tile")
    rows = x[..., 0].numel()
    if rows < from_rows or rows <= tile_rows or not torch.is_grad_enabled():
        return fn(x)
    if compile_as is not None and torch.compiler.is_compiling():
        return _tiles_outside_the_graph(fn, x, tile_rows, compile_as)
    return _tiles(fn, x, tile_rows)


@torch.compiler.disable  # a break in the compiled layer's graph, so the tiles' inputs are kept ahead of them
def _tiles_outside_the_graph(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_rows: int,
                            compile_as: CompileConfig) -> torch.Tensor:
    """The tiles of a compiled layer, each tile's fn compiled on its own (one graph for every tile).

    Traced inside the layer's graph, the tiles' inputs are kept by the graph as a whole, at its end, so
    a checkpointed layer's recompute (pipe/memory/recompute.py), which stops once it has made every
    tensor the forward kept, ran the whole MLP forward once more for nothing: out here they are kept
    ahead of the tiles (_KeptRows) and the recompute stops before them, as it does for an eager layer.
    """
    return _tiles(_compiled_alone(fn, compile_as), x, tile_rows)


_COMPILED_FNS: dict[tuple[Any, int], tuple[CompileConfig, Callable]] = {}


def _compiled_alone(fn: Callable, config: CompileConfig) -> Callable:
    """fn compiled as config says; a bound method through its class's function, so the layers of a
    model share one compiled graph (their modules are its inputs)."""
    func, owner = getattr(fn, "__func__", fn), getattr(fn, "__self__", None)
    key = (func, id(config))
    if key not in _COMPILED_FNS:  # the config kept with it: its id is not reused while it is here
        _COMPILED_FNS[key] = (config, compiled(func, config))
    run = _COMPILED_FNS[key][1]
    return run if owner is None else functools.partial(run, owner)


def _tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_rows: int) -> torch.Tensor:
    rows = x[..., 0].numel()
    flat = x.reshape(rows, x.shape[-1])
    tiles = flat.split(tile_rows)
    with recomputed_matmuls():  # under a selective checkpoint too, no tile's matmul output is kept
        if torch.compiler.is_compiling() or not flat.requires_grad:
            outs = [checkpoint(fn, tile, use_reentrant=False) for tile in tiles]
        else:
            kept = _KeptRows(flat, tile_rows)
            outs = [kept.checkpoint(fn, tile) for tile in tiles]
    out = torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _KeepRows(torch.autograd.Function):
    """Saves the rows for the tiles (through whatever saved-tensor hooks are set); computes nothing."""

    @staticmethod
    def forward(ctx, flat):
        ctx.save_for_backward(flat)
        return flat.new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        return None


class _KeptRows:
    """The tiles' inputs saved once, before any tile runs, as one tensor: the rows.

    Each tile's checkpoint keeps its input; kept one by one, an enclosing checkpoint (a checkpointed
    layer, pipe/memory/recompute.py) would see its last kept tensor only when the last tile starts, so
    its recompute, which stops once it has made every tensor the forward kept, would run every tile
    but the last for nothing (the layer's output, which they make, is not kept): with a Llama's MLP
    in tiles at the end of the layer, most of the MLP's forward once more per layer and step. Here
    the tiles' inputs are saved once, before the tiles, and each tile's checkpoint keeps an index into
    them, so an enclosing recompute stops before the tiles run; a tile's own recompute in backward
    takes its rows from them.
    """

    def __init__(self, flat: torch.Tensor, tile_rows: int):
        # the node's empty output, not its grad_fn: torch 2.11's grad_fn of a custom Function refers to its
        # node weakly, so with the output gone the node and its saved rows were freed before the tiles'
        # backward read them ("Trying to backward through the graph a second time", CUDA and CPU)
        self.keeper = _KeepRows.apply(flat)
        self.tile_rows, self.count, self.tiles = tile_rows, 0, None
        self.expected: torch.Tensor | None = None

    def checkpoint(self, fn: Callable[[torch.Tensor], torch.Tensor], tile: torch.Tensor) -> torch.Tensor:
        self.expected = tile
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return checkpoint(fn, tile, use_reentrant=False)
        finally:
            self.expected = None

    def _pack(self, t: torch.Tensor) -> object:
        if t is not self.expected:  # not the tile's input: kept as it is (the checkpoint saves nothing else)
            return t
        self.expected, index = None, self.count
        self.count += 1
        return index

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if self.tiles is None:
            (flat,) = self.keeper.grad_fn.saved_tensors
            self.tiles, self.left = flat.split(self.tile_rows), self.count
        out = self.tiles[packed]
        self.left -= 1
        if self.left == 0:  # every tile has its rows: the rows go when the last tile is done with them
            self.tiles = None
        return out


_TILED: dict[type, type] = {}


def tile_mlp(mlp: nn.Module, tile_rows: int | None = None, from_rows: int | None = None) -> nn.Module:
    """Make `mlp` (a module applied to each token alone: an HF decoder layer's `mlp`) run in tiles.

    The module keeps its parameters, names and state_dict: only its class becomes a subclass whose
    forward goes through tiled_rows (as torch.nn.utils.parametrize swaps a module's class). Returns it.
    """
    return _tiled(mlp, tile_rows, from_rows, norm=False)


def tile_norm(norm: nn.Module, tile_rows: int | None = None, from_rows: int | None = None) -> nn.Module:
    """tile_mlp for a norm over the last dim (RMSNorm, LayerNorm), with the norms' defaults (NORM_TILE_*)."""
    return _tiled(norm, tile_rows, from_rows, norm=True)


def _tiled(mlp: nn.Module, tile_rows: int | None, from_rows: int | None, norm: bool) -> nn.Module:
    cls = type(mlp)
    if cls not in _TILED.values():
        if cls not in _TILED:
            _TILED[cls] = type(f"Tiled{cls.__name__}", (cls,), {"forward": _tiled_forward,
                                                                  "tiles_compile_as": None})
        mlp.__class__ = _TILED[cls]
    mlp.tile_rows, mlp.tile_from_rows, mlp.tile_norm = tile_rows, from_rows, norm
    return mlp


def _tiled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    whole = super(type(self), self).forward
    if self.tile_norm:  # the defaults read at each call (tests change them)
        rows = NORM_TILE_ROWS if self.tile_rows is None else self.tile_rows
        start = NORM_TILE_FROM_ROWS if self.tile_from_rows is None else self.tile_from_rows
        return tiled_rows(whole, x, rows, start, self.tiles_compile_as)
    return tiled_rows(whole, x, self.tile_rows, self.tile_from_rows, self.tiles_compile_as)
