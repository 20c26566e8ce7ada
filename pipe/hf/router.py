"""The experts' load-balancing loss of a Hugging Face MoE, through the pipeline.

With config.output_router_logits=True the families below add `router_aux_loss_coef x` the
Switch Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6) to the cross-entropy.
transformers computes it over every MoE layer's router logits at once: with T_e the top-k
assignments to expert e and P_e the softmax probabilities of e, each summed over the rows
(tokens, weighted by the padding mask) of ALL layers, and R the rows of all layers,

    aux = E * sum_e (T_e / R) * (P_e / R)

which is not a sum of per-layer terms. But T and P are sums over layers, so each decoder
layer adds its own (T, P) to a running [2, E] tensor (`stats`: row 0 T, row 1 P) that travels
with the activations, stage to stage, as the last element of the tuple; R = sum(T) / k. The
final norm turns the totals into coef x `aux` and the heads hand it to causal_lm_loss in `Routed`.
So the loss is exact on any pipeline, and its gradient reaches each layer's router through
the ordinary backward of `stats` (d aux / d P_e = E T_e / R^2); no stage needs a loss term
of its own. The loss is per microbatch, as gradient accumulation computes it in transformers.

Under a sequence split (pipe/sequence/) each rank routes only its slice of every row, and the
sums of one slice give another loss: the final norm adds the slices' (T, P) over the sequence group
before the product (`sum_over_sequence`, whose backward sums every rank's gradient of the total),
so every sequence rank holds the whole rows' term. ShardMean weighs rank r's loss by its share of
the trained tokens, n_r x degree / N: shares that add up to the degree, so the mean of the ranks'
losses holds the term once and the backward's sum hands each rank's routers degree x d aux / d P,
whose mean over the sequence ranks (ZeRO's) is one process's gradient.

Beside a tensor split (hf_tensor_plan: pipe/tensor_tokens.py) each tensor rank routes its share of a
MoE layer's rows: the layer adds its share's (T, P) over the tensor group, the padded rows weighed 0,
so every tensor rank carries the whole rows' sums. That sum's backward is the identity: the tensor ranks
compute one loss (not shares of it, as the sequence ranks do), and the routers' gradients are summed
over the tensor group with the rest of the block's.

A loss of its own (finetune's token mean, train/data's token_mean_loss under ShardSum) takes the
term through `WithRouterLoss(loss_fn)`: loss_fn on the logits, plus coef x aux once, outside
loss_fn's sequence weighing (ShardSum multiplies its loss by the degree; the term, whole on every
sequence rank, would count that many times). Each microbatch adds its own term, as each forward
call does in transformers, and the runner's and the replicas' means make the step's term the mean
of the microbatches' (every rank's): a plain loop's `(model(**mb).loss / accumulation).backward()`,
whatever its cross-entropy's normalisation. transformers' Trainer (4.46 on, 5.x), when it
normalises the cross-entropy by the step's token count (num_items_in_batch), divides neither term
by the accumulation and, with average_tokens_across_devices (its default), multiplies the loss by
the processes' count before DDP's mean: its router term is the SUM over every forward call of the
step, its weight growing with the accumulation and the data degree. Not copied: here the term
weighs the same at any layout; at one microbatch on one process the two agree.

DeepSeek-V3 balances with a bias instead (e_score_correction_bias): transformers' forward adds
no term, and neither does this. Other families are refused until their loss is checked here.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.pipe.sequence.loss import shard_loss

__all__ = ["NO_ROUTER_LOSS", "SWITCH_LOSS", "Routed", "RouterLoss", "RouterTap", "WithRouterLoss", "as_routed",
           "router_loss", "split_stats"]

SWITCH_LOSS = ("gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")  # transformers' load_balancing_loss_func
NO_ROUTER_LOSS = ("deepseek_v3",)  # output_router_logits=True returns the logits, adds no loss


@dataclass(frozen=True, slots=True)
class RouterLoss:
    """What a routed model's loss needs: its coefficient, the experts, the routers' class."""

    coef: float         # config.router_aux_loss_coef
    top_k: int          # config.num_experts_per_tok
    num_experts: int
    router_class: type  # the module whose first output is a layer's router logits

    def zeros(self, device: torch.device) -> torch.Tensor:
        """The running (T, P) before the first layer."""
        return torch.zeros(2, self.num_experts, dtype=torch.float32, device=device)

    def add_layer(self, stats: torch.Tensor, logits: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        """stats + this layer's (T, P), as transformers sums them (softmax in the logits' dtype)."""
        probs = F.softmax(logits, dim=-1)
        chosen = torch.topk(probs, self.top_k, dim=-1)[1].reshape(-1)
        e = self.num_experts
        if padding is None:
            counts = torch.histc(chosen.float(), bins=e, min=0, max=e)
            sums = probs.float().sum(dim=0)
        else:
            rows = padding.reshape(-1).to(device=logits.device, dtype=torch.float32)
            counts = torch.zeros(e, dtype=torch.float32, device=logits.device).scatter_add_(
                0, chosen, rows.repeat_interleave(self.top_k))
            sums = (probs.float() * rows.unsqueeze(-1)).sum(dim=0)
        return stats + torch.stack([counts, sums])

    def balance(self, stats: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of the layers' summed (T, P)."""
        counts, sums = stats[0].detach(), stats[1]
        rows = counts.sum() / self.top_k
        return torch.sum((counts / rows) * (sums / rows)) * self.num_experts


class Routed(NamedTuple):
    """A routed model's final norm and head output: the hidden, then the logits (or HeadLogits), and
    the loss's second term. Tensors only, so it may cross a stage boundary (arriving as a tuple)."""

    value: Any           # the final norm's hidden, then the head's logits
    aux: torch.Tensor    # [1]: router_aux_loss_coef x the load-balancing loss (one dim: eval_step concatenates)

    def map(self, fn: Callable[[Any], Any]) -> "Routed":
        return self._replace(value=fn(self.value))


class WithRouterLoss:
    """loss_fn of the logits, plus a Routed output's router term counted once (module docstring); any
    other output goes to loss_fn as it is. Under a sequence split loss_fn is bound as it says (ShardSum,
    ShardMean, or a mean over the shard's targets) and the term stays out of its weighing."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn

    def bind(self, group: Any, degree: int) -> "WithRouterLoss":
        return WithRouterLoss(shard_loss(self.loss_fn, group, degree))

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        if not isinstance(output, Routed):
            return self.loss_fn(output, targets)
        return self.loss_fn(output.value, targets) + output.aux[0]


def as_routed(loss: RouterLoss | None, x: Any) -> Any:
    """x, or the Routed it was before crossing a stage boundary (a tuple of two tensors)."""
    if loss is None or isinstance(x, Routed) or not isinstance(x, tuple) or len(x) != 2:
        return x
    return Routed(*x)


def router_loss(meta: nn.Module, config: Any) -> RouterLoss | None:
    """The model's RouterLoss, None when its loss is the cross-entropy alone; a family whose loss
    is not checked here is a ValueError."""
    if getattr(config, "output_router_logits", False) is not True or config.model_type in NO_ROUTER_LOSS:
        return None
    if config.model_type not in SWITCH_LOSS:
        raise ValueError(f"hf_layer_specs: {type(meta).__name__} has config.output_router_logits=True, and its "
                         f"router loss is checked against transformers only for {list(SWITCH_LOSS)} (and "
                         f"{list(NO_ROUTER_LOSS)}, which adds none); set config.output_router_logits=False "
                         "(training on the cross-entropy alone)")
    router_class = type(meta)._can_record_outputs["router_logits"].target_class
    router = next(m for m in meta.modules() if isinstance(m, router_class))
    return RouterLoss(float(config.router_aux_loss_coef), int(config.num_experts_per_tok),
                      int(router.weight.shape[0]), router_class)


def split_stats(loss: RouterLoss | None, rest: Sequence[Any]) -> tuple[list, torch.Tensor | None]:
    """(what follows hidden and positions, less the stats; the stats or None). A decode cache (not a
    tensor) among them means no stats travel."""
    rest = list(rest)
    if loss is None or not rest or not all(isinstance(t, torch.Tensor) for t in rest):
        return rest, None
    return rest[:-1], rest[-1]


class RouterTap:
    """Catches the router logits of a decoder layer's routers while `catching()` is open."""

    def __init__(self, layer: nn.Module, router_class: type):
        self._caught: list[torch.Tensor] | None = None
        for m in layer.modules():
            if isinstance(m, router_class):
                m.register_forward_hook(self._catch)

    def _catch(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._caught is not None:
            self._caught.append(output[0])

    @contextmanager
    def catching(self) -> Iterator[list[torch.Tensor]]:
        self._caught = caught = []
        try:
            yield caught
        finally:
            self._caught = None
