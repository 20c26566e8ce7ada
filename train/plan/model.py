"""What the planner knows about a model: per-layer parameters, FLOPs, activation bytes and time.

A model is the layer list Embedding, n_layer x Block, FinalNorm, Head (the GPT's tied to the
embedding), the list pipezero/train/gpt/model.py and pipe/hf/'s hf_layer_specs build. Every number is per layer and
per token, so the time and memory models can cut the list into stages anywhere and scale it to any
micro-batch. Time comes from one of two sources:

* measured (`measure_profile`): each layer's forward + backward on this machine through
  pipe.measure_layer_costs, divided by the tokens of the sample; used when the target is the
  machine the planner runs on;
* modelled (`flops_profile`): the layer's training FLOPs over (peak FLOP/s x efficiency);
  used for cluster-scale predictions on hardware that is not here.

Activation bytes (what autograd keeps per token between forward and backward) and the memory
kit's terms are counted per family in layers.py (pipezero's GPT: Korthikanti et al. 2022,
section 4; a Hugging Face decoder: RMSNorm in fp32, grouped key/value heads, a gated MLP or routed
experts). The head's unfused loss (cross-entropy of the logits cast to fp32) keeps log-softmax's
fp32 output, 4 x vocab bytes per token, and while its backward runs two more such tensors: 8 x
vocab bytes per token of the one micro-batch being differentiated (on the 1.3B GPT, vocabulary
50,304, 0.4 of the 2.2 MB per token alive at the peak); fused, none of them is whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from pipezero.checks import is_int
from pipezero.train.plan.layers import block_terms, head_terms

__all__ = ["MEASURED_LEN", "LayerProfile", "ModelShape", "bytes_per_element", "flops_profile", "held_experts",
           "held_params", "measure_profile", "tied_head", "total_params"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """A decoder: the shape flags of the main job (pipezero/train/gpt/job.py), or a Hugging Face config's.

    `family` "gpt" is pipezero's GPT; "llama" a Hugging Face decoder (layers.py says what each keeps).
    `kv_heads` (0: `heads`) and `intermediate` (0: 4 x d_model) are the attention's key/value heads
    and the MLP's width; `experts` > 0 makes the MLP routed experts of `moe_intermediate`, each token
    through `top_k` of them. `tied`: the head shares the embedding; `fused_loss`: the head + loss in
    row chunks (pipe/fused_loss.py; `pipezero finetune`'s), never the whole logits.
    """

    layers: int = 4
    d_model: int = 128
    heads: int = 4
    seq_len: int = 128
    vocab: int = 256
    name: str = ""
    family: str = "gpt"
    kv_heads: int = 0
    intermediate: int = 0
    tied: bool = True
    fused_loss: bool = False
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0

    def __post_init__(self) -> None:
        for key in ("layers", "d_model", "heads", "seq_len", "vocab"):
            value = getattr(self, key)
            if not is_int(value, minimum=1):
                raise ValueError(f"ModelShape({key}={value!r}): expected a positive integer")
        for key in ("kv_heads", "intermediate", "experts", "top_k", "moe_intermediate"):
            if not is_int(getattr(self, key), minimum=0):
                raise ValueError(f"ModelShape({key}={getattr(self, key)!r}): expected an integer >= 0")
        if self.d_model % self.heads:
            raise ValueError(f"ModelShape(d_model={self.d_model}, heads={self.heads}): d_model must be a "
                             "multiple of heads")
        if self.heads % self.key_value_heads:
            raise ValueError(f"ModelShape(heads={self.heads}, kv_heads={self.kv_heads}): the key/value heads "
                             "must divide the attention heads")
        if self.experts and not (0 < self.top_k <= self.experts and self.moe_intermediate):
            raise ValueError(f"ModelShape(experts={self.experts}, top_k={self.top_k}, moe_intermediate="
                             f"{self.moe_intermediate}): a MoE needs 1 <= top_k <= experts and its experts' width")

    @property
    def key_value_heads(self) -> int:
        """The attention's key/value heads (grouped-query attention: fewer than the heads)."""
        return self.kv_heads or self.heads

    @property
    def mlp_width(self) -> int:
        """The dense MLP's intermediate width."""
        return self.intermediate or 4 * self.d_model

    @property
    def label(self) -> str:
        """The name, or the shape in flag form."""
        moe = f", {self.experts} experts top-{self.top_k}" if self.experts else ""
        return self.name or f"GPT {self.layers}x{self.d_model} (heads {self.heads}, seq {self.seq_len}{moe})"

    @classmethod
    def from_hf_config(cls, config: Any, seq_len: int, name: str = "") -> "ModelShape":
        """The shape of a Hugging Face causal LM's config (a PretrainedConfig or its config.json dict),
        trained with pipezero finetune's fused head + loss."""
        get = (config if isinstance(config, dict) else config.to_dict()).get
        experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0
        return cls(layers=get("num_hidden_layers"), d_model=get("hidden_size"), heads=get("num_attention_heads"),
                   kv_heads=get("num_key_value_heads") or 0, intermediate=get("intermediate_size") or 0,
                   vocab=get("vocab_size"), seq_len=seq_len, family="llama",
                   tied=bool(get("tie_word_embeddings", False)), fused_loss=True, experts=int(experts),
                   top_k=int(get("num_experts_per_tok") or 0) if experts else 0,
                   moe_intermediate=int(get("moe_intermediate_size") or get("intermediate_size") or 0)
                   if experts else 0, name=name or str(get("model_type") or "hf"))


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerProfile:
    """One layer, per token: parameters, training FLOPs, activation elements, seconds.

    `tied`: replicated over tensor ranks (pipezero's tensor_plan leaves tied layers whole);
    `act_shared` / `act_sharded`: saved elements per token replicated / split by tensor
    parallelism; `act_extra_bytes`: saved bytes per token that do not scale with the dtype
    (token ids, LayerNorm statistics); `loss_bytes`: saved bytes per token of the loss this layer
    feeds, outside any activation checkpoint; `backward_bytes`: bytes per token alive only
    while this layer's backward runs, on top of what it saved (the loss's fp32 gradients).
    """

    kind: str
    params: int
    flops: float                  # forward + backward, per token
    act_shared: float
    act_sharded: float
    act_extra_bytes: float = 0.0
    loss_bytes: float = 0.0
    backward_bytes: float = 0.0
    seconds: float = 0.0          # forward + backward per token on the target device
    tied: bool = False
    recompute_seconds: float | None = None  # per token, what checkpointing adds to the backward; None: a third
                                            # of `seconds` (one more forward)
    selective_seconds: float | None = None  # per token, what selective checkpointing adds, measured as it runs
                                            # (eager, through torch's dispatch mode); None: the re-run
                                            # elementwise bytes at the memory bandwidth
    split_seconds: float | None = None      # per token, forward + backward split into I and W as zero-bubble
                                            # schedules run it; None: `seconds`
    tensor_overhead: float = 0.0            # seconds per micro-batch (not per token) that tensor parallelism's
                                            # hooks, autograd nodes and collective calls add to the layer's
                                            # forward + backward
    # the memory kit's terms (layers.py): elements per token that MLP row tiles do not keep, that a
    # selective recompute keeps (its MLP part apart: row tiles keep none of it); bytes per micro-batch
    # that the backward holds beside backward_bytes (the fused loss's fp32 weight gradient), and at most
    # backward_cap_bytes of backward_bytes x tokens (the fused loss's one chunk)
    act_tiled: float = 0.0
    act_selective: float = 0.0
    act_selective_mlp: float = 0.0
    backward_fixed_bytes: float = 0.0
    backward_cap_bytes: float = float("inf")
    mlp_flops: float = 0.0                  # per token, the MLP's part of `flops` (what tiling recomputes)
    expert_params: int = 0                  # of `params`, the routed experts' (split over the expert axis)
    moe_top_k: int = 0                      # experts each token goes to (a MoE block's)
    # the norms' and attention's terms (layers.py): elements per token more where k and v are repeated to
    # the query heads (fp32 on a GPU); saved bytes per token of the norms' fp32 work that row tiles of the
    # norms do not keep (part of act_extra_bytes); the norms' backward: bytes per token of a whole norm's
    # fp32 temporaries, and in row tiles elements per token of the tiles' gradients beside their join
    act_kv_repeat: float = 0.0
    norm_fp32_bytes: float = 0.0
    norm_backward_bytes: float = 0.0
    norm_tile_grads: float = 0.0
    # a checkpointed run starting here keeps its input until its backward; the fused head's does not (it
    # returns the hidden state inside HeadLogits, no tensor: the checkpoint's saved input dies at once)
    keeps_input: bool = True
    # the elements of each parameter tensor but the routed experts', whole, in the module's order (ZeRO's
    # buckets are cut from them: memory.optimizer_shards); () is one tensor of params - expert_params
    tensors: tuple[int, ...] = ()

    def act_bytes(self, precision: str, tensor: int = 1, tiled: bool = False, norms_tiled: bool = False) -> float:
        """Saved bytes per token on one tensor rank (`tiled`: the MLP in row tiles; `norms_tiled`: the norms)."""
        repeat = self.act_kv_repeat if _BYTES[precision] == 4 else 0.0  # CUDA's flash kernel: 16-bit only
        sharded = self.act_sharded + repeat - (self.act_tiled if tiled else 0.0)
        sharded = sharded if self.tied else sharded / tensor
        extra = self.act_extra_bytes - (self.norm_fp32_bytes if norms_tiled else 0.0)
        return (self.act_shared + sharded) * _BYTES[precision] + extra + self.loss_bytes

    def norm_backward(self, precision: str, tokens: float, norms_tiled: bool, tile_rows: int) -> float:
        """Bytes the norms' backward holds at once beyond what the layer saved: a whole norm's fp32
        temporaries for every token, or one tile's (`tile_rows`) beside the tiles' gradients and their join."""
        if not norms_tiled:
            return self.norm_backward_bytes * tokens
        rows = min(tokens, tile_rows)
        return self.norm_backward_bytes * rows + self.norm_tile_grads * tokens * _BYTES[precision]

    def selective_bytes(self, precision: str, tensor: int = 1, tiled: bool = False) -> float:
        """Bytes per token a selectively recomputed run keeps of this layer (the matmuls' outputs)."""
        kept = self.act_selective + (0.0 if tiled else self.act_selective_mlp)
        return kept / (1 if self.tied else tensor) * _BYTES[precision]


def bytes_per_element(precision: str) -> int:
    """2 for bf16/fp16, 4 for fp32; a ValueError naming the choices otherwise."""
    if precision not in _BYTES:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(_BYTES)}")
    return _BYTES[precision]


def _layers(shape: ModelShape) -> list[LayerProfile]:
    """The analytic profile of every layer (seconds 0: filled by a time source); layers.py counts them."""
    d, s, v = shape.d_model, shape.seq_len, shape.vocab
    terms = block_terms(shape.family, d, shape.heads, shape.key_value_heads, shape.mlp_width, shape.experts,
                        shape.top_k, shape.moe_intermediate)
    terms["flops"] += 12.0 * d * s  # QK^T and AV (causal or not: the kernels' count), x3 for backward
    positions = s * d if shape.family == "gpt" else 0  # the GPT's learned positions; rotary has none
    rotary = 0.0 if shape.family == "gpt" else 2.0 * d / shape.heads  # cos and sin, made once per micro-batch
    embed = LayerProfile(kind="Embedding", params=v * d + positions, flops=0.0, act_shared=rotary, act_sharded=0.0,
                         act_extra_bytes=8.0, tied=shape.tied, tensors=(v * d, positions) if positions else (v * d,))
    block = LayerProfile(kind="Block", **terms)
    fp32 = 0.0 if shape.family == "gpt" else 4.0 * d + 4.0  # a Llama RMSNorm's fp32 input and 1/rms (whole)
    norm_tensors = (d, d) if shape.family == "gpt" else (d,)  # LayerNorm's weight and bias; RMSNorm's weight
    norm = LayerProfile(kind="FinalNorm", params=sum(norm_tensors), flops=0.0, act_shared=float(d), act_sharded=0.0,
                        act_extra_bytes=8.0 if shape.family == "gpt" else fp32, norm_fp32_bytes=fp32,
                        tensors=norm_tensors)
    head = LayerProfile(kind="Head", params=v * d, flops=6.0 * v * d, act_sharded=0.0, tied=shape.tied,
                        tensors=(v * d,), **head_terms(d, v, shape.fused_loss))
    return [embed, *([block] * shape.layers), norm, head]


def flops_profile(shape: ModelShape, flops_per_second: float) -> list[LayerProfile]:
    """Every layer timed as FLOPs / `flops_per_second` (the target's peak x efficiency)."""
    if flops_per_second <= 0:
        raise ValueError(f"flops_profile: flops_per_second={flops_per_second!r}, expected > 0")
    return [replace(p, seconds=p.flops / flops_per_second) for p in _layers(shape)]


MEASURED_LEN = 4096  # the longest sequence measure_profile times; longer ones are scaled by the FLOPs


def measure_profile(shape: ModelShape, precision: str = "fp32", microbatch: int = 2,
                    repeats: int = 2, device: str = "cpu", rounds: int = 5, compile: Any = None,
                    max_len: int = MEASURED_LEN) -> list[LayerProfile]:
    """Every layer timed on this machine: pipe.measure_layer_costs on one micro-batch, per token.

    A sequence longer than `max_len` is timed at `max_len` and each layer's per-token times scaled
    by its FLOPs per token at the full length over those at `max_len` (the block's attention grows
    with the sequence, the rest does not): timing a 512K-token block on the host would take its
    memory and hours, and the planner only needs the trend.
    """
    if shape.family != "gpt":
        raise ValueError(f"measure_profile times pipezero's GPT blocks; {shape.label} is a {shape.family} "
                         "decoder: plan it on modelled hardware (--hardware h100 or h200)")
    if shape.seq_len > max_len:
        short = measure_profile(replace(shape, seq_len=max_len), precision, microbatch, repeats, device, rounds,
                                compile, max_len)
        return [_scaled(full, part) for full, part in zip(_layers(shape), short)]
    return _measure(shape, precision, microbatch, repeats, device, rounds, compile)


def _scaled(full: LayerProfile, short: LayerProfile) -> LayerProfile:
    """`full`'s analytic profile with `short`'s measured times, per token, in the ratio of their FLOPs."""
    ratio = full.flops / short.flops if short.flops else 1.0
    times = {k: None if getattr(short, k) is None else getattr(short, k) * ratio
             for k in ("seconds", "recompute_seconds", "split_seconds")}
    return replace(full, tensor_overhead=short.tensor_overhead, **times)


def _measure(shape: ModelShape, precision: str, microbatch: int, repeats: int, device: str, rounds: int,
             compile: Any) -> list[LayerProfile]:
    """measure_profile at the shape's own length.

    Each layer's time is the least of `rounds` measurements: on a machine shared with other
    work a measurement only ever comes out slower than the layer's own cost, never faster
    (the reason timeit reports the minimum), and the least is what repeats from run to run.
    The blocks are alike, so a one-block model is timed: measure_layer_costs times one block
    and reuses it anyway, and building the others only cost their initialisation (on the CPU
    generator: 1.2B numbers, about 10 s per round for the 1.3B GPT). `compile` (PipelineModule's:
    default on CUDA, pipe/compile.py) times the block and the loss compiled, as the pipeline runs them.
    """
    import torch

    from pipezero.pipe import measure_layer_costs
    from pipezero.pipe.compile import CompileConfig, compile_layers, compile_loss

    from pipezero.train.gpt.model import GPTConfig, gpt_loss, gpt_specs

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (microbatch, shape.seq_len), generator=gen).to(device)
    cfg = GPTConfig(n_layer=1, n_head=shape.heads, d_model=shape.d_model, seq_len=shape.seq_len,
                    vocab_size=shape.vocab)  # the blocks are alike: one is timed, none other is built
    specs, config = gpt_specs(cfg), CompileConfig.of(compile, torch.device(device))
    with torch.device(device):
        blocks = [specs[1].build().to(dtype) for _ in range(4)]  # timed alone, checkpointed, split, selective
        hidden = torch.randn(microbatch, shape.seq_len, shape.d_model, dtype=dtype)
    split, selective = _split(blocks[2]), _selective(blocks[3])
    loss_fn = gpt_loss
    if config is not None:  # not the selective one: PipelineModule runs those layers eager (compiles_checkpointed)
        compile_layers(blocks[:3], config, {type(blocks[0])})
        loss_fn = compile_loss(gpt_loss, config)
    layers, checkpointed = [specs[0], blocks[0], *specs[2:]], _checkpointed(blocks[1])
    embed, block, norm, head, again, halves, kept = (min(t) for t in zip(*(
        measure_layer_costs(layers, tokens, loss_fn=loss_fn, targets=tokens, dtype=dtype, repeats=repeats)
        + measure_layer_costs([checkpointed, split, selective], hidden, repeats=repeats) for _ in range(rounds))))
    ms = [embed, *([block] * shape.layers), norm, head]
    per_token = microbatch * shape.seq_len
    recompute, selected = (max(0.0, t - block) / 1e3 / per_token for t in (again, kept))
    blocks = dict(recompute_seconds=recompute, selective_seconds=selected, split_seconds=halves / 1e3 / per_token,
                  tensor_overhead=_tensor_overhead_ms(cfg, dtype, hidden, repeats, rounds) / 1e3)
    return [replace(p, seconds=t / 1e3 / per_token, **(blocks if p.kind == "Block" else {}))
            for p, t in zip(_layers(shape), ms)]


def _checkpointed(block):
    """The block as PipelineModule runs it with activation_checkpoint_interval=1: the recompute
    in backward and torch.utils.checkpoint's own work, which on a GPU at small micro-batches
    costs more launches than the one forward the arithmetic adds."""
    from torch.utils.checkpoint import checkpoint

    return lambda h: checkpoint(block, h, use_reentrant=False)


def _selective(block):
    """The block as PipelineModule runs it under selective recomputation: eager, its ops through torch's
    selective dispatch mode in the forward and again in the recompute (pipe/memory/recompute.py)."""
    from pipezero.pipe.memory.recompute import RecomputeConfig, checkpointed

    config = RecomputeConfig(mode="selective")

    def selective_block(h):  # its own name: measure_layer_costs reuses times by name and shapes
        return checkpointed(block, (h,), config)
    return selective_block


def _split(block):
    """The block as a zero-bubble schedule runs it: forward, then I and W as the pipeline runner
    splits the backward (pipe/split_backward.py; its Linear layers keep their weight GEMMs for W).
    Returns a detached output, so measure_layer_costs adds no backward of its own."""
    import torch

    from pipezero.pipe.deferred_linear import WeightSink, collecting, defer_linear_weights
    from pipezero.pipe.split_backward import backward_input

    defer_linear_weights(block)
    weights = [p for p in block.parameters() if p.requires_grad]

    def split_block(h):  # its own name: measure_layer_costs reuses times by name and shapes
        with torch.enable_grad():
            h, sink = h.detach().requires_grad_(), WeightSink()
            with collecting(sink):
                out = block(h)
            _, weight_grads = backward_input([out], [torch.ones_like(out)], [h], weights, sink)
            weight_grads.run()
        return out.detach()
    return split_block


def _tensor_overhead_ms(cfg, dtype, hidden, repeats: int, rounds: int) -> float:
    """Milliseconds the split adds to one block's forward + backward: the block split by its tensor
    plan over a one-rank mesh as PipelineModule splits it (pipe/tensor_linear.py's local tensors;
    each collective over one rank) less the same block whole. Under DTensor this host work, not
    the kernels, set a tensor-parallel step's pace on GPUs (bench/RESULTS.md, plan on 2 x H200).
    Measured only when this process has no process group of its own (0 otherwise: a one-rank
    group cannot be made without the other ranks)."""
    import torch
    import torch.distributed as dist

    from pipezero.pipe import measure_layer_costs

    if dist.is_initialized():
        return 0.0
    from pipezero.train.gpt.model import gpt_specs, gpt_tensor_plan
    from torch.distributed.device_mesh import DeviceMesh

    from pipezero.pipe.tensor_parallel import shard_module

    device = hidden.device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        with torch.device(device):
            whole, split = (gpt_specs(cfg)[1].build().to(dtype) for _ in range(2))
        shard_module(split, DeviceMesh(device.type, [0]), gpt_tensor_plan()(split))
        times = [(measure_layer_costs([whole], hidden, repeats=repeats)[0],  # apart: one call would reuse
                  measure_layer_costs([split], hidden, repeats=repeats)[0]) for _ in range(rounds)]  # a Block's time
        plain, sharded = (min(t) for t in zip(*times))
    finally:
        dist.destroy_process_group()
    return max(0.0, sharded - plain)


def total_params(profile: Sequence[LayerProfile]) -> int:
    """Unique parameters: a tied head's weight is the embedding's."""
    return sum(p.params for p in profile if not (p.kind == "Head" and p.tied))


def tied_head(profile: Sequence[LayerProfile]) -> bool:
    """Does the head share the embedding's weight (the GPT's; a Hugging Face config's tie_word_embeddings)?"""
    return any(p.kind == "Head" and p.tied for p in profile)


def held_params(profile: Sequence[LayerProfile], layers: Sequence[int], tensor: int = 1, expert: int = 1) -> float:
    """Parameters one rank holds for `layers`, per tensor rank (tied layers whole), its experts / `expert`
    (whole on every tensor rank: a MoE block is split by tokens, not weights, pipe/tensor_tokens.py).

    A tied head's weight is the embedding's: a rank holding both holds it once (a rank with only
    one of them keeps its own copy, which the tied-gradient all-reduce keeps equal).
    """
    both = {profile[i].kind for i in layers} >= {"Embedding", "Head"} and tied_head(profile)
    return sum((profile[i].params - profile[i].expert_params) / (1 if profile[i].tied else tensor)
               + profile[i].expert_params / expert for i in layers if not (both and profile[i].kind == "Head"))


def held_experts(profile: Sequence[LayerProfile], layers: Sequence[int], tensor: int = 1, expert: int = 1) -> float:
    """Of held_params, the routed experts' parameters one rank holds: each layer's experts / `expert` (whole on
    every tensor rank)."""
    return sum(profile[i].expert_params / expert for i in layers)
