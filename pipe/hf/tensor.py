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
    after each (Shoeybi et al. 2019). Norms, embedding and head stay replicated. A family whose
    projections are not nn.Linear (GPT-2's Conv1D) is a ValueError on every rank.
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
        return out
    return plan
