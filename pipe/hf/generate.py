"""Generation from the training weights of a PipelineModule built with hf_layer_specs.

The RLHF actor (examples/grpo_arithmetic.py) samples from the very parameters it trains: no
second copy, no weight sync to an inference engine. `hf_generate(module, ids, n)` runs the
pipeline's own layers with a KV cache per microbatch (each decoder layer's keys and values at
its global layer index, so one cache serves all the layers a stage holds): the static cache
below, or with static_cache=False a transformers `DynamicCache` per local chunk and masks built
by transformers' own causal / sliding-window functions sized from it. Greedy (temperature=0) or
sampled (temperature, top-k, top-p), left-padded batches (positions from the attention mask, as
`model.generate` counts them), stop tokens (a finished row emits pad_token_id; a microbatch
whose rows all finished stops running, checked every 8 steps so that the device is not waited
for every token; the output ends where transformers' generate ends it).

The static decode path (the default where the layers allow it): each microbatch's keys
and values live in a preallocated pipe/hf/static_cache.StaticKVCache of prompt + n columns,
the step's token, positions and cache column are device tensors updated in place, so every
decode step has the same shapes; on CUDA each local chunk's decode step is captured once per
call as a CUDA graph (pipe/cuda_graph.py) and replayed for every further token. The graphs
and caches live only for the call: under ZeRO-3 a graph of one `gathered(opt)` phase is never
replayed on weights freed at its end. On CPU the same static step runs eagerly.

Where the weights are:
- ZeRO 0-2, pipe=1: whole on every rank; just call it.
- ZeRO-3: inside `pipezero.zero.gathered(opt)`, which gathers the shards once for the phase
  (`layers_at_a_time=k` streams them instead); outside it the stage-3 hooks gather per
  layer per token, which is correct and slow.
- pipe > 1: prompts are split into `microbatches` (default: the number of stages) that flow
  through the stages; each stage keeps only its own layers' weights and its own KV caches;
  the last stage picks each microbatch's next tokens and broadcasts them over the pipe
  group, and stage 0 starts that microbatch's next step. Every rank returns all tokens.

Compared with gathering the whole model onto each rank (`gpt_from_pipeline` for the GPT): a
stage needs 1/pipe of the weights and of the KV cache, so a model that fits only split still
generates, and nothing is copied before the phase; the price is a point-to-point hop per
stage per token and a pipeline bubble of (stages - 1) / (microbatches + stages - 1) of each
step, less than gathering when weights are large and the batch is split into >= stages
microbatches. Gathering instead makes every rank a whole replica that decodes its own
prompts with no per-token traffic, which is faster whenever the whole model and its cache fit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from pipezero.pipe.cuda_graph import capture_step
from pipezero.pipe.hf import HFDecoderLayer, hf_config
from pipezero.pipe.hf.static_cache import STATIC_ATTENTION, StaticKVCache
from pipezero.pipe.schedule.placement import owner

__all__ = ["Sampling", "hf_generate"]

_CHECK_EVERY = 8  # steps between checks whether every row has stopped (each check waits for the device)


@dataclass(kw_only=True, slots=True, frozen=True)
class Sampling:
    """How the next token is chosen from the last position's logits."""

    temperature: float = 0.0     # 0: greedy (argmax); else logits / temperature are sampled
    top_k: int | None = None     # keep the k most likely tokens
    top_p: float | None = None   # keep the smallest set whose probability reaches top_p (nucleus)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"Sampling(temperature={self.temperature!r}): expected >= 0 (0 is greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"Sampling(top_k={self.top_k!r}): expected None or an integer >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling(top_p={self.top_p!r}): expected None or a float in (0, 1]")

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """[b, vocab] logits -> [b] token ids."""
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = logits.topk(self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = logits.sort(-1, descending=True)
            before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # probability of the tokens ahead
            drop = (before >= self.top_p).scatter(-1, order, before >= self.top_p)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@dataclass(slots=True)
class _Microbatch:
    """One microbatch's state: what to feed next, its mask and positions so far, caches, new tokens."""

    feed: torch.Tensor            # [b, T] token ids to run (the prompt, then the last new token)
    mask: torch.Tensor            # [b, seen + T] 1 = token, 0 = left padding
    positions: torch.Tensor       # [b, T] position ids of `feed`
    done: torch.Tensor            # [b] bool: the row emitted a stop token
    caches: dict[int, Any] = field(default_factory=dict)  # local chunk -> DynamicCache
    new: list[torch.Tensor] = field(default_factory=list)  # [b] per step
    static: StaticKVCache | None = None  # the static decode path: every local layer's keys and values
    decoding: bool = False               # static: feed, positions and the cache column are fixed buffers now
    inbox: dict[int, torch.Tensor] = field(default_factory=dict)  # stage -> fixed buffer of its input hidden
    graphs: dict[int, Callable[[], torch.Tensor] | None] = field(default_factory=dict)  # chunk -> replay

    stopped: bool = False  # every row had stopped when last checked (a host sync, every _CHECK_EVERY steps)

    @property
    def finished(self) -> bool:
        return bool(self.done.all())


class _Route:
    """Who holds each virtual stage of this rank's pipeline, and the hops between them."""

    def __init__(self, module: Any):
        grid = module.grid
        self.grid, self.me = grid, grid.pipe_rank
        self.stages = module.num_virtual_stages
        self.rank_of_stage = [owner(v, module.num_stages, module.placement)[0] for v in range(self.stages)]
        self.chunk_of_stage = {v: module.stage_ids.index(v) for v in range(self.stages)
                               if self.rank_of_stage[v] == self.me}
        self.root = self.rank_of_stage[-1]  # picks the tokens
        self.sends: list[Any] = []

    def global_rank(self, pipe_rank: int) -> int:
        return self.grid.rank_of(pipe=pipe_rank)

    def send(self, hidden: torch.Tensor, stage: int) -> None:
        hidden = hidden.contiguous()
        self.sends.append((dist.isend(hidden, dst=self.global_rank(self.rank_of_stage[stage])), hidden))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, stage: int,
             into: torch.Tensor | None = None) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device) if into is None else into
        dist.recv(buf, src=self.global_rank(self.rank_of_stage[stage]))
        return buf

    def share(self, tokens: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The root's new tokens [b] on every pipe rank (a broadcast over the pipe group)."""
        if self.grid.pipe_size == 1:
            return tokens
        buf = tokens if self.me == self.root else torch.empty_like(like)
        dist.broadcast(buf, src=self.global_rank(self.root), group=self.grid.pipe_group)
        return buf

    def finish(self) -> None:
        for handle, _ in self.sends:
            handle.wait()
        self.sends.clear()


def hf_generate(module: Any, input_ids: torch.Tensor, max_new_tokens: int,
                attention_mask: torch.Tensor | None = None, sampling: Sampling = Sampling(),
                stop_tokens: Sequence[int] = (), pad_token_id: int | None = None,
                microbatches: int | None = None, generator: torch.Generator | None = None,
                static_cache: bool | None = None, cuda_graph: bool | None = None) -> torch.Tensor:
    """[B, P] prompts (left-padded; attention_mask 1 = token) -> [B, P + n] prompts and new tokens.

    A right-padded mask (a 0 after a 1) is refused: the new tokens would follow the padding.

    module: a PipelineModule of hf_layer_specs (tensor=1); every pipe rank of one data replica
    passes the same prompts and gets the same tokens. n <= max_new_tokens: generation stops
    when every row has emitted one of stop_tokens; rows that stopped earlier are filled with
    pad_token_id (default: the first stop token, else 0), as transformers' generate fills them.
    generator: the sampling RNG, used on the rank holding the LM head.
    static_cache: the preallocated cache with static-shape decode steps (None: where the
    layers allow it, sdpa or eager attention without chunked layers; False: DynamicCache).
    cuda_graph: replay each decode step as a CUDA graph (None: on for CUDA with the static
    cache, off where the weights are not whole for the call; True raises instead).
    """
    mask = _check(module, input_ids, max_new_tokens, attention_mask, microbatches)
    attention = _static_attention(module, static_cache, cuda_graph, input_ids)
    route = _Route(module)
    pad = pad_token_id if pad_token_id is not None else (stop_tokens[0] if stop_tokens else 0)
    n_micro = microbatches or min(input_ids.size(0), max(module.grid.pipe_size, 1))
    stops = torch.tensor(list(stop_tokens), dtype=torch.long, device=input_ids.device)
    capacity = input_ids.size(1) + max_new_tokens
    batches = [_start(ids, m, capacity, attention) for ids, m in zip(input_ids.tensor_split(n_micro),
                                                                        mask.tensor_split(n_micro))]
    config = hf_config(module)
    pending: list[tuple[_Microbatch, torch.Tensor | None]] = []  # tokens picked, not yet shared (FIFO)
    with torch.no_grad():
        for step in range(max_new_tokens):
            if all(mb.stopped for mb in batches):
                break
            check = bool(stop_tokens) and step % _CHECK_EVERY == 0  # a host sync: only every few steps
            for mb in batches:
                while any(waiting is mb for waiting, _ in pending):  # mb's last tokens, and all picked before
                    _share(route, *pending.pop(0), stops, pad)
                if check:  # here every rank has shared mb's tokens so far: all decide alike
                    mb.stopped = mb.finished
                if mb.stopped:
                    continue
                pending.append((mb, _step(module, route, mb, config, sampling, generator, cuda_graph)))
                if route.me == route.root:  # the root shares at once, the others when they need the tokens
                    _share(route, *pending.pop(0), stops, pad)
        while pending:
            _share(route, *pending.pop(0), stops, pad)
    route.finish()
    out = _assemble(input_ids, batches, pad, stops)
    for mb in batches:  # the graphs' memory and the KV caches go now, not when the caller drops them
        mb.graphs.clear()
        if mb.static is not None:
            mb.static.free()
    return out


# -- one step of one microbatch ---------------------------------------------------------
def _step(module: Any, route: _Route, mb: _Microbatch, config: Any, sampling: Sampling,
          generator: torch.Generator | None, cuda_graph: bool | None) -> torch.Tensor | None:
    """Run mb's feed through this rank's virtual stages; the root returns the chosen tokens [b]."""
    from transformers import DynamicCache

    hidden = None
    for stage, chunk in sorted(route.chunk_of_stage.items()):
        cache = mb.static if mb.static is not None else mb.caches.setdefault(chunk, DynamicCache(config=config))
        if stage > 0 and route.rank_of_stage[stage - 1] != route.me:
            shape = (*mb.feed.shape, config.hidden_size)
            hidden = route.recv(shape, _dtype(module), mb.feed.device, stage - 1, into=mb.inbox.get(stage))
        last = stage == route.stages - 1
        out = _forward(module, mb, stage, chunk, hidden, cache, last, cuda_graph)
        if last:
            return sampling.choose(out, generator)
        hidden = out
        if route.rank_of_stage[stage + 1] != route.me:  # a graph's output is overwritten by its next replay,
            route.send(hidden.clone() if mb.decoding else hidden, stage + 1)  # maybe before the send read it
    return None


def _forward(module: Any, mb: _Microbatch, stage: int, chunk: int, hidden: torch.Tensor | None, cache: Any,
             last: bool, cuda_graph: bool | None) -> torch.Tensor:
    """One chunk of one step: the hidden states it passes on, or (last) the last position's logits [b, vocab].

    A static decode step reads only fixed buffers, so on CUDA it is captured at its first run
    (the warm-up before the capture is that run) and replayed after."""
    if mb.decoding and stage > 0:  # the input at a fixed address (a graph replays it)
        inbox = mb.inbox.setdefault(stage, torch.empty_like(hidden))
        if inbox is not hidden:
            inbox.copy_(hidden)
        hidden = inbox

    def run() -> torch.Tensor:
        if mb.static is not None:
            mb.static.fresh_masks()  # inside the capture: every replay makes this step's masks
        x = (mb.feed, mb.mask, mb.positions, cache) if stage == 0 else (hidden, mb.positions, mb.mask, cache)
        out = module(x, chunk=chunk)
        if not last:
            return out[0]
        logits = out.logits() if hasattr(out, "logits") else out  # HeadLogits (fused_loss=True)
        return logits[:, -1]
    if not (mb.decoding and mb.feed.is_cuda and cuda_graph is not False):
        return run()
    if chunk not in mb.graphs:
        mb.graphs[chunk] = capture_step(run, [module], mb.feed.device, required=cuda_graph is True)
    replay = mb.graphs[chunk]
    return replay() if replay is not None else run()


def _share(route: _Route, mb: _Microbatch, tokens: torch.Tensor | None, stops: torch.Tensor, pad: int) -> None:
    """Every pipe rank learns mb's new tokens (in the order the root picked them) and advances mb.

    The root broadcasts right after picking; the other ranks join when they next need mb, so
    stage 0 runs the other microbatches meanwhile (the broadcasts match in the same order)."""
    _advance(mb, route.share(tokens, mb.done.long()), stops, pad)


def _advance(mb: _Microbatch, tokens: torch.Tensor, stops: torch.Tensor, pad: int) -> None:
    """Record the new tokens (pad where a row had stopped); the next step feeds them."""
    tokens = torch.where(mb.done, torch.full_like(tokens, pad), tokens)
    mb.new.append(tokens)
    mb.done = mb.done | torch.isin(tokens, stops)
    if mb.decoding:  # the static decode step's buffers, in place
        mb.feed.copy_(tokens[:, None])
        mb.positions.add_(1)
        mb.static.advance()
        return
    mb.feed = tokens[:, None]
    mb.positions = mb.positions[:, -1:] + 1
    if mb.static is not None:  # after the prefill: from now on fixed buffers
        mb.feed = mb.feed.clone()
        mb.static.start_decoding(mb.mask.size(1))
        mb.decoding = True
        return
    mb.mask = torch.cat([mb.mask, mb.mask.new_ones(mb.mask.size(0), 1)], dim=1)


def _start(ids: torch.Tensor, mask: torch.Tensor, capacity: int, attention: str | None) -> _Microbatch:
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as transformers' generate counts them
    static = StaticKVCache(mask, capacity, attention) if attention is not None else None
    return _Microbatch(feed=ids, mask=mask, positions=positions, static=static,
                       done=torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device))


def _assemble(input_ids: torch.Tensor, batches: list[_Microbatch], pad: int, stops: torch.Tensor) -> torch.Tensor:
    """Prompts and new tokens, cut after the step where the last row stopped (as transformers' generate
    ends): stops are checked every few steps, so a batch may have run a few all-pad steps more."""
    steps = max(len(mb.new) for mb in batches)
    rows = []
    for mb in batches:
        new = torch.stack(mb.new, 1) if mb.new else input_ids.new_empty(mb.done.size(0), 0)
        rows.append(torch.nn.functional.pad(new, (0, steps - new.size(1)), value=pad))
    new = torch.cat(rows)
    if stops.numel() and new.size(1):
        hit = torch.isin(new, stops)
        if bool(hit.any(-1).all()):  # every row stopped: keep up to the last row's first stop token
            new = new[:, :int(hit.float().argmax(-1).max()) + 1]
    return torch.cat([input_ids, new], dim=1)


def _static_attention(module: Any, static_cache: bool | None, cuda_graph: bool | None,
                      ids: torch.Tensor) -> str | None:
    """The attention implementation the static cache builds masks for, or None: the DynamicCache path."""
    attention = hf_config(module)._attn_implementation
    chunked = sorted({layer.index for layer in module.modules()
                      if isinstance(layer, HFDecoderLayer) and layer.attention_kind == "chunked_attention"})
    why = (f"config._attn_implementation={attention!r} (it builds masks for {STATIC_ATTENTION})"
           if attention not in STATIC_ATTENTION else f"layers {chunked} use chunked attention" if chunked else "")
    if static_cache and why:
        raise ValueError(f"hf_generate(static_cache=True): {why}; pass static_cache=None or False (DynamicCache)")
    if cuda_graph and (static_cache is False or why):
        raise ValueError(f"hf_generate(cuda_graph=True) replays the static decode step, which is off "
                         f"({why or 'static_cache=False'}); pass cuda_graph=None or False")
    if cuda_graph and not ids.is_cuda:
        raise ValueError(f"hf_generate(cuda_graph=True): input_ids are on {ids.device}, CUDA graphs need CUDA "
                         "tensors; pass cuda_graph=None (on only for CUDA)")
    return None if static_cache is False or why else attention


def _dtype(module: Any) -> torch.dtype:
    """The dtype hidden states travel in: the layers' (the inference dtype inside gathered(dtype=))."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def _check(module: Any, ids: Any, n: Any, mask: Any, microbatches: Any) -> torch.Tensor:
    """The attention mask (ones when None); every bad argument named, on every rank, before any message."""
    from pipezero.pipe.module import PipelineModule

    if not isinstance(module, PipelineModule):
        raise TypeError(f"hf_generate(module={type(module).__name__}): expected the PipelineModule of "
                        "hf_layer_specs; a whole transformers model has its own model.generate")
    hf_config(module)  # a ValueError when the module holds no hf_layer_specs layer
    for layer in module.modules():
        if isinstance(layer, HFDecoderLayer) and "cache" not in inspect.signature(type(layer.inner).forward).parameters:
            raise ValueError(f"hf_generate: {type(layer.inner).__name__}.forward takes no `cache` argument "
                             "(transformers >= 5 names the KV cache so); this family cannot decode with a cache here")
    if module.grid.tensor_size != 1:
        raise ValueError(f"hf_generate: tensor={module.grid.tensor_size} is not supported; generate with "
                         "tensor=1 (pipe and data axes are)")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or ids.size(0) == 0:
        raise ValueError(f"hf_generate(input_ids): expected a non-empty [batch, prompt] int64 tensor, got "
                         f"{_describe(ids)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"hf_generate(max_new_tokens={n!r}): expected an integer >= 1")
    if mask is None:
        mask = torch.ones_like(ids)
    if mask.shape != ids.shape:
        raise ValueError(f"hf_generate: attention_mask of shape {tuple(mask.shape)} does not match input_ids "
                         f"{tuple(ids.shape)}; expected the same [batch, prompt] shape, 0 on left padding")
    mask = mask.long()
    if not bool((mask.sum(-1) > 0).all()):
        raise ValueError("hf_generate: a row of attention_mask is all zeros; every prompt needs >= 1 token")
    rows = (mask[:, 1:] < mask[:, :-1]).any(-1).nonzero()[:, 0].tolist()  # a 0 after a 1
    if rows:
        raise ValueError(f"hf_generate: attention_mask rows {rows[:8]} have padding after a token (row {rows[0]}: "
                         f"{mask[rows[0]].tolist()}, right padding); new tokens follow the last column, so pad "
                         "the prompts on the left (tokenizer.padding_side = 'left'), as generation expects")
    if microbatches is not None and (not isinstance(microbatches, int) or not 1 <= microbatches <= ids.size(0)):
        raise ValueError(f"hf_generate(microbatches={microbatches!r}): expected None or 1..batch={ids.size(0)}")
    return mask


def _describe(x: object) -> str:
    """A tensor's shape and dtype, or another object's type, for an error message."""
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
