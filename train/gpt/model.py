"""A small GPT as a list of plain layers, so a pipeline can cut it anywhere between layers.

Layers in order: Embedding (token + learned position), n_layer x Block (pre-LN causal
self-attention through torch's scaled_dot_product_attention, then an MLP), FinalNorm, Head.
The head's weight is the token embedding's weight (Press & Wolf 2017, "Using the Output
Embedding to Improve Language Models"): both layers hold it as their attribute `weight`, so
a pipeline ties them with TiedLayerSpec(key=TIED_KEY, ..., tied_weight_attr=TIED_WEIGHT_ATTR).
The final norm is a layer of its own so that the head has no other parameter: on a stage
that holds both tied layers, the Head call becomes `head_forward(embedding_module, h)`.

Every layer initialises itself from a generator seeded by (config seed, layer index), never
from the global RNG: a stage that builds only its own layers gets the same weights as the
single-process `GPT`, which makes the pipeline's parity tests exact. Architecture after
Radford et al. 2019 (GPT-2), as in karpathy/nanoGPT.

Generation (`generate(layers, idx, n)`, `GPT.generate`) lives in pipezero/train/gpt/generate.py
(KV cache, left-padded batches, a CUDA-graph decode step). This is the model of the main job
(pipezero/train/gpt/job.py, `pipezero train`) and of the planner (train/plan/model.py), so it
ships in the package; examples/gpt.py re-exports it.
gpt_from_pipeline and gpt_stage_layers give it the layers
of a pipeline.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from pipezero.pipe.document_attention import Documents, document_attention, documents_from_segments
from pipezero.pipe.tiled_mlp import tiled_rows

__all__ = ["Block", "Embedding", "FinalNorm", "GPT", "GPTConfig", "Head", "LayerRecipe", "TIED_KEY",
           "TIED_WEIGHT_ATTR", "flops_per_token", "gpt_from_pipeline", "gpt_layers", "gpt_loss", "gpt_specs",
           "gpt_stage_layers", "gpt_tensor_plan", "head_forward"]

TIED_KEY = "embed"          # TiedLayerSpec key shared by Embedding and Head
TIED_WEIGHT_ATTR = "weight"  # the tied parameter's attribute name on both layers
_INIT_STD = 0.02


@dataclass(kw_only=True, slots=True, frozen=True)
class GPTConfig:
    """Model shape; vocab 256 means byte-level tokens."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 128   # longest sequence (learned positions)
    seed: int = 0        # initialisation seed (each layer derives its own)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig({name}={value!r}): expected a positive integer")
        if self.d_model % self.n_head:
            bigger = self.n_head * (self.d_model // self.n_head + 1)
            raise ValueError(f"GPTConfig(d_model={self.d_model}, n_head={self.n_head}): d_model must be "
                             f"a multiple of n_head; e.g. d_model={bigger}")


def _fill(module: nn.Module, seed: int) -> None:
    """Deterministic init from a private CPU generator: weights ~ N(0, 0.02), norms 1, biases 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * _INIT_STD)


def _seed(cfg: GPTConfig, index: int) -> int:
    return cfg.seed * 1_000_003 + index


class Embedding(nn.Module):
    """Token ids [B, T] -> hidden states [B, T, d]; `weight` is the tied token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.pos = nn.Parameter(torch.empty(cfg.seq_len, cfg.d_model))
        self.seq_len = cfg.seq_len  # also known while ZeRO-3 has `pos` partitioned
        _fill(self, _seed(cfg, 0))

    def forward(self, idx: Any, pos: torch.Tensor | None = None) -> Any:
        """pos [B, T]: position of each token (left-padded prompts start at 0); default 0..T-1.

        Packed rows (pipezero.train.data): idx = (ids, positions, segments) -> (hidden, segments),
        the segment ids travelling with the hidden states so every Block keeps attention inside
        each document."""
        if isinstance(idx, (tuple, list)):
            ids, positions, segments = idx
            return self.forward(ids, positions), segments
        if pos is None:
            if idx.size(-1) > self.pos.size(0):
                raise ValueError(f"sequence of {idx.size(-1)} tokens is longer than GPTConfig.seq_len="
                                 f"{self.pos.size(0)}; shorten it or raise seq_len")
            return F.embedding(idx, self.weight) + self.pos[: idx.size(-1)]
        return F.embedding(idx, self.weight) + F.embedding(pos, self.pos)


class Block(nn.Module):
    """Pre-LN transformer block: h + attn(ln(h)), then h + mlp(ln(h)).

    The qkv projection's output features are laid out head by head, (head, q|k|v, head_dim),
    as Megatron-LM does: a column-wise tensor-parallel split of qkv then gives every tensor
    rank whole heads with their own q, k and v (gpt_tensor_plan), and the block reads the
    head count from the width it gets, so the same forward runs whole or sharded.
    """

    tiles_compile_as = None  # compiled (pipe/compile.py): the MLP's row tiles run outside the graph

    def __init__(self, cfg: GPTConfig, index: int):
        super().__init__()
        d = cfg.d_model
        self.n_head, self.head_dim = cfg.n_head, d // cfg.n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.sequence: Any = None  # split_sequence's pipe.sequence.Ulysses: attention over the sequence group
        _fill(self, _seed(cfg, 1 + index))

    @classmethod
    def check_sequence(cls, cfg: GPTConfig, index: int, degree: int, tensor: int = 1) -> None:
        """Refuse a sequence degree the heads (each tensor rank's under gpt_tensor_plan) cannot be split
        by (pipe/sequence/'s SplitsSequence)."""
        from pipezero.pipe.sequence.attention import check_heads

        check_heads(cfg.n_head, cfg.n_head, degree, f"GPTConfig(n_head={cfg.n_head})", tensor)

    def split_sequence(self, group: Any, degree: int) -> None:
        """From now on h holds a slice of the sequence; attention exchanges it all-to-all for heads."""
        from pipezero.pipe.sequence.attention import Ulysses

        self.sequence = Ulysses(group, degree)

    def forward(self, h: Any, attn_mask: torch.Tensor | None = None, cache: Any = None) -> Any:
        """attn_mask [B, 1, T, keys] (True: attend) replaces the causal mask.

        cache (generate.py's LayerCache or StaticLayerCache): append(k, v) stores the new keys
        and values and returns the ones to attend over. h = (hidden, segments [B, T]) (packed
        rows): attention is causal within each segment only, each document attended on its own
        (pipe/document_attention.py: no [T, T] mask). The MLP runs in row tiles past
        pipe/tiled_mlp.py's threshold.
        """
        if isinstance(h, (tuple, list)):
            hidden, segments = h
            whole = segments if self.sequence is None else self.sequence.whole(segments)  # a slice: all keys
            return self._forward(hidden, None, None, documents_from_segments(whole)), segments
        return self._forward(h, attn_mask, cache, None)

    def _forward(self, h: torch.Tensor, attn_mask: torch.Tensor | None, cache: Any,
                 docs: Documents | None) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(self.ln1(h)), "b t (nh three hd) -> three b nh t hd",
                            three=3, hd=self.head_dim)  # nh: this tensor rank's heads
        if cache is not None:
            k, v = cache.append(k, v)
        if self.sequence is not None:  # this rank's slice: whole sequences of heads / degree (pipe/sequence/)
            att = self.sequence.heads_first(_attend, q, k, v, attn_mask, docs)
        else:
            att = _attend(q, k, v, attn_mask, docs)
        h = h + self.proj(rearrange(att, "b nh t hd -> b t (nh hd)"))
        return h + tiled_rows(self._mlp, self.ln2(h), compile_as=self.tiles_compile_as)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
            docs: Documents | None = None) -> torch.Tensor:
    """SDPA: each packed document on its own (no [T, T] mask), else causal unless a mask
    [B, 1, T, keys] (True: attend) is given."""
    if docs is not None:
        return document_attention(q, k, v, docs)
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class FinalNorm(nn.Module):
    """The LayerNorm before the head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        _fill(self, _seed(cfg, 1 + cfg.n_layer))

    def forward(self, h: Any) -> torch.Tensor:
        return self.ln(h[0] if isinstance(h, (tuple, list)) else h)  # packed rows: drop the segment ids


class Head(nn.Module):
    """Hidden states [B, T, d] -> logits [B, T, vocab] with the tied embedding weight."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        with torch.no_grad():  # the same values as Embedding.weight, built on any stage
            if self.weight.device.type != "meta":
                self.weight.copy_(Embedding(cfg).weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return head_forward(self, h)


def head_forward(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Logits from whichever module holds the tied weight (TiedLayerSpec's forward_fn for Head)."""
    return h @ getattr(module, TIED_WEIGHT_ATTR).t()


def _head_logits(module: nn.Module, h: torch.Tensor) -> Any:
    """The Head of gpt_specs(fused_loss=True): HeadLogits, the logits not yet computed."""
    from pipezero.pipe.fused_loss import HeadLogits

    return HeadLogits(h, getattr(module, TIED_WEIGHT_ATTR))


class LayerRecipe(NamedTuple):
    """One layer: its class, constructor arguments, and its tie key (None if untied)."""

    cls: type[nn.Module]
    args: tuple[Any, ...]
    tied_key: str | None = None


def gpt_layers(cfg: GPTConfig) -> list[LayerRecipe]:
    """The layers in order: Embedding, n_layer Blocks, FinalNorm, Head (tied to Embedding)."""
    return [LayerRecipe(Embedding, (cfg,), TIED_KEY),
            *(LayerRecipe(Block, (cfg, i)) for i in range(cfg.n_layer)),
            LayerRecipe(FinalNorm, (cfg,)),
            LayerRecipe(Head, (cfg,), TIED_KEY)]


def gpt_specs(cfg: GPTConfig, fused_loss: bool = False) -> list:
    """The layers as pipe LayerSpecs, Embedding and Head as TiedLayerSpecs of key TIED_KEY.

    fused_loss: the Head returns HeadLogits and gpt_loss never makes the logits whole (pipe/fused_loss.py).
    """
    from pipezero.pipe.spec import LayerSpec, TiedLayerSpec

    specs = []
    for r in gpt_layers(cfg):
        if r.tied_key is None:
            specs.append(LayerSpec(r.cls, *r.args))
        else:
            fwd = (_head_logits if fused_loss else head_forward) if r.cls is Head else None
            specs.append(TiedLayerSpec(r.tied_key, r.cls, *r.args, tied_weight_attr=TIED_WEIGHT_ATTR,
                                       forward_fn=fwd))
    return specs


def gpt_tensor_plan() -> Callable[[nn.Module], dict[str, Any] | None]:
    """PipelineModule(tensor_plan=...) for the GPT: Megatron-LM's split of each Block.

    qkv and fc column-wise (each tensor rank keeps whole heads, see Block), proj and out
    row-wise (one all-reduce after attention, one after the MLP; Shoeybi et al. 2019). The
    LayerNorms stay replicated. Embedding and Head have no plan: the tied embedding stays
    whole on every tensor rank (PipelineModule refuses a plan on a tied layer). n_head and
    4 * d_model must divide by the tensor degree (checked when the pipeline is built).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipezero.pipe.tensor_parallel import ColwiseHeads

    def plan(layer: nn.Module) -> dict[str, Any] | None:
        if not isinstance(layer, Block):
            return None
        return {"qkv": ColwiseHeads(layer.n_head), "proj": RowwiseParallel(),
                "fc": ColwiseParallel(), "out": RowwiseParallel()}
    return plan


def gpt_loss(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (of logits, or of gpt_specs(fused_loss=True)'s HeadLogits)."""
    from pipezero.pipe.fused_loss import fused_cross_entropy

    return fused_cross_entropy(logits, targets)


class GPT(nn.Module):
    """The single-process model built from the same layers: the truth for parity tests.

    `layers.i` is layer i of gpt_layers(cfg); layers.{n_layer + 2}.weight IS layers.0.weight.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(r.cls(*r.args) for r in gpt_layers(cfg))
        self.layers[-1].weight = self.layers[0].weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for every position of idx [B, T]; no KV cache, the whole sequence each call."""
        h = idx
        for layer in self.layers:
            h = layer(h)
        return h

    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None, **kwargs: Any) -> torch.Tensor:
        """generate(self.layers, ...): see pipezero/train/gpt/generate.py."""
        return _generation().generate(self.layers, idx, new_tokens, temperature=temperature, generator=generator,
                                      **kwargs)


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6N + 12 * n_layer * d_model * seq_len (forward + backward).

    N counts the weights that multiply activations (every parameter except the position
    table, the tied embedding once: it is the head's matmul); the second term is attention's
    QK^T and AV (Kaplan et al. 2020; Chowdhery et al. 2022, PaLM, appendix B, for MFU).
    """
    d, layers = cfg.d_model, cfg.n_layer
    per_block = 12 * d * d + 13 * d   # qkv+proj+fc+out weights and biases, two LayerNorms
    n = cfg.vocab_size * d + layers * per_block + 2 * d
    return 6.0 * n + 12.0 * layers * d * cfg.seq_len


# -- generation: generate.py beside this file -----------------------------------------------------
def _generation():
    """pipezero.train.gpt.generate, imported on first use, not at the top: it imports this module's layers."""
    return importlib.import_module("pipezero.train.gpt.generate")


def gpt_from_pipeline(module: nn.Module, cfg: GPTConfig) -> "GPT":
    """The whole GPT on every pipeline rank: each stage broadcasts its layers over the pipe group.

    The pipeline's generation policy: the weights are gathered over the pipe group when they
    fit (an RLHF actor's are small next to its training state), then each rank generates on
    its own with the KV cache; free the returned model after the generation phase.
    """
    import torch.distributed as dist
    from pipezero.pipe.schedule.placement import owner
    from pipezero.pipe.tensor_parallel import whole_tensor

    grid = module.grid
    if module.bounds[-1] != len(gpt_layers(cfg)):
        raise ValueError(f"gpt_from_pipeline: the pipeline has {module.bounds[-1]} layers, GPTConfig(n_layer="
                         f"{cfg.n_layer}) has {len(gpt_layers(cfg))}; pass the config the pipeline was built from")
    with torch.device("meta"):
        full = GPT(cfg)
    full.to_empty(device=module.device)
    local = dict(module.named_parameters())
    for index, layer in enumerate(full.layers[:-1]):  # the Head's weight is layer 0's (tied)
        stage = next(s for s in range(len(module.bounds) - 1) if module.bounds[s] <= index < module.bounds[s + 1])
        src = grid.rank_of(pipe=owner(stage, module.num_stages, module.placement)[0],
                           data=grid.data_rank, tensor=grid.tensor_rank)
        prefix = f"tied.{TIED_KEY}." if index == 0 else f"layers.{index}."
        for name, p in layer.named_parameters():
            if src == grid.rank:
                p.data.copy_(whole_tensor(local[prefix + name]).detach())  # TP: whole, a collective
            if module.num_stages > 1:
                dist.broadcast(p.data, src=src, group=grid.pipe_group)
    full.layers[-1].weight = full.layers[0].weight
    return full


def gpt_stage_layers(module: nn.Module) -> list:
    """The layers of a one-stage pipeline in order, for generate(): tensor-parallel generation.

    With a tensor plan (gpt_tensor_plan) each tensor rank keeps its heads' slice of every
    Block, so generate() runs tensor-parallel: each rank caches keys and values of its own
    heads only, and the row-wise projections all-reduce as in training.
    """
    if module.num_stages * module.num_chunks != 1:
        raise ValueError(f"gpt_stage_layers: the pipeline has {module.num_stages * module.num_chunks} stages; "
                         "generation over pipe > 1 gathers the weights: generate(gpt_from_pipeline(...).layers, ...)")
    tied = module.tied[TIED_KEY]
    blocks = [module.layers[str(i)] for i in range(1, module.bounds[-1] - 1)]
    return [tied, *blocks, lambda h: head_forward(tied, h)]
