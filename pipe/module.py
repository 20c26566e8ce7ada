"""PipelineModule: this rank's share of a model given as a list of layers.

The layer list is split into `pipe x num_chunks` contiguous virtual stages (pipe/partition.py),
placed on ranks looped or V-shaped (pipe/schedule/placement.py), and only the local layers are ever
built. Each layer is built under its own seed (seed + its index), so every stage builds the
same values a single process would: a parameter's name ("layers.3.weight",
"tied.embed.weight") is the same as in the whole model, which is what lets a checkpoint
saved on one grid load onto another. The idea follows DeepSpeed's PipelineModule
(Rasley et al. 2020) and GPipe's layer lists (Huang et al. 2019).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipezero.comm import all_reduce_coalesced, mark_replica
from pipezero.pipe.compile import CompileConfig, compile_layers, compile_loss, repeated_classes
from pipezero.pipe.deferred_linear import defer_linear_weights
from pipezero.pipe.float8 import Float8Config, check_float8, to_float8
from pipezero.pipe.memory.offload import HostOffload
from pipezero.pipe.memory.recompute import RecomputeConfig, checkpointed_runs, compiles_checkpointed
from pipezero.pipe.partition import partition, partition_table
from pipezero.pipe.schedule.placement import PLACEMENTS, owner, virtual_stage
from pipezero.pipe.shared_layers import check_shared_layers
from pipezero.pipe.sequence.layers import split_sequence
from pipezero.pipe.spec import LayerSpec, TiedLayerSpec, layer_name
from pipezero.pipe.stage_errors import LayerError, describe_input, layer_error
from pipezero.pipe.tensor_parallel import (PlanSource, apply_tensor_plan, check_tensor_plan,
                                             mark_tensor_duplicates, plan_for)
from pipezero.topology import Grid, process_device

__all__ = ["PipelineModule"]


class PipelineModule(nn.Module):
    """The local layers of a pipelined model, grouped into this rank's virtual chunks.

    `model(x, chunk=c)` runs chunk c; `model.parameters()` are this rank's only, so any
    optimizer chain composes with it. `recompute` (a RecomputeConfig, "full" or "selective") recomputes
    each run of layers in backward, all of it or all but the matmuls, its inputs on the host with
    offload=True (pipe/memory/recompute.py); `activation_checkpoint_interval=k` is the same as
    RecomputeConfig(mode="full", interval=k).
    `tensor_plan` ({layer class: plan} or a callable module -> plan or None) shards each built
    layer over grid.mesh["tensor"] (pipe/tensor_parallel.py); tied layers stay replicated.
    `compile` (True or a CompileConfig; default: on CUDA without tensor parallelism; False: off)
    torch.compiles each repeated layer's forward and the loss for training (pipe/compile.py).
    `deferred_linear=True` builds the plain nn.Linear layers as DeferringLinear: under a schedule
    that splits backward their weight GEMMs run in W (pipe/deferred_linear.py); False leaves
    them to torch's graph split (pipe/split_backward.py). `float8` (True or a Float8Config; default off)
    trains the repeated layers' Linears in fp8 through torchao (pipe/float8.py).
    """

    def __init__(self, layers: Sequence[Any], grid: Grid, loss_fn: Callable | None = None,
                 partition_method: str | Sequence[float] = "parameters", num_chunks: int = 1,
                 activation_checkpoint_interval: int = 0, placement: str = "looped",
                 seed: int = 0, device: torch.device | str | None = None,
                 tensor_plan: PlanSource | None = None, compile: CompileConfig | bool | None = None,
                 deferred_linear: bool = True, float8: Float8Config | bool | None = None,
                 recompute: RecomputeConfig | str | None = None):
        super().__init__()
        _check_args(layers, num_chunks, activation_checkpoint_interval, placement, deferred_linear)
        self.grid, self.loss_fn, self.placement = grid, loss_fn, placement
        self.num_stages, self.num_chunks = grid.pipe_size, num_chunks
        self.num_virtual_stages = self.num_stages * num_chunks
        self.recompute = _recompute(recompute, activation_checkpoint_interval)
        self.activation_checkpoint_interval = self.recompute.interval if self.recompute.enabled else 0
        self._offload = HostOffload() if self.recompute.offload else None
        self.seed, self.tensor_plan, self.deferred_linear = seed, tensor_plan, deferred_linear
        self.device = torch.device(device) if device is not None else process_device()
        self.float8_config = Float8Config.of(float8)
        if self.float8_config is not None:  # on every rank, before any collective
            check_float8(self.float8_config, self.device, grid.tensor_size)
        self._specs = list(layers)
        ranks = [owner(stage, self.num_stages, placement)[0] for stage in range(self.num_virtual_stages)]
        self.bounds = partition(self._specs, self.num_virtual_stages, partition_method, ranks)
        check_shared_layers(self._specs, self.bounds, ranks)  # one object on two ranks: two diverging copies
        _check_plans(self._specs, tensor_plan, grid.tensor_size)  # on every rank, before any collective
        self.stage_ids = [virtual_stage(grid.pipe_rank, c, self.num_stages, placement) for c in range(num_chunks)]
        self.layers = nn.ModuleDict()
        self.tied = nn.ModuleDict()
        self._calls: dict[int, Callable[[Any], Any]] = {}
        for chunk in range(num_chunks):
            for index in range(*self.chunk_range(chunk)):
                self._build(index)
        if grid.sequence_size > 1:  # attention exchanges with the sequence group, each slice's loss its share
            self.loss_fn = split_sequence(self._specs, self, loss_fn, grid, tensor_split=tensor_plan is not None)
        self._tie_groups: dict[str, Any] = {}
        self._make_tie_groups()
        if grid.tensor_size > 1:
            mark_tensor_duplicates(self, grid.tensor_rank)
        repeated = repeated_classes(self._specs)  # the blocks: what fp8 converts and compile compiles
        if self.float8_config is not None:  # before the Linears become DeferringLinear and compile
            to_float8([m for m in self.layers.values() if type(m) in repeated], self.float8_config, self.device)
        if deferred_linear:
            defer_linear_weights(self)
        self.compile_config = CompileConfig.of(compile, self.device, grid.tensor_size)  # None: on CUDA
        if self.compile_config is not None:
            if compiles_checkpointed(self.recompute):
                compile_layers(self.layers.values(), self.compile_config, repeated)
            if loss_fn is not None and self.num_virtual_stages - 1 in self.stage_ids:
                self.loss_fn = compile_loss(self.loss_fn, self.compile_config)

    # -- structure --------------------------------------------------------------------
    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """[first, last + 1) global layer indices of local `chunk`."""
        stage = self.stage_ids[chunk]
        return self.bounds[stage], self.bounds[stage + 1]

    def is_first(self, chunk: int) -> bool:
        """Does local `chunk` hold virtual stage 0 (it reads the data)?"""
        return self.stage_ids[chunk] == 0

    def is_last(self, chunk: int) -> bool:
        """Does local `chunk` hold the last virtual stage (it computes the loss)?"""
        return self.stage_ids[chunk] == self.num_virtual_stages - 1

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """Parameters local `chunk` uses (a tied module's appear in every chunk that uses it)."""
        seen: dict[int, nn.Parameter] = {}
        for index in range(*self.chunk_range(chunk)):
            layer = self._specs[index]
            if isinstance(layer, TiedLayerSpec):
                module = self.tied[layer.key]
            elif str(index) in self.layers:
                module = self.layers[str(index)]
            else:
                continue
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def describe(self) -> str:
        """The partition as a one-screen table (virtual stage, rank, chunk, layers, parameters)."""
        return partition_table(self._specs, self.bounds, self.num_stages, self.placement, self.grid.pipe_rank)

    # -- compute --------------------------------------------------------------------
    def forward(self, x: Any, chunk: int = 0) -> Any:
        """Run local `chunk` on `x` (a tensor or a tuple of tensors)."""
        lo, hi = self.chunk_range(chunk)
        if not self.recompute.enabled or not torch.is_grad_enabled():
            return self._run(lo, hi, x, chunk)
        return checkpointed_runs(lambda start, end, h: self._run(start, end, h, chunk), lo, hi, x,
                                 self.recompute, self._offload)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """loss_fn(output, target) of the last virtual stage."""
        if self.loss_fn is None:
            raise ValueError("PipelineModule(loss_fn=None) cannot compute a loss; pass loss_fn=")
        try:
            loss = self.loss_fn(output, target)
        except Exception as err:  # noqa: BLE001 - layer_error keeps what it does not describe
            raise layer_error(err, f"loss_fn (targets {describe_input(target)})", output, False) from err
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # backward needs one number per microbatch
            raise LayerError(f"loss_fn returned {describe_input(loss)} on output {describe_input(output)}; "
                             "expected a scalar tensor (reduce it, e.g. .mean() or reduction='mean')")
        if not loss.is_floating_point():  # backward would say only "does not require grad"
            raise LayerError(f"loss_fn returned {describe_input(loss)} on output {describe_input(output)}; expected "
                             "a floating-point scalar: an integer or bool loss has no gradient (a .long(), argmax or "
                             "count in loss_fn cut it from the graph)")
        return loss

    def _run(self, lo: int, hi: int, x: Any, chunk: int = 0) -> Any:
        for index in range(lo, hi):
            try:
                x = self._calls[index](x)
            except Exception as err:  # noqa: BLE001 - layer_error keeps what it does not describe
                name = layer_name(self._specs[index])
                fed = index == self.chunk_range(chunk)[0] and not self.is_first(chunk)
                wrapped = layer_error(err, f"layer {index} ({name})", x, fed)
                if wrapped is not err:
                    raise wrapped from err
                # not ours (torch.utils.checkpoint stops a recompute by raising through here): re-raised
                # holding no reference, since `raise err from err` ties err to itself and its traceback's
                # frames keep every recomputed tensor alive until the garbage collector runs
                del wrapped
                raise
        return x

    # -- building ---------------------------------------------------------------------
    def _build(self, index: int) -> None:
        layer = self._specs[index]
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied:
                first = next(i for i, s in enumerate(self._specs)
                             if isinstance(s, TiedLayerSpec) and s.key == layer.key)
                self.tied[layer.key] = self._seeded_build(layer, first, tied=True)
            module = self.tied[layer.key]
            fn = layer.forward_fn
            self._calls[index] = (lambda x, m=module, f=fn, k=layer.key: _tied_call(m, f, k, x)) \
                if fn is not None else module
        elif isinstance(layer, LayerSpec):
            self.layers[str(index)] = self._seeded_build(layer, index)
            self._calls[index] = self.layers[str(index)]
        elif isinstance(layer, nn.Module):
            self.layers[str(index)] = layer.to(self.device)
            self._calls[index] = layer
        else:
            self._calls[index] = layer

    def _seeded_build(self, spec: LayerSpec, index: int, tied: bool = False) -> nn.Module:
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
            torch.manual_seed(self.seed + index)
            with self.device:
                module = spec.build()
        plan = None if tied else plan_for(self.tensor_plan, module)
        where = f"layer {index} ({type(module).__name__})"
        if plan and self.grid.tensor_size > 1:  # sharded after the seeded build: slices of the dense weights
            apply_tensor_plan(module, self.grid.mesh["tensor"], plan, where)
        return module

    # -- tied weights -------------------------------------------------------------------
    def _make_tie_groups(self) -> None:
        """One process group per tied key and coordinate off the pipe axis, created on every rank
        in the same order (dist.new_group is collective); then broadcast from the first owner."""
        grid = self.grid
        for key, indices in _tied_indices(self._specs).items():
            owners = [owner(_stage_of(self.bounds, i), self.num_stages, self.placement)[0] for i in indices]
            ranks_pipe = sorted(set(owners))
            if len(ranks_pipe) < 2:
                continue
            for line in grid.axis_groups("pipe"):  # one per (data, sequence, tensor) coordinate
                ranks = [line[p] for p in ranks_pipe]
                group = dist.new_group(ranks)
                if grid.rank in ranks:
                    self._tie_groups[key] = (group, grid.rank_of(pipe=owners[0]))
        for key, (group, src) in self._tie_groups.items():
            spec = self._specs[_tied_indices(self._specs)[key][0]]
            for p in spec.tied_parameters(self.tied[key]):
                with torch.no_grad():
                    dist.broadcast(p.data, src=src, group=group)
                if src != grid.rank:
                    mark_replica(p)

    def tied_parameters(self) -> list[nn.Parameter]:
        """Local parameters shared with other pipeline ranks (their grads are summed over the owners)."""
        return [p for key in self._tie_groups for p in self._tied_spec(key).tied_parameters(self.tied[key])]

    def set_aside_tied_grads(self) -> list[torch.Tensor | None]:
        """Before a step: take each tied parameter's .grad away (None), so that the tie-group sum
        after the step adds this step's contributions only; returns them for sum_tied_grads."""
        tied = self.tied_parameters()
        aside = [p.grad for p in tied]
        for p in tied:
            p.grad = None
        return aside

    def sum_tied_grads(self, aside: Sequence[torch.Tensor | None], reduce: bool = True,
                       sums: Mapping[int, torch.Tensor] | None = None) -> list[nn.Parameter]:
        """Sum this step's tied gradients over their owners and add them to what was set aside.

        The optimizer left the tied .grad intact during the step (the runner named them in
        hold_grad_sync), or summed them itself in a wider dtype: `sums` (by id, the listener's
        tied_grad_sums), added up here in place instead of the .grad. reduce=False (after a
        failure): put back what was set aside, no collective. Returns the tied parameters whose
        gradient changed (the runner then releases them).
        """
        tied, sums = self.tied_parameters(), sums or {}
        if not reduce:
            for p, before in zip(tied, aside):
                p.grad = before
            return []
        before_of = {id(p): before for p, before in zip(tied, aside)}
        changed = []
        for key, (group, _) in self._tie_groups.items():
            params = [p for p in self._tied_spec(key).tied_parameters(self.tied[key]) if p.requires_grad]
            if not params:  # a frozen tied weight (LoRA's base) gets no gradient; the same on every owner
                continue
            grads = [_tied_grad(p, sums) for p in params]
            all_reduce_coalesced(grads, group=group).wait()
            for p, grad in zip(params, grads):
                before = before_of[id(p)]
                if id(p) in sums:  # the listener keeps the sum
                    if before is not None:
                        grad.add_(before)
                else:
                    p.grad = grad if before is None else before.add_(grad)
            changed += params
        return changed

    def _tied_spec(self, key: str) -> TiedLayerSpec:
        return self._specs[_tied_indices(self._specs)[key][0]]


def _tied_grad(p: nn.Parameter, sums: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """What a tied parameter's owners add up: the listener's wider sum, its .grad, or zeros."""
    if id(p) in sums:
        return sums[id(p)]
    return torch.zeros_like(p) if p.grad is None else p.grad


def _tied_indices(layers: Sequence[Any]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec):
            out.setdefault(layer.key, []).append(i)
    return out


def _stage_of(bounds: Sequence[int], index: int) -> int:
    return next(s for s in range(len(bounds) - 1) if bounds[s] <= index < bounds[s + 1])


def _check_plans(layers: Sequence[Any], source: PlanSource | None, degree: int) -> None:
    """Every layer's tensor plan fits (checked on meta copies, so every rank sees the same error)."""
    if source is None:
        return
    for index, layer in enumerate(layers):
        if not isinstance(layer, LayerSpec):
            continue
        with torch.device("meta"):
            module = layer.build()
        plan = plan_for(source, module)
        where = f"layer {index} ({type(module).__name__})"
        if plan and isinstance(layer, TiedLayerSpec):
            raise ValueError(f"tensor_plan gives {where} a plan, but it is a TiedLayerSpec: tied layers (the "
                             "embedding and the head that reuses it) stay replicated over the tensor group; "
                             "leave them out of the plan")
        if plan:
            check_tensor_plan(module, plan, degree, where)


def _recompute(recompute: RecomputeConfig | str | None, interval: int) -> RecomputeConfig:
    """The layers' checkpointing from `recompute`, or from the older activation_checkpoint_interval."""
    if recompute is not None and interval:
        raise ValueError(f"PipelineModule(recompute={recompute!r}, activation_checkpoint_interval={interval}): "
                         "pass one; RecomputeConfig(mode='full', interval=k) is the interval's meaning")
    if interval:
        return RecomputeConfig(mode="full", interval=interval)
    return RecomputeConfig.of(recompute)


def _check_args(layers: Sequence[Any], num_chunks: int, interval: int, placement: str, deferred_linear: bool) -> None:
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError(f"PipelineModule(layers={layers!r}): expected a non-empty list of "
                         "LayerSpec / TiedLayerSpec / nn.Module / callable")
    for i, layer in enumerate(layers):
        if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
            raise TypeError(f"layers[{i}]={layer!r} is neither a LayerSpec, an nn.Module nor a callable")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"PipelineModule(num_chunks={num_chunks!r}): expected a positive integer")
    if placement not in PLACEMENTS:
        raise ValueError(f"PipelineModule(placement={placement!r}): expected one of {PLACEMENTS}")
    if placement == "v" and num_chunks % 2:
        raise ValueError(f"PipelineModule(placement='v', num_chunks={num_chunks}): a V-shaped placement "
                         "pairs chunks down and back up, so num_chunks must be even (ZeroBubbleV uses 2)")
    if not isinstance(interval, int) or interval < 0:
        raise ValueError(f"activation_checkpoint_interval={interval!r}: expected 0 (off) or a positive integer")
    if not isinstance(deferred_linear, bool):
        raise TypeError(f"PipelineModule(deferred_linear={deferred_linear!r}): expected True or False")


def _tied_call(module: nn.Module, fn: Callable, key: str, x: Any) -> Any:
    """A tied layer's second use: `fn(module, x)` runs no module hooks, so a ZeRO-3 weight that the
    first use's hooks freed again arrives empty; name that instead of a matmul's size mismatch."""
    if any(p.numel() == 0 for p in module.parameters()):
        raise RuntimeError(f"tied layer {key!r}: its weights are partitioned (ZeRO-3) and a tied forward_fn "
                           "runs no stage-3 hook; run the model through PipelineRunner (train_step / eval_step), "
                           "or inside opt.gathered_parameters()")
    return fn(module, x)
