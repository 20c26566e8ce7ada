"""What each layer of a model costs, per token: parameters, FLOPs and the bytes of the memory kit's terms.

Two block families (ModelShape.family):

* "gpt": pipezero's GPT (train/gpt/model.py): LayerNorm in the training dtype, a GELU MLP of 4d,
  tied embedding and head. Korthikanti et al. 2022, section 4, without dropout and with a fused
  attention that keeps no score matrix: 4d replicated elements (two LayerNorm inputs and
  outputs) and 12d split by tensor parallelism (q, k, v, the attention output, the MLP hidden
  before and after GELU). tests/test_plan.py checks the count against autograd's saved tensors.
* "llama": a Hugging Face decoder layer (Llama, Qwen, Mistral, ... through pipe/hf/): RMSNorm
  computed in fp32, rotary, grouped key/value heads, a gated (SwiGLU) MLP of `intermediate`, or
  routed experts. Counted from the tensors autograd keeps on a row of packed documents
  (tests/test_plan_kit.py checks a block's saved bytes against autograd's, within 0.2%):
  - `norms`: each of the two RMSNorms keeps its normalised output before the weight (d elements)
    and the weighted output feeds the projections (d elements); whole, its fp32 input (4d bytes)
    and 1/rms (4 bytes) too (`norm_fp32`). In row tiles (pipe/tiled_mlp.py, past
    NORM_TILE_FROM_ROWS rows) it keeps its input in the training dtype in place of the normalised
    output and nothing in fp32;
  - `attention`: q, k and v at the key/value heads where the kernel takes them grouped (SDPA's
    enable_gqa: CPU's flash kernel and CUDA's, which takes 16-bit inputs, pipe/document_attention.py;
    in fp32 on a GPU they are repeated to the query heads, `kv_repeat`), the kernel's output and
    the documents' joined output that o_proj reads (the transpose before o_proj is then free), the
    kernel's log-sum-exp (4 bytes per head);
  - `mlp`: gate, up, silu(gate) and their product (4 x intermediate elements); row tiles
    (pipe/tiled_mlp.py) keep none of them, only the tiles' inputs, which are the norm's output;
  - `norm_backward`: while a block's backward runs, a whole RMSNorm's fp32 backward holds five
    [tokens, d] fp32 temporaries (20d bytes) on top of what the block saved (the live tensors at
    the peak of a step on CPU; an H200 shows about 2d bytes fewer: README, Long sequences); in row
    tiles one tile's (NORM_TILE_ROWS rows), beside the tiles' input gradients waiting for their
    join and the joined gradient (`norm_tile_grads`: 2d elements a token, bench/live_tensors.py).
  A selective recompute (pipe/memory/recompute.py) keeps the matmuls' and the attention kernel's
  outputs (q, k, v, the attention output, o_proj's; gate, up and down_proj's unless tiled).

The head: unfused, the loss keeps log-softmax's fp32 output (4 x vocab bytes a token) and its
backward two more (8 x vocab); fused (pipe/fused_loss.py) the loss's gradient for the hidden
state is made in the forward and kept (d elements), and for the micro-batch at hand one chunk's
fp32 logits and their gradient (8 x vocab bytes a token, at most 2 x 2^25 x 4 bytes) and the head
weight's fp32 gradient (4 x vocab x d bytes, per micro-batch) are alive.

Mixture-of-experts (a config's num_experts, num_experts_per_tok, moe_intermediate_size): the
block's MLP is `experts` gated experts of `moe_intermediate`, each token through `top_k` of them
(FLOPs and activations x top_k, parameters x experts), plus the router (d x experts). Expert
parallelism (pipe/expert/) holds experts / E of them on a rank and moves each token's hidden
state to its experts' ranks and back (step_time.py counts that traffic).
"""

from __future__ import annotations

from pipezero.pipe.fused_loss import rows_per_chunk

__all__ = ["FAMILIES", "block_terms", "head_terms"]

FAMILIES = ("gpt", "llama")
NORM_BACKWARD_FP32 = 5  # [tokens, d] fp32 temporaries of the RMSNorm's backward (tests/test_plan_kit.py)
FLASH_HEAD_DIMS = 256   # CUDA's flash kernel takes head dims up to this, multiples of 8 (else k/v are repeated)


def block_terms(family: str, d: int, heads: int, kv_heads: int, intermediate: int, experts: int = 0,
                top_k: int = 0, moe_intermediate: int = 0) -> dict[str, float]:
    """A block's LayerProfile fields, per token: params, flops (without attention's s-dependent part),
    act_shared / act_sharded / act_extra_bytes, act_kv_repeat, act_tiled, act_selective (+ _mlp),
    norm_fp32_bytes, norm_backward_bytes, norm_tile_grads, backward_bytes, mlp_flops, expert_params,
    moe_top_k, tensors (the GPT's LayerNorm in the training dtype, untiled, and equal heads: no norm or
    kv_repeat term)."""
    hd = d // heads
    if family == "gpt":
        params = 12 * d * d + 13 * d
        # ln1, ln2 (weight, bias), qkv, proj, fc, out (weight, bias): train/gpt/model.py's Block
        tensors = (d, d, d, d, 3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d)
        return dict(params=params, flops=6.0 * 12 * d * d, act_shared=4.0 * d, act_sharded=12.0 * d,
                    act_tiled=8.0 * d, act_selective=5.0 * d, act_selective_mlp=5.0 * d, backward_bytes=0.0,
                    act_extra_bytes=0.0, mlp_flops=6.0 * 8 * d * d, expert_params=0, moe_top_k=0, tensors=tensors)
    if family != "llama":
        raise ValueError(f"family={family!r}: expected one of {FAMILIES}")
    attn_params = 2 * d * d + 2 * d * kv_heads * hd
    # elements per token, then bytes: the named terms of the module docstring
    norm_outputs = 4.0 * d                     # two norms: normalised (tiled: its input), and weighted
    norm_fp32 = 2 * (4.0 * d + 4.0)            # bytes: each whole norm's fp32 input and 1/rms
    kv = 2.0 * kv_heads * hd                   # k and v at the key/value heads, as the kernel takes them
    kv_repeat = 2.0 * d - kv                   # more, where k and v are repeated to the query heads
    if hd % 8 or hd > FLASH_HEAD_DIMS:         # no flash kernel on a GPU: repeated in every precision
        kv, kv_repeat = kv + kv_repeat, 0.0
    attention = 3.0 * d + kv                   # q, k, v, the kernel's output, the joined output o_proj reads
    lse = 4.0 * heads                          # bytes: the attention kernel's log-sum-exp
    norm_backward = NORM_BACKWARD_FP32 * 4.0 * d  # bytes, while the block's backward runs (a whole norm)
    norm_tile_grads = 2.0 * d                  # the tiles' input gradients and their join (norms in tiles)
    selective = 3.0 * d + 2.0 * kv_heads * hd  # q, k, v projections', the attention's and o_proj's outputs
    attn_tensors = (d * d, d * kv_heads * hd, d * kv_heads * hd, d * d)  # q, k, v, o
    if experts:
        routed = experts * 3 * d * moe_intermediate
        mlp_tensors = (d * experts,)           # the router (the experts are a param group of their own)
        mlp_params, mlp_flops = routed + d * experts, 6.0 * (top_k * 3 * d * moe_intermediate + d * experts)
        mlp = 4.0 * top_k * moe_intermediate + 2.0 * top_k * d  # each expert's four, the dispatched tokens
        tiled, selective_mlp = 0.0, (2.0 * moe_intermediate + d) * top_k  # experts are not tiled
    else:
        routed, mlp_params, mlp_flops = 0, 3 * d * intermediate, 6.0 * 3 * d * intermediate
        mlp_tensors = (d * intermediate,) * 3  # gate, up, down
        mlp = tiled = 4.0 * intermediate       # gate, up, silu(gate), their product
        selective_mlp = 2.0 * intermediate + d
    return dict(params=attn_params + mlp_params + 2 * d, flops=6.0 * attn_params + mlp_flops,
                act_shared=norm_outputs, act_sharded=attention + mlp, act_extra_bytes=norm_fp32 + lse,
                act_kv_repeat=kv_repeat, act_tiled=tiled, act_selective=selective,
                act_selective_mlp=selective_mlp, norm_fp32_bytes=norm_fp32, norm_backward_bytes=norm_backward,
                norm_tile_grads=norm_tile_grads, backward_bytes=0.0, mlp_flops=mlp_flops,
                expert_params=routed, moe_top_k=top_k if experts else 0,
                tensors=attn_tensors + mlp_tensors + (d, d))  # the two norms last, as a decoder layer registers


def head_terms(d: int, vocab: int, fused: bool) -> dict[str, float]:
    """The head's LayerProfile fields for its loss: fused (pipe/fused_loss.py) or over whole logits."""
    if fused:
        return dict(act_shared=2.0 * d, loss_bytes=0.0, backward_bytes=8.0 * vocab,
                    backward_cap_bytes=2 * rows_per_chunk(vocab, d) * vocab * 4.0,
                    backward_fixed_bytes=4.0 * vocab * d, keeps_input=False)
    return dict(act_shared=float(d), loss_bytes=4.0 * vocab, backward_bytes=8.0 * vocab)
