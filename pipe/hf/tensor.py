"""hf_tensor_plan: Megatron-LM's tensor-parallel split of a Hugging Face decoder layer.

Split from pipe/hf/specs.py, which re-exports it; it reads the layer class of pipe/hf/layers.py.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from pipezero.pipe.hf.layers import HFDecoderLayer
from pipezero.pipe.tensor_parallel import ColwiseHeads, TensorPlan
from pipezero.pipe.tensor_tokens import SplitTokens

__all__ = ["hf_tensor_plan"]


def hf_tensor_plan() -> Callable[[nn.Module], TensorPlan | None]:
    """PipelineModule(tensor_plan=...) for HFDecoderLayers: Megatron-LM's split of attention and MLP.

    In the attention and the MLP every nn.Linear but the last (q/k/v, gate/up) is split
    column-wise, whole heads per tensor rank, and the last (o, down) row-wise: one all-reduce
    after each (Shoeybi et al. 2019). Norms, embedding and head stay replicated; a norm of each
    head (Qwen3's and Gemma 3's q_norm / k_norm) sees this rank's heads only, so its gradient is
    summed over the tensor group (ReplicateOnShards). A MoE block (a child holding stacked
    `experts`: Qwen3-MoE, Mixtral, Qwen2-MoE, Llama 4) is not split by weights but by tokens: each
    tensor rank routes and computes its share of the rows, whole experts (or dispatched over an
    expert axis), the outputs gathered back (SplitTokens, pipe/tensor_tokens.py; Megatron-core's
    layout). A family whose projections are not nn.Linear (GPT-2's Conv1D), whose attention holds
    parameters of its own beside its projections (gpt-oss' per-head sinks), whose last projection
    is not the output or whose fused projection a split would cut across its parts (Phi-3's qkv_proj
    and gate_up_proj, Falcon's query_key_value), or whose norms span heads (OLMo 2/3's and OLMoE's
    q_norm over all heads, DeepSeek's latent norms) is a ValueError on every rank, as the split
    would be wrong.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def plan(layer: nn.Module) -> TensorPlan | None:
        if not isinstance(layer, HFDecoderLayer):
            return None
        out: dict[str, Any] = {}
        for name, child in layer.inner.named_children():
            if _is_moe(child):
                out[f"inner.{name}"] = SplitTokens()
                continue
            projections = [(n, m) for n, m in child.named_children()
                           if "Norm" not in type(m).__name__ and any(True for _ in m.parameters())]
            if not projections:
                continue
            bad = [f"{name}.{n} ({type(m).__name__})" for n, m in projections if not isinstance(m, nn.Linear)]
            if bad:
                raise ValueError(f"hf_tensor_plan: {type(layer.inner).__name__} has projections {bad} that are not "
                                 "nn.Linear; torch's ColwiseParallel/RowwiseParallel shard nn.Linear, so train "
                                 "this family with tensor=1")
            head_dim = getattr(child, "head_dim", None) or getattr(child, "head_size", None)  # GPT-NeoX: head_size
            for n, m in projections[:-1]:
                out[f"inner.{name}.{n}"] = (ColwiseHeads(_heads(child, m, projections[-1][1], head_dim))
                                            if head_dim else ColwiseParallel())
            out[f"inner.{name}.{projections[-1][0]}"] = RowwiseParallel()
            out.update(_checked_norms(layer, name, child, head_dim))
        return out
    return plan


def _is_moe(child: nn.Module) -> bool:
    """A MoE block: an `experts` child whose parameters are stacked, one slice per expert (as
    shard_experts finds them, pipe/expert/block.py)."""
    experts = dict(child.named_children()).get("experts")
    return experts is not None and any(p.dim() == 3 for p in experts.parameters(recurse=False))


# fused projections laid out head by head and read back with the local head count: a split keeps whole heads
_HEADWISE_FUSED = {"GPTNeoXAttention"}


def _heads(child: nn.Module, projection: nn.Linear, last: nn.Linear, head_dim: int) -> int:
    """The heads a column-parallel projection holds, the unit a tensor rank takes whole: its width over
    head_dim, or for a fused head-by-head q/k/v (GPT-NeoX) the attention's heads, each its q, k and v."""
    if type(child).__name__ in _HEADWISE_FUSED:
        return last.in_features // head_dim
    return projection.out_features // head_dim


def _checked_norms(layer: nn.Module, name: str, child: nn.Module, head_dim: int | None) -> dict[str, Any]:
    """The plan's entries for `child`'s norms; ValueError where a column/row split of `child` is not its math."""
    from pipezero.pipe.tensor_parallel import ReplicateOnShards

    projections = [(n, m) for n, m in child.named_children() if isinstance(m, nn.Linear)]
    *columns, (last, row) = projections
    where = f"hf_tensor_plan: {type(layer.inner).__name__}.{name}"
    wrong = [f"{n} (in_features={m.in_features})" for n, m in columns if m.in_features != row.out_features]
    if wrong:
        raise ValueError(f"{where}: {wrong} do not read the width {row.out_features} that its last projection "
                         f"{last} returns (projections in another order, or chained through a latent), which a "
                         "column/row split does not fit, so train this family with tensor=1")
    if type(child).__name__ not in _HEADWISE_FUSED and all(m.out_features != row.in_features for _, m in columns):
        raise ValueError(f"{where}: no projection of {[n for n, _ in columns]} gives {last}'s "
                         f"in_features={row.in_features} ({[m.out_features for _, m in columns]}): a fused "
                         "projection, whose contiguous split would cut across its parts, so train this family "
                         "with tensor=1")
    own = [n for n, _ in child.named_parameters(recurse=False)]
    if own:
        raise ValueError(f"{where} holds parameters of its own beside its projections ({own}: gpt-oss' "
                         "attention sinks, one per head) that a split of its heads would leave whole, so train "
                         f"{type(layer.model.meta).__name__} with tensor=1")
    out = {}
    for n, m in child.named_children():
        sizes = [p.numel() for p in m.parameters()]
        if "Norm" not in type(m).__name__ or not sizes:
            continue
        if head_dim is None or any(size != head_dim for size in sizes):  # a weight (and bias) per head
            raise ValueError(f"{where}.{n} ({type(m).__name__}, {sum(sizes)} parameters) normalises across heads "
                             f"(head_dim={head_dim}): each tensor rank holds some heads only, so train this "
                             "family with tensor=1")
        out[f"inner.{name}.{n}"] = ReplicateOnShards()
    return out
