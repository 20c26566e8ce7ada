"""The LM head and cross-entropy fused, in chunks of rows: the logits are never whole.

An LM's last two steps, logits = hidden @ W^T and the mean cross-entropy over them, hold a
[tokens, vocab] fp32 tensor (4 x 2048 x 32,000 x 4 bytes = 1 GiB per micro-batch), read and
written several times by the softmax, its backward and the two GEMMs of the head's backward.
Here the head's layer returns `HeadLogits` (its input and weights: the logits not yet
computed), and the loss runs over chunks of rows: each chunk's logits, their log-sum-exp and
loss, and at once their gradient (softmax - one-hot), which goes into the input's gradient
and, accumulated in fp32, the weight's. So forward and backward together cost the unfused
three GEMMs, and the largest temporary is one chunk's logits (`chunk_rows x vocab`). The
gradients are kept from forward to backward and scaled there by the loss's incoming gradient
(the approach of Liger Kernel's fused linear cross-entropy, Hsu et al. 2024; Wijmans et al.
2024, "Cut Your Losses in Large-Vocabulary Language Models", make the same point).

The logits are finished as the Hugging Face families finish them: times `scale` (Cohere's
logit_scale, 1 / Granite's logits_scaling), then soft-capped, cap * tanh(x / cap) (Gemma 2/3's
final_logit_softcapping). Targets equal to `ignore_index` add nothing, and the mean is over
the other targets, as F.cross_entropy's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_ELEMENTS", "HeadLogits", "fused_cross_entropy", "hf_head_logits", "linear_cross_entropy",
           "rows_per_chunk"]

CHUNK_ELEMENTS = 2**25  # the fewest logits in a chunk: 128 MiB in fp32 (1,048 rows of a 32,000 vocabulary)


def rows_per_chunk(vocab: int, d: int) -> int:
    """Rows in a chunk: CHUNK_ELEMENTS logits, or d / 2 rows where the head's weight is larger. Each
    chunk reads and writes the whole fp32 weight gradient once, so a chunk of d / 2 rows or more keeps
    that below twice the chunk's own logits: a vocabulary of 151,936 at d 2,048 takes 1,024-row chunks,
    not 220 (8 passes over the gradient for 8,192 rows, not 38)."""
    return max(1, CHUNK_ELEMENTS // vocab, d // 2)


class HeadLogits(NamedTuple):
    """What an LM head returns instead of its logits: logits = (hidden @ weight^T + bias) * scale,
    then soft-capped. fused_cross_entropy takes it where it takes logits; `.logits()` computes them."""

    hidden: torch.Tensor            # [..., d]
    weight: torch.Tensor            # [vocab, d]
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None

    def logits(self) -> torch.Tensor:
        """The whole logits, as the unfused head computes them (for generation and evaluation)."""
        out = F.linear(self.hidden, self.weight, self.bias)
        if self.scale != 1.0:
            out = out * self.scale
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def with_bias(self, bias: torch.Tensor) -> "HeadLogits":
        """The same head with a bias (a tied head's own bias, Phi's)."""
        return self._replace(bias=bias)


def hf_head_logits(config: Any, hidden: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> HeadLogits:
    """HeadLogits of a Hugging Face CausalLM's head, its scale and soft cap read from the config."""
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    cap = getattr(config, "final_logit_softcapping", None)
    return HeadLogits(hidden, weight, bias, scale, float(cap) if cap is not None else None)


def fused_cross_entropy(output: HeadLogits | torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                        chunk_rows: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy (mean or sum) of logits, or of HeadLogits without making the logits whole."""
    if isinstance(output, HeadLogits):
        return linear_cross_entropy(*output, targets=targets, ignore_index=ignore_index, chunk_rows=chunk_rows,
                                    reduction=reduction)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"fused_cross_entropy: expected logits (a tensor) or HeadLogits, got {type(output).__name__} "
                        "(a MoE with output_router_logits=True gives Routed, the logits and its router term: wrap "
                        "the loss_fn in pipezero.pipe.hf.router.WithRouterLoss)")
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index,
                           reduction=reduction)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         scale: float = 1.0, softcap: float | None = None, *, targets: torch.Tensor,
                         ignore_index: int = -100, chunk_rows: int | None = None,
                         reduction: str = "mean") -> torch.Tensor:
    """mean CE(softcap(scale * (hidden @ weight^T + bias)), targets) over targets != ignore_index.

    hidden [..., d] with targets [...]; chunk_rows rows at a time (default: rows_per_chunk, so a
    micro-batch of fewer rows is one chunk, computed as the unfused head and loss would: the chunking
    starts past that size and costs nothing, the gradients being made in the forward pass either way).
    reduction "sum": the sum over those targets (0 when there is none), as F.cross_entropy's.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy(reduction={reduction!r}): expected 'mean' or 'sum'")
    d = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"linear_cross_entropy: weight {tuple(weight.shape)} does not fit hidden {tuple(hidden.shape)}"
                         f"; expected weight [vocab, {d}]")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: targets {tuple(targets.shape)} do not fit hidden "
                         f"{tuple(hidden.shape)}; expected targets {tuple(hidden.shape[:-1])}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"linear_cross_entropy(softcap={softcap}): expected a positive cap or None")
    rows = chunk_rows or rows_per_chunk(*weight.shape)
    if rows < 1:
        raise ValueError(f"linear_cross_entropy(chunk_rows={chunk_rows}): expected a positive number of rows")
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCrossEntropy.apply(hidden.reshape(-1, d), weight, bias, targets.reshape(-1), float(scale),
                                     softcap, ignore_index, rows, grads, reduction == "sum")


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in one pass over row chunks; backward scales the kept gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, ignore_index, rows, grads, summed):
        valid = targets != ignore_index
        count = valid.sum()
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need = ctx.needs_input_grad if grads else (False, False, False)
        g_hidden = torch.empty_like(hidden) if need[0] else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
        g_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need[2] else None
        inv = 1.0 if summed else 1.0 / count.clamp(min=1).float()
        for lo in range(0, hidden.shape[0], rows):
            h, t, ok = hidden[lo:lo + rows], targets[lo:lo + rows], valid[lo:lo + rows]
            loss, g = _chunk(h, weight, bias, t, ok, scale, softcap, grads)
            total += loss
            if g is None:
                continue
            g = (g * inv).to(weight.dtype)  # the mean's 1/count; the GEMMs in the weights' dtype
            if g_hidden is not None:
                g_hidden[lo:lo + rows] = g @ weight
            if g_weight is not None:
                _add_weight_grad(g_weight, g, h)
            if g_bias is not None:
                g_bias += g.float().sum(0)
        # saved, not an attribute: autograd frees them after a backward that does not retain the graph
        # and keeps them for one that does (a split backward runs this node in I and again in W)
        ctx.save_for_backward(g_hidden, g_weight, g_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        # F.cross_entropy's mean of nothing is nan (0 / 0)
        return total if summed else total / count.float()

    @staticmethod
    def backward(ctx, grad):
        g_hidden, g_weight, g_bias = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        out_h = g_hidden * grad.to(g_hidden.dtype) if g_hidden is not None else None
        out_w = (g_weight * grad).to(w_dtype) if g_weight is not None else None
        out_b = (g_bias * grad).to(b_dtype) if g_bias is not None else None
        return out_h, out_w, out_b, None, None, None, None, None, None, None


def _add_weight_grad(g_weight: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """g_weight (fp32) += g^T h: inside the GEMM where the dtypes agree, else the product in the weights'
    dtype added in fp32. Traced, inductor fuses these adds over every chunk into one sum that holds all
    the chunks' [vocab, d] products at once: why chunks are never small beside the weight (rows_per_chunk)."""
    if g.dtype == g_weight.dtype:
        g_weight.addmm_(g.t(), h)
    else:
        g_weight.add_((g.t() @ h).float())


def _chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           valid: torch.Tensor, scale: float, softcap: float | None,
           grads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed loss of the chunk's valid rows, d loss_sum / d raw logits in fp32, or None)."""
    z = F.linear(h, weight, bias).float()
    if scale != 1.0:
        z = z * scale
    capped = torch.tanh(z / softcap) if softcap is not None else None
    logits = capped * softcap if capped is not None else z
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    if not grads:
        return loss, None
    g = torch.exp(logits.sub_(lse[:, None]))  # softmax, in the logits' memory
    g[torch.arange(g.shape[0], device=g.device), safe] -= 1.0
    g *= valid[:, None]
    if capped is not None:
        g *= 1.0 - capped * capped   # d cap*tanh(z/cap) / dz
    if scale != 1.0:
        g *= scale
    return loss, g
