"""The one runtime contract of a pipeline step: what the executor tells the optimizer, in order.

The runner runs many microbatches' backward passes before the optimizer steps, and only it
knows, from the schedule, when a chunk's parameters are needed and when a parameter's
gradient is final. An optimizer that reduces gradients over the data group or partitions
parameters (ZeroOptimizer, every stage) listens, so that it reduces each gradient once,
overlapping the pipeline's cool-down (DDP's `no_sync` contract), and gathers each chunk just
in time (ZeRO-3). pipe/ emits these events, so the protocol is written down here;
zero/optimizer.py implements it once. A plain torch optimizer listens to nothing.

Who owns what: the executor says *when* (read off the schedule: pipe/step_plan.py for
gradients, pipe/gathering.py for parameters, `reshard_after_forward` being its memory
choice); the listener owns *how*: buckets, reductions, what is partitioned, that tied
weights stay whole through a step, that its own module hooks stand down while an executor
drives. The executor edits exactly one thing the listener also sees: the `.grad` of tied
weights, which it sums over their tie group after the last action; the listener keeps those
`.grad` intact until they are released.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from pipezero.chain import links

__all__ = ["StepListener", "GradReadiness", "LossScaling", "find_link", "step_listener", "grad_readiness",
           "loss_scaling"]


@runtime_checkable
class StepListener(Protocol):
    """The events of one runner, in the order it emits them.

    Once, when the runner is built: `reduction_ranks()` (asked, before any collective: the runner
    refuses a listener whose ranks are not the grid's data x sequence group), then `attach_pipeline()`.
    Per train_step: `hold_grad_sync(params, tied)` before the first action; then per action
    `release_grad_sync(final)` (when its backward completes those gradients), `need_params(
    params, upcoming)`, the action, `collect_grad_sync(params)` (after a split weight backward
    W, which assigns `.grad` without autograd's hooks), `flush_grad_sync(final)`,
    `done_with_params(params)` (when the plan frees the chunk); after the last action
    `tied_grad_sums(tied)`, the tied gradients summed over their tie group, then
    `release_grad_sync(tied)`, `flush_grad_sync(tied)`, and `step_done()`.
    Per eval_step: per action `need_params` / `done_with_params`, then `step_done()`.
    """

    def reduction_ranks(self) -> tuple[int, ...]:
        """The global ranks this listener reduces gradients over (and partitions state over), ascending;
        empty when it reduces nothing. The runner compares them with the grid's data x sequence group:
        a listener over the data axis alone on a grid with a sequence axis would let the sequence ranks
        step on different gradients and drift apart, silently."""

    def attach_pipeline(self) -> None:
        """A runner drives from now on: it says when parameters are needed (need_params)."""

    def hold_grad_sync(self, params: Sequence[torch.Tensor], tied: Sequence[torch.Tensor] = ()) -> None:
        """Reduce none of `params`' gradients until released. `tied`: the executor adds to their
        `.grad` after the last action, so leave it exactly as autograd accumulates it (not moved,
        pushed or reduced) until released, and keep them whole through the step."""

    def release_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """The next backward completes these gradients: reduce them as they become ready."""

    def tied_grad_sums(self, tied: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """After the last action: the gradients of `tied` that the listener sums itself, in a wider
        dtype than `.grad` can hold (ZeroConfig.grad_accum_dtype), by id. The executor adds them
        up over the tie group in place, as it does the other tied `.grad`; the listener reduces
        them when released. Empty: every tied gradient is its `.grad`."""

    def need_params(self, params: Sequence[torch.Tensor], upcoming: Sequence[torch.Tensor] = ()) -> None:
        """The next action runs on `params`: whole now. `upcoming`: the next other chunk's, soon."""

    def collect_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """These `.grad` were assigned without autograd's hooks (a split weight backward)."""

    def flush_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Their last backward is done: reduce whatever of theirs is not reduced yet."""

    def done_with_params(self, params: Sequence[torch.Tensor]) -> None:
        """No action needs `params` until the next need_params (they may be partitioned again)."""

    def step_done(self) -> None:
        """The step's actions are over: nothing needs any parameter whole any more."""


GradReadiness = StepListener  # the name before the gathering events joined it (kept for imports)


@runtime_checkable
class LossScaling(Protocol):
    """An optimizer whose backward starts from `scale(loss)` (a LossScaler, or a chain holding one)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...


class _NoReadiness:
    """Listens to nothing: a plain torch optimizer, or no optimizer."""

    def reduction_ranks(self) -> tuple[int, ...]:
        """Reduces nothing."""
        return ()

    def attach_pipeline(self) -> None:
        """Nothing to attach."""

    def hold_grad_sync(self, params: Sequence[torch.Tensor], tied: Sequence[torch.Tensor] = ()) -> None:
        """Nothing to hold."""

    def release_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to release."""

    def tied_grad_sums(self, tied: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every tied gradient is its `.grad`."""
        return {}

    def need_params(self, params: Sequence[torch.Tensor], upcoming: Sequence[torch.Tensor] = ()) -> None:
        """Parameters are always whole."""

    def collect_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to collect."""

    def flush_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to flush."""

    def done_with_params(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to partition."""

    def step_done(self) -> None:
        """Nothing to partition."""


def find_link(optimizer: Any, protocol: type) -> Any:
    """The outermost member of the optimizer chain that implements `protocol`, or None."""
    chain = [optimizer, *(link.inner for link in links(optimizer))]
    return next((link for link in chain if isinstance(link, protocol)), None)


def step_listener(optimizer: Any) -> StepListener:
    """The optimizer when it listens to the runner, else a no-op listener.

    Only the outermost link is asked: a link that reduces or partitions (ZeroOptimizer) is the
    outermost of its chain by the chain's one order (chain.py), so none sits further in.
    """
    return optimizer if isinstance(optimizer, StepListener) else _NoReadiness()


grad_readiness = step_listener  # the name before the gathering events joined it (kept for imports)


def loss_scaling(optimizer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The optimizer's `scale(loss)`, or the identity when it scales nothing."""
    if isinstance(optimizer, LossScaling):
        return optimizer.scale
    return _unscaled


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    return loss
