"""What the pipeline runner tells the optimizer: gradient readiness, and the loss scale.

The runner runs many microbatches' backward passes before the optimizer steps. An optimizer
that reduces gradients over the data group (ZeroOptimizer) wants to know when a parameter's
gradient is final, so that it reduces it once, overlapping the pipeline's cool-down, rather
than once per microbatch (the `no_sync` contract DDP uses). The runner is the side that knows,
so the protocol is written down here, and resolved once when the runner is built: the link of
the optimizer chain that implements it, or a no-op for a plain torch optimizer.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from pipezero.comm import links

__all__ = ["GradReadiness", "LossScaling", "find_link", "grad_readiness", "loss_scaling"]


@runtime_checkable
class GradReadiness(Protocol):
    """An optimizer that reduces gradients and listens to the runner.

    Per train_step: `hold_grad_sync(all params)` before the first backward; for each group of
    parameters whose last backward is about to run, `release_grad_sync(params)`, then after it
    `flush_grad_sync(params)` (reduce whatever of theirs is not yet reduced); tied weights are
    released and flushed last, after their gradients were summed over the tie group.
    `collect_grad_sync(params)` follows each split weight backward, which assigns `.grad`
    without the autograd hooks the optimizer listens to.
    """

    def check_pipeline(self) -> None:
        """Raise ValueError when this optimizer cannot run under the pipeline runner (says why and the fix)."""

    def hold_grad_sync(self, params: Sequence[torch.Tensor]) -> None: ...

    def release_grad_sync(self, params: Sequence[torch.Tensor]) -> None: ...

    def flush_grad_sync(self, params: Sequence[torch.Tensor]) -> None: ...

    def collect_grad_sync(self, params: Sequence[torch.Tensor]) -> None: ...


@runtime_checkable
class LossScaling(Protocol):
    """An optimizer whose backward starts from `scale(loss)` (a LossScaler, or a chain holding one)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...


class _NoReadiness:
    """Listens to nothing: a plain torch optimizer, or no optimizer."""

    def check_pipeline(self) -> None:
        """Nothing to refuse."""

    def hold_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to hold."""

    def release_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to release."""

    def flush_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to flush."""

    def collect_grad_sync(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to collect."""


def find_link(optimizer: Any, protocol: type) -> Any:
    """The outermost member of the optimizer chain that implements `protocol`, or None."""
    chain = [optimizer, *(link.inner for link in links(optimizer))]
    return next((link for link in chain if isinstance(link, protocol)), None)


def grad_readiness(optimizer: Any) -> GradReadiness:
    """The link of the optimizer chain that implements GradReadiness (checked), else a no-op."""
    link = find_link(optimizer, GradReadiness)
    if link is None:
        return _NoReadiness()
    link.check_pipeline()
    return link


def loss_scaling(optimizer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The optimizer's `scale(loss)`, or the identity when it scales nothing."""
    if isinstance(optimizer, LossScaling):
        return optimizer.scale
    return _unscaled


def _unscaled(loss: torch.Tensor) -> torch.Tensor:
    return loss
