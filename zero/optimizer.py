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
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipezero.comm import all_gather, group_size, nvtx_range
from pipezero.topology import process_device
from pipezero.zero.config import ZeroConfig
from pipezero.zero.grad_sync import GradSync
from pipezero.zero.offload import HostOffload, host_copy
from pipezero.zero.partition import Bucket, plan_groups
from pipezero.zero.stage3 import ParamGatherer

__all__ = ["ZeroOptimizer", "ELEMENTWISE_OPTIMIZERS"]

# torch optimizers whose update of each element reads only that element's state and gradient
ELEMENTWISE_OPTIMIZERS = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD"))


def innermost(opt: Any) -> Any:
    """Follow `.inner` down the chain to the optimizer that holds the state."""
    seen = 0
    while hasattr(opt, "inner") and seen < 32:
        opt, seen = opt.inner, seen + 1
    return opt


class ZeroOptimizer(torch.optim.Optimizer):
    """Partition optimizer state (1), gradients (2) and parameters (3) over a data-parallel group.

    Stage 0 averages gradients only (like DDP) and keeps fp32 masters for low-precision models.
    Works on a plain nn.Module (gradients are reduced as they become ready, like DDP) and
    under a pipeline runner, which drives the readiness protocol (hold/release/flush).
    """

    def __init__(self, inner: Any, stage: int | None = None, group=None, module: nn.Module | None = None, *,
                 config: ZeroConfig | None = None, elementwise: bool = False):
        config = config or ZeroConfig()
        if stage is not None:
            config = replace(config, stage=stage)
        self.config, self.stage, self.inner, self.group = config, config.stage, inner, group
        self._check_inner(inner, elementwise)
        if self.stage == 3 and any(isinstance(p, DTensor) for g in inner.param_groups for p in g["params"]):
            raise ValueError("ZeroOptimizer(stage=3) does not take tensor-parallel (DTensor) parameters; use "
                             "stage 1 or 2 with a tensor degree > 1 (each tensor rank's slice is sharded over "
                             "the data group)")
        if self.stage == 3 and module is None:
            raise ValueError("ZeroOptimizer(stage=3) needs module=: the model whose submodules gather their "
                             "parameters before running (ZeroOptimizer(inner, stage=3, module=model))")
        # torch's Optimizer base (so LR schedulers accept us) is set up on a placeholder; from then
        # on param_groups and state are the inner chain's, read through (properties below)
        super().__init__([torch.empty(0)], {})
        self._linked = True
        self.defaults = getattr(inner, "defaults", {})
        self.world = group_size(group)
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        # the single-process layout (consolidated state): every group's original parameters, in order
        self.original_params: list[list[torch.Tensor]] = [list(g["params"]) for g in self.param_groups]
        parts = 1 if self.stage == 0 else self.world
        # a group of one has nothing to partition: stage 3 then keeps every parameter whole, unless
        # the parameters are offloaded (they then live on the host between uses)
        threshold = config.stage3_param_persistence_threshold if self.world > 1 or config.offload_param \
            else float("inf")
        self.buckets: list[Bucket] = plan_groups(
            self.param_groups, config.reduce_bucket_size, parts, self.rank if parts > 1 else 0,
            module if self.stage == 3 else None, threshold)
        self._check_same_layout()
        self._build(module)
        self.last_step_skipped = False

    @property
    def param_groups(self) -> list:
        """The inner chain's param_groups list itself, read on every access: torch's
        load_state_dict replaces that list, and a copy kept here would go stale after a resume."""
        return self.inner.param_groups if "_linked" in self.__dict__ else self.__dict__["_own_groups"]

    @param_groups.setter
    def param_groups(self, groups: list) -> None:
        if "_linked" in self.__dict__:
            self.inner.param_groups = groups
        else:  # torch's __init__ on the placeholder
            self.__dict__["_own_groups"] = groups

    @property
    def state(self) -> Any:
        """The torch optimizer's per-parameter state (over this rank's shards) itself."""
        return getattr(innermost(self.inner), "state", None) if "_linked" in self.__dict__ \
            else self.__dict__["_own_state"]

    @state.setter
    def state(self, state: Any) -> None:
        if "_linked" in self.__dict__:
            innermost(self.inner).state = state
        else:
            self.__dict__["_own_state"] = state

    # -- construction -------------------------------------------------------------------
    @staticmethod
    def _check_inner(inner: Any, elementwise: bool) -> None:
        if not hasattr(inner, "param_groups") or not hasattr(inner, "step"):
            raise TypeError(f"ZeroOptimizer wraps an optimizer (or a chain ending in one); got "
                            f"{type(inner).__name__}")
        core = innermost(inner)
        if not elementwise and not isinstance(core, ELEMENTWISE_OPTIMIZERS):
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise TypeError(f"ZeroOptimizer cannot shard {type(core).__name__}: its update may need whole tensors "
                            f"(per-tensor norms, as LAMB/LARS). Known element-wise optimizers: {names}. If its "
                            "update really is element-wise, pass elementwise=True")
        if getattr(core, "state", None):
            raise ValueError(f"{type(core).__name__} already has state: create the ZeroOptimizer before the "
                             "first step (load checkpoints with ZeroOptimizer.load_state_dict)")

    def _check_same_layout(self) -> None:
        """Every rank of the group must partition the same parameters, or collectives would hang."""
        if self.world == 1:
            return
        mine = torch.tensor([len(self.buckets), sum(b.numel for b in self.buckets),
                             sum((i + 1) * b.numel for i, b in enumerate(self.buckets))], dtype=torch.int64)
        device = process_device(self.group)
        everyone = torch.empty(3 * self.world, dtype=torch.int64, device=device)
        all_gather(everyone, mine.to(device), group=self.group)
        rows = everyone.view(self.world, 3).cpu().tolist()
        if any(row != rows[0] for row in rows):
            raise ValueError(f"ZeroOptimizer: the ranks of the group hold different parameters "
                             f"(per rank [buckets, elements, checksum]: {rows}); build the same model and "
                             "param groups on every data-parallel rank")

    def _build(self, module: nn.Module | None) -> None:
        cfg = self.config
        offload = torch.device("cpu") if cfg.offload_optimizer or cfg.offload_param else None
        for b in self.buckets:
            b.build(offload, keep_full=self.stage < 3 or b.persistent)
            if cfg.offload_param and not b.persistent:
                b.local = host_copy(b.local)  # uploaded to the compute device when the submodule runs
            dup = any(getattr(p, "pipezero_duplicate", False) for p in b.params)
            if dup or (self.stage == 0 and self.rank > 0):
                b.master.pipezero_duplicate = True
        for g, group in enumerate(self.param_groups):
            group["params"] = [b.master for b in self.buckets if b.group_index == g]
        self._gatherer = None
        if self.stage == 3:
            device = self.buckets[0].device if self.buckets else torch.device("cpu")
            self._gatherer = ParamGatherer(module, self.buckets, self.group, device,
                                           prefetch_numel=cfg.stage3_prefetch_bucket_size)
        done = self._gatherer.release if self._gatherer else None
        self._offload = HostOffload(self.buckets, innermost(self.inner), delayed=cfg.delayed_param_update) \
            if offload else None
        self._sync = GradSync(self.buckets, self.stage, self.group, on_backward_done=done,
                              overlap=self.config.overlap_comm,
                              every_microbatch=self.config.reduce_every_microbatch, sink=self._offload)

    @classmethod
    def from_config(cls, inner: Any, cfg: Mapping[str, Any], group=None, module: nn.Module | None = None,
                    hidden_size: int | None = None, elementwise: bool = False) -> "ZeroOptimizer":
        """Build from DeepSpeed's `zero_optimization` section ("auto" sizes from the hidden size)."""
        if hidden_size is None and module is not None:
            hidden_size = getattr(getattr(module, "config", None), "hidden_size", None)
        config = ZeroConfig.from_dict(cfg, hidden_size)
        return cls(inner, group=group, module=module, config=config, elementwise=elementwise)

    # -- the optimizer chain -------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.scale(loss) if hasattr(self.inner, "scale") else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scale(loss).backward()

    def step(self, closure=None) -> bool:
        """Reduce gradients into the shards, step the inner chain, gather the new parameters."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step(closure=...) is not supported: run forward/backward first")
        self.apply_delayed_update()
        if hasattr(self.inner, "prepare_grads"):
            self.inner.prepare_grads()
        self._sync.finish()
        if self._gatherer is not None:
            self._gatherer.release_all()
        with nvtx_range("optimizer.step"), self._offload.stepping(self._offload.start_upload) \
                if self._offload else nullcontext():
            stepped = self.inner.step() is not False
        self.last_step_skipped = not stepped
        self._sync.end_step()
        if stepped and not self.config.delayed_param_update:
            self._publish()
        return stepped

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
                handles.append(all_gather(b.flat, b.local.clone(), group=self.group, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients (always set to None: the flat buffers are zeroed, not freed, at stages 0-1)."""
        if self._offload is None or not self._offload.in_flight:  # a delayed update reads the masters' grads
            self.inner.zero_grad(set_to_none=True)
        self._sync.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "_sync"):      # torch's Optimizer.__init__ adds the placeholder group
            return super().add_param_group(param_group)
        raise ValueError("ZeroOptimizer.add_param_group: the partition is fixed when the ZeroOptimizer is "
                         "built; put every param group into the inner optimizer before wrapping it")

    # -- the readiness protocol -------------------------------------------------------------
    def no_sync(self):
        """Context: backward passes inside accumulate gradients locally, without reduction."""
        return self._sync.no_sync()

    def hold_grad_sync(self, params: Iterable[torch.Tensor]) -> None:
        self._sync.hold(params)

    def release_grad_sync(self, params: Iterable[torch.Tensor]) -> None:
        self._sync.release(params)

    def flush_grad_sync(self, params: Iterable[torch.Tensor]) -> None:
        self._sync.flush(params)

    def collect_grad_sync(self, params: Iterable[torch.Tensor]) -> None:
        """A micro-batch's gradients of these params were assigned without autograd hooks (torch's
        split weight backward): with reduce_every_microbatch, reduce them now; else a no-op."""
        self._sync.collect(params)

    def wait_grad_sync(self) -> None:
        """Wait for the reductions launched so far (step() does this itself; for measuring)."""
        self._sync.wait()

    # -- stage 3 ---------------------------------------------------------------------------
    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Every model parameter whole inside the block (stage 3); a no-op for stages 0-2."""
        with self._gatherer.gathered() if self._gatherer else nullcontext():
            yield

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state (a delayed update in flight is applied first)."""
        from pipezero.zero.state import local_state_dict
        self.apply_delayed_update()
        return local_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        from pipezero.zero.state import load_local_state_dict
        self.apply_delayed_update()
        load_local_state_dict(self, state)

    def __repr__(self) -> str:
        own = type(self.inner).__repr__
        plain = own is torch.optim.Optimizer.__repr__ or own is object.__repr__
        return f"ZeroOptimizer(stage={self.stage}, {type(self.inner).__name__ if plain else repr(self.inner)})"

