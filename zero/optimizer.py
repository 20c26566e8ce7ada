"""ZeroOptimizer: ZeRO stages 0-3 as one wrapper in the optimizer chain.

The wrapper shares its inner optimizer's `param_groups` list and replaces each group's
parameters by fp32 shards (one per bucket, see partition.py), so every optimizer inside the
chain (a LossScaler, Adam) only ever sees and keeps state for this rank's slice.
`step()` = finish the gradient reductions (mostly done during backward), `inner.step()`,
then, unless the inner chain skipped the step, all-gather the updated parameters.
ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipezero.comm import all_gather, group_size, mark_replica, nvtx_range
from pipezero.chain import ChainWrapper, describe, innermost, links
from pipezero.topology import process_device
from pipezero.zero.config import ZeroConfig
from pipezero.zero.grad_strategies import make_grad_sync
from pipezero.zero.offload import HostOffload, host_copy
from pipezero.zero.partition import Bucket, plan_groups
from pipezero.zero.reduction import check_partial_grads, counted_elsewhere, take_reductions
from pipezero.zero.stage3 import ParamGatherer
from pipezero.zero.unused import UnusedParams
from pipezero.zero import state as _state

__all__ = ["ZeroOptimizer", "ELEMENTWISE_OPTIMIZERS"]

# torch optimizers whose update of each element reads only that element's state and gradient
ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD"))


def _set_grad_dtypes(buckets: list[Bucket], config: ZeroConfig) -> None:
    """Every bucket sums its gradients in grad_accum_dtype (None: its parameters' own), never in a
    narrower one, and reduces them in reduce_dtype."""
    dtype = config.grad_accum_dtype
    for b in buckets:
        b.reduce_dtype = config.reduce_dtype or b.reduce_dtype
        if dtype is None or dtype == b.dtype:
            continue
        if dtype != torch.float32:
            raise ValueError(f"ZeroConfig(grad_accum_dtype={dtype}) is narrower than, or not comparable with, "
                             f"parameters of dtype {b.dtype} ({b.params[0].shape}): every gradient would be "
                             "rounded; use torch.float32 or None (the parameters' dtype)")
        b.grad_dtype = dtype


class ZeroOptimizer(ChainWrapper):
    """Partition optimizer state (1), gradients (2) and parameters (3) over a data-parallel group.

    Stage 0 averages gradients only (like DDP) and keeps fp32 masters for low-precision models.
    Works on a plain nn.Module (gradients are reduced as they become ready, like DDP) and
    under a pipeline runner, whose step events (pipe/readiness.py's StepListener) it implements.
    It is the outermost link of its chain (`ZeroOptimizer(LossScaler(Adam(...)), stage=2,
    group=...)`): the links inside see only reduced gradients of this rank's shards; wrapping
    it (`LossScaler(ZeroOptimizer(...))`) is refused at construction.
    """

    outermost = True  # chain.py: no link wraps it

    def __init__(self, inner: Any, stage: int | None = None, group=None, module: nn.Module | None = None, *,
                 config: ZeroConfig | None = None, elementwise: bool = False):
        config = config or ZeroConfig()
        if stage is not None:
            config = replace(config, stage=stage)
        self.config, self.stage, self.group = config, config.stage, group
        self._check_inner(inner, elementwise)
        if self.stage == 3 and any(isinstance(p, DTensor) for g in inner.param_groups for p in g["params"]):
            raise ValueError("ZeroOptimizer(stage=3) does not take tensor-parallel DTensor parameters (styles "
                             "other than plain ColwiseParallel / RowwiseParallel on an nn.Linear, e.g. "
                             "lora_tensor_plan's); use stage 1 or 2 with a tensor degree > 1 (each tensor rank's "
                             "slice is sharded over the data group)")
        if self.stage == 3 and module is None:
            raise ValueError("ZeroOptimizer(stage=3) needs module=: the model whose submodules gather their "
                             "parameters before running (ZeroOptimizer(inner, stage=3, module=model))")
        super().__init__(inner)  # shares the inner chain's param_groups list and state
        self.world = group_size(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self._ranks = _global_ranks(group)
        # the single-process layout (consolidated state): every group's original parameters, in order
        self.original_params: list[list[torch.Tensor]] = [list(g["params"]) for g in self.param_groups]
        # a param group may reduce over a group of its own (reduction.py: expert parameters)
        self.reductions = take_reductions(self.param_groups, group)
        check_partial_grads(self.param_groups, self.reductions)  # a token-split MoE block's: over its tensor ranks
        # a group of one has nothing to partition: stage 3 then keeps its parameters whole, unless
        # the parameters are offloaded (they then live on the host between uses)
        thresholds = [config.stage3_param_persistence_threshold if r.size > 1 or config.offload_param
                      else float("inf") for r in self.reductions]
        self.buckets: list[Bucket] = plan_groups(
            self.param_groups, config.reduce_bucket_size, self.reductions, self.stage > 0,
            module if self.stage == 3 else None, thresholds)
        _set_grad_dtypes(self.buckets, config)
        self._check_same_layout()
        self._build(module)
        self._reduced = False        # the user called prepare_grads() since the last step

    # -- construction -------------------------------------------------------------------
    @staticmethod
    def _check_inner(inner: Any, elementwise: bool) -> None:
        if not hasattr(inner, "param_groups") or not hasattr(inner, "step"):
            raise TypeError(f"ZeroOptimizer wraps an optimizer (or a chain ending in one); got "
                            f"{type(inner).__name__}")
        copying = next((link for link in links(inner) if link.holds_copies), None)
        if copying is not None:
            raise TypeError(f"ZeroOptimizer({describe(inner)}): {type(copying).__name__}'s param_groups hold copies "
                            "of the model's parameters, so ZeroOptimizer would reduce no gradient (each rank "
                            "would step on its own); ZeroOptimizer keeps fp32 masters of its shards itself: drop "
                            f"{type(copying).__name__}, e.g. ZeroOptimizer(LossScaler(torch.optim.Adam(...)), stage=...)")
        core = innermost(inner)
        if not elementwise and not isinstance(core, ELEMENTWISE_OPTIMIZERS):
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise TypeError(f"ZeroOptimizer cannot shard {type(core).__name__}: its update may need whole tensors "
                            f"(per-tensor norms, as LAMB/LARS). Known element-wise optimizers: {names}. If its "
                            "update really is element-wise, pass elementwise=True")
        if _state.has_stepped(core):
            raise ValueError(f"{type(core).__name__} already has state: create the ZeroOptimizer before the "
                             "first step (load checkpoints with ZeroOptimizer.load_state_dict)")

    def _check_same_layout(self) -> None:
        """Every rank of each reduction group must partition the same parameters, or collectives would hang."""
        for reduction, buckets in _by_reduction(self.reductions, self.buckets):
            if reduction.size == 1:
                continue
            mine = torch.tensor([len(buckets), sum(b.numel for b in buckets),
                                 sum((i + 1) * b.numel for i, b in enumerate(buckets))], dtype=torch.int64)
            device = process_device(reduction.group)
            everyone = torch.empty(3 * reduction.size, dtype=torch.int64, device=device)
            all_gather(everyone, mine.to(device), group=reduction.group)
            rows = everyone.view(reduction.size, 3).cpu().tolist()
            if any(row != rows[0] for row in rows):
                raise ValueError(f"ZeroOptimizer: the ranks of a reduction group hold different parameters "
                                 f"(per rank [buckets, elements, checksum]: {rows}); build the same model and "
                                 "param groups on every data-parallel rank (and the same experts on the ranks "
                                 "of each param group's zero_group)")

    def _build(self, module: nn.Module | None) -> None:
        cfg = self.config
        offload = torch.device("cpu") if cfg.offload_optimizer or cfg.offload_param else None
        for b in self.buckets:
            b.build(offload, keep_full=self.stage < 3 or b.persistent)
            if cfg.offload_param and not b.persistent:
                b.local = host_copy(b.local)  # uploaded to the compute device when the submodule runs
            copies = any(counted_elsewhere(p, b.reduction) for p in b.params)  # reduction.py: a partial one's not
            if copies or (self.stage == 0 and b.reduction.rank > 0):
                mark_replica(b.master)
        for g, group in enumerate(self.param_groups):
            group["params"] = [b.master for b in self.buckets if b.group_index == g]
        _state.adopt_initial_state(self)  # e.g. Adagrad's accumulators, made in its __init__
        self._gatherer = None
        if self.stage == 3:
            device = self.buckets[0].device if self.buckets else torch.device("cpu")
            self._gatherer = ParamGatherer(module, self.buckets, device,
                                           prefetch_numel=cfg.stage3_prefetch_bucket_size)
        done = self._gatherer.backward_done if self._gatherer else None
        self._offload = HostOffload(self.buckets, innermost(self.inner), delayed=cfg.delayed_param_update) \
            if offload else None
        self._sync = make_grad_sync(self.buckets, self.stage, on_backward_done=done,
                                    overlap=self.config.overlap_comm,
                                    every_microbatch=self._reduce_every_microbatch(), sink=self._offload)
        self._unused = UnusedParams(self.buckets)

    def _reduce_every_microbatch(self) -> bool:
        """Stages 2-3 summing in a wider dtype reduce every micro-batch: a held whole .grad would sum in
        the model dtype (see ZeroConfig.grad_accum_dtype)."""
        wider = any(b.grad_dtype != b.dtype for b in self.buckets)
        return self.config.reduce_every_microbatch or (self.stage >= 2 and wider)

    @classmethod
    def from_config(cls, inner: Any, cfg: Mapping[str, Any], group=None, module: nn.Module | None = None,
                    hidden_size: int | None = None, elementwise: bool = False) -> "ZeroOptimizer":
        """Build from DeepSpeed's `zero_optimization` section ("auto" sizes from the hidden size)."""
        if hidden_size is None and module is not None:
            hidden_size = getattr(getattr(module, "config", None), "hidden_size", None)
        config = ZeroConfig.from_dict(cfg, hidden_size)
        return cls(inner, group=group, module=module, config=config, elementwise=elementwise)

    # -- the optimizer chain -------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Finish the reductions now: every master shard gets its reduced .grad (fp32).

        step() does it itself; call it to read the reduced gradients before stepping (step()
        then reduces nothing twice). The links inside prepare their own in their step.
        """
        self._reduce()
        self._reduced = True

    def _reduce(self) -> None:
        self.apply_delayed_update()
        self._unused.find(late_grads=self.stage > 0)
        self._sync.finish()
        self._unused.drop_grads()  # torch steps no parameter without a gradient
        if self._gatherer is not None:
            self._gatherer.release_all()

    def step(self, closure=None) -> bool:
        """Reduce gradients into the shards, step the inner chain, gather the new parameters."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step(closure=...) is not supported: run forward/backward first")
        if not self._reduced:
            with self._streaming():
                self._reduce()
        with nvtx_range("optimizer.step"), self._offload.stepping(self._offload.start_upload) \
                if self._offload else nullcontext():
            kept = self._unused.keep(innermost(self.inner)) if self._may_restore() else []
            stepped = self.inner.step() is not False
            for b in self._unused.restore(innermost(self.inner), kept):
                if self._offload is not None:  # it uploaded the stepped slice already
                    self._offload.start_upload(b)
        self.last_step_skipped = not stepped
        self._reduced = False
        self._unused.clear()
        self._sync.end_step()
        if stepped and not self.config.delayed_param_update:
            self._publish()
        return stepped

    def _may_restore(self) -> bool:
        """Unused elements of a partly used bucket can be put back unless the update runs in the background."""
        return not (self._offload is not None and self.config.delayed_param_update)

    def _streaming(self):
        """Offloaded, with torch's optimizer right inside: nothing reads the gradients before it
        steps them, so each bucket may step as soon as its own gradient has reached the host."""
        if self._offload is None or self.inner is not innermost(self.inner):
            return nullcontext()
        return self._offload.streaming()

    def apply_delayed_update(self) -> None:
        """With delayed_param_update: wait for the update still being computed and publish it now.

        step() does this first; call it at the end of training. A no-op otherwise.
        """
        if self._offload is None or not self._offload.in_flight:
            return
        if self._gatherer is not None:
            self._gatherer.wait_uploads()     # the update writes the host slices they read
        self._offload.settle(self._offload.start_upload)
        self._publish()

    def _publish(self) -> None:
        """Copy masters into the model slices and all-gather the buckets that are kept whole."""
        handles = []
        for b in self.buckets:
            if self._offload is None:
                b.publish_master()
            else:  # the offload uploaded it while the next bucket stepped
                self._offload.wait_upload(b)
            if b.flat is not None and b.parts > 1:
                handles.append(all_gather(b.flat, b.local.clone(), group=b.group, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients (always set to None: the flat buffers are zeroed, not freed, at stages 0-1)."""
        if self._offload is None or not self._offload.in_flight:  # a delayed update reads the masters' grads
            self.inner.zero_grad(set_to_none=True)
        self._sync.zero_grad()
        self._unused.clear()
        self._reduced = False

    def add_param_group(self, param_group: dict) -> None:
        """Refused: the partition is fixed at construction."""
        if "inner" not in self.__dict__:      # torch's Optimizer.__init__ adds the placeholder group
            return super().add_param_group(param_group)
        raise ValueError("ZeroOptimizer.add_param_group: the partition is fixed when the ZeroOptimizer is "
                         "built; put every param group into the inner optimizer before wrapping it")

    # -- the pipeline step's events (pipe/readiness.py's StepListener) -------------------------
    def attach_pipeline(self) -> None:
        """A pipeline runner drives from now on: stage 3's module hooks stand down (the runner
        says which chunk's parameters are needed when: need_params / done_with_params)."""
        if self._gatherer is not None:
            self._gatherer.drive()

    def no_sync(self):
        """Context: backward passes inside accumulate gradients locally, without reduction."""
        return self._sync.no_sync()

    def hold_grad_sync(self, params: Iterable[torch.Tensor], tied: Iterable[torch.Tensor] = ()) -> None:
        """Backward passes leave these params' gradients unreduced until released; `tied` ones'
        .grad stay exactly as autograd accumulates them (the caller adds to them) and, at stage
        3, whole until step_done."""
        tied = list(tied)
        self._sync.hold(params, intact=tied)
        if tied:
            self.gather_params(tied)

    def tied_grad_sums(self, tied: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The held-intact tied gradients summed in a wider grad_accum_dtype than the model's, by id
        (each micro-batch's .grad was added in as it arrived); the runner adds them up over the tie group."""
        return self._sync.tied_sums(tied)

    def release_grad_sync(self, params: Iterable[torch.Tensor]) -> None:
        """The next backward completes these params' gradients: reduce them as they become ready."""
        self._sync.release(params)

    def flush_grad_sync(self, params: Iterable[torch.Tensor]) -> None:
        """Reduce what of these params' gradients is not yet reduced (their last backward is done)."""
        params = list(params)
        self._unused.mark(params, always=self.stage == 0)  # stage 0's .grad views the buffer: cannot tell
        self._sync.flush(params)

    def collect_grad_sync(self, params: Iterable[torch.Tensor]) -> None:
        """A micro-batch's gradients of these params were assigned without autograd hooks (torch's
        split weight backward): as a hook would, reduce them now (reduce_every_microbatch) or add them
        into the stage 0-1 buffer (in its grad_dtype); else a no-op."""
        params = list(params)
        self._unused.mark(params, always=self.stage == 0)
        self._sync.collect(params)

    def need_params(self, params: Sequence[torch.Tensor], upcoming: Sequence[torch.Tensor] = ()) -> None:
        """Stage 3: these parameters whole now (waits), the all-gathers of `upcoming` started."""
        self.gather_params(params)
        if upcoming:
            self.gather_params(upcoming, wait=False)

    def done_with_params(self, params: Sequence[torch.Tensor]) -> None:
        """Stage 3: partition these parameters again (tied ones stay whole until step_done)."""
        self.release_params(params)

    def reduction_ranks(self) -> tuple[int, ...]:
        """The global ranks of `group`, ascending: those it reduces gradients and partitions over."""
        return self._ranks

    def step_done(self) -> None:
        """Stage 3: the step's actions are over, every parameter partitioned again."""
        if self._gatherer is not None:
            self._gatherer.release_driven()

    def wait_grad_sync(self) -> None:
        """Wait for the reductions launched so far (step() does this itself; for measuring)."""
        self._sync.wait()

    # -- stage 3 ---------------------------------------------------------------------------
    def gathered_numel(self) -> int:
        """Stage 3: elements of partitioned parameters whole on the device now (gathered, or their
        all-gathers on the way); 0 at stages 0-2. What the planner's ZeRO-3 memory counts."""
        return self._gatherer.resident_numel() if self._gatherer is not None else 0

    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Every model parameter whole inside the block (stage 3); a no-op for stages 0-2."""
        with self._gatherer.gathered() if self._gatherer else nullcontext():
            yield

    def drive_param_gathering(self) -> bool:
        """Deprecated: attach_pipeline(). True when something is partitioned (stage 3)."""
        self.attach_pipeline()
        return self._gatherer is not None

    def gather_params(self, params: Iterable[torch.Tensor], wait: bool = True) -> None:
        """Stage 3: make these parameters whole (wait=False: start the all-gathers, a prefetch)."""
        if self._gatherer is not None:
            self._gatherer.gather_params(params, wait)

    def release_params(self, params: Iterable[torch.Tensor]) -> None:
        """Stage 3: partition these parameters again (their buckets, when every member is listed)."""
        if self._gatherer is not None:
            self._gatherer.release_params(params)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state (a delayed update in flight is applied first)."""
        self.apply_delayed_update()
        return super().state_dict()

    def link_state_dict(self) -> dict:
        """{"zero": the layout (stage, group size, rank, buckets)}: the inner chain's state is this
        rank's shards, loadable only onto the same layout (consolidated_state_dict moves between them)."""
        return {"zero": _state.layout(self)}

    def _load_link(self, state: Mapping[str, Any]) -> None:
        """Refuse a per-rank state saved on another layout."""
        _state.check_layout(self, state["zero"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load what state_dict() (same layout) or consolidated_state_dict() (any layout) returned."""
        if isinstance(state, Mapping) and "consolidated" in state:
            self.apply_delayed_update()
            _state.load_consolidated_state_dict(self, state)
            return
        self.apply_delayed_update()
        super().load_state_dict(state)
        _state.restore_masters(self)

    def consolidated_state_dict(self) -> dict:
        """The innermost optimizer's state as one process would hold it (loads onto any layout); a collective."""
        self.apply_delayed_update()
        return _state.consolidated_state_dict(self)

    def full_parameters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its whole fp32 master) for each parameter this optimizer owns; a collective."""
        self.apply_delayed_update()
        return _state.full_parameters(self)

    def full_shapes(self) -> dict[int, torch.Size]:
        """id(parameter) -> its whole shape for each owned parameter, also while stage 3 has released it."""
        return _state.full_shapes(self)

    def load_full_parameters(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Set each owned parameter (model copy and master) to value_of(parameter), e.g. from a checkpoint by name."""
        _state.load_full_parameters(self, value_of)

    def per_parameter_state(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, its whole optimizer state) for each parameter that has state; a collective."""
        self.apply_delayed_update()
        return _state.per_parameter_state(self)

    def load_per_parameter_state(self, state_of: Callable[[torch.Tensor], dict[str, Any] | None]) -> None:
        """Load each parameter's whole optimizer state from state_of(parameter); every rank keeps its shard."""
        _state.load_per_parameter_state(self, state_of)

    @property
    def gatherer(self) -> ParamGatherer | None:
        """Stage 3's parameter gatherer (gathers submodules' parameters before they run); None at stages 0-2."""
        return self._gatherer

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.stage}, {describe(self.inner)})"


def _by_reduction(reductions: list, buckets: list[Bucket]) -> list[tuple[Any, list[Bucket]]]:
    """Each distinct reduction (param groups sharing one count once, in param-group order) with its buckets."""
    out: dict[int, tuple[Any, list[Bucket]]] = {}
    for r in reductions:
        out.setdefault(id(r.group), (r, []))
    for b in buckets:
        out[id(b.group)][1].append(b)
    return list(out.values())


def _global_ranks(group) -> tuple[int, ...]:
    """The global ranks of a process group (the world when None), ascending; (0,) without a process group."""
    if not dist.is_initialized():
        return (0,)
    return tuple(sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)))
