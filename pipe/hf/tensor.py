"""hf_tensor_plan: Megatron-LM's tensor-parallel split of a Hugging Face decoder layer.

Split from pipe/hf/specs.py, which re-exports it (so it imports the layer class when called).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from pipezero.pipe.tensor_parallel import ColwiseHeads, TensorPlan

__all__ = ["hf_tensor_plan"]


def hf_tensor_plan() -> Callable[[nn.Module], TensorPlan | None]:
    """PipelineModule(tensor_plan=...) for HFDecoderLayers: Megatron-LM's split of attention and MLP.

    In the attention and the MLP every nn.Linear but the last (q/k/v, gate/up) is split
    column-wise, whole heads per tensor rank, and the last (o, down) row-wise: one all-reduce
    after each (Shoeybi et al. 2019). Norms, embedding and head stay replicated; a norm of each
    head (Qwen3's and Gemma 3's q_norm / k_norm) sees this rank's heads only, so its gradient is
    summed over the tensor group (ReplicateOnShards). A family whose projections are not
    nn.Linear (GPT-2's Conv1D) is a ValueError on every rank.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipezero.pipe.hf import HFDecoderLayer  # here: pipe/hf/specs.py re-exports this module's function

    def plan(layer: nn.Module) -> TensorPlan | None:
        if not isinstance(layer, HFDecoderLayer):
            return None
        out: dict[str, Any] = {}
        for name, child in layer.inner.named_children():
            projections = [(n, m) for n, m in child.named_children()
                           if "Norm" not in type(m).__name__ and any(True for _ in m.parameters())]
            if not projections:
                continue
            bad = [f"{name}.{n} ({type(m).__name__})" for n, m in projections if not isinstance(m, nn.Linear)]
            if bad:
                raise ValueError(f"hf_tensor_plan: {type(layer.inner).__name__} has projections {bad} that are not "
                                 "nn.Linear; torch's ColwiseParallel/RowwiseParallel shard nn.Linear, so train "
                                 "this family with tensor=1")
            head_dim = getattr(child, "head_dim", None)
            for n, m in projections[:-1]:
                out[f"inner.{name}.{n}"] = (ColwiseHeads(m.out_features // head_dim) if head_dim
                                            else ColwiseParallel())
            out[f"inner.{name}.{projections[-1][0]}"] = RowwiseParallel()
            out.update(_head_norms(layer, name, child, head_dim))
        return out
    return plan


def _head_norms(layer: nn.Module, name: str, child: nn.Module, head_dim: int | None) -> dict[str, Any]:
    """The plan's entries for `child`'s norms of each head: their gradients summed over the tensor group."""
    from pipezero.pipe.tensor_parallel import ReplicateOnShards

    out = {}
    for n, m in child.named_children():
        size = sum(p.numel() for p in m.parameters())
        if "Norm" not in type(m).__name__ or not size:
            continue
        if head_dim is not None and size == head_dim:
            out[f"inner.{name}.{n}"] = ReplicateOnShards()
    return out
