"""Generation for model.py's layers: KV cache, left-padded batches, a CUDA-graph decode step.

    python examples/generate.py --checkpoint runs/gpt --prompt "def " --tokens 200   # sample the main job's model

`generate(layers, idx, n)` is greedy (temperature=0) or sampled (temperature, top-k). It runs
on any list of the GPT's layers: a GPT's, a ZeRO-3 model's inside
`pipezero.zero.gathered.gathered(opt)` (the weights gathered once for the phase), a
tensor-parallel stage's (`gpt_stage_layers`), or, for a pipeline, the whole model gathered
over the pipe group (`gpt_from_pipeline`).

With the KV cache the prompt runs once (prefill), then every new token runs one decode step
whose tensor shapes never change: the cache buffers hold all positions, the new keys and
values are written at a position held in a device tensor, and attention runs over every
position under a mask of the keys written so far. On CUDA that step is captured once per
call into a CUDA graph and replayed for each token, so a token costs one graph launch
instead of hundreds of small kernel launches from Python (the decode loop of a 1B model is
launch-bound). A graph replays fixed addresses: the weights must stay put for the whole
call (a plain model, or ZeRO-3 inside one `gathered(opt)` without layers_at_a_time, where
the stage-3 hooks are paused); otherwise the step runs without a graph.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from pipezero.pipe.cuda_graph import capture_step
from pipezero.train.gpt.model import GPT, Block, Embedding, FinalNorm, GPTConfig

__all__ = ["KVCache", "LayerCache", "StaticLayerCache", "generate", "load_exported", "main"]


class LayerCache:
    """One block's keys and values [B, heads, capacity, head_dim], filled left to right."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k, v; return every position's so far."""
        if self.k is None:  # the dtype and device the block computes in; zeros: masked keys stay finite
            shape = (*k.shape[:2], self.capacity, k.shape[-1])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        end = self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions, {end} requested")
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache(list):
    """A LayerCache per Block: each block appends its keys and values instead of recomputing them."""

    def __init__(self, n_blocks: int, capacity: int):
        super().__init__(LayerCache(capacity) for _ in range(n_blocks))


class StaticLayerCache:
    """A filled LayerCache's buffers, written at the position in `index` (a device tensor [1]).

    append returns the whole buffers, so the shapes a Block sees never change: the decode
    step can be captured into a CUDA graph. The attention mask hides the positions not written.
    """

    def __init__(self, cache: LayerCache, index: torch.Tensor):
        self.k, self.v, self.index = cache.k, cache.v, index

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.index_copy_(2, self.index, k)
        self.v.index_copy_(2, self.index, v)
        return self.k, self.v


def _attention_mask(valid: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """[B, 1, length, start + length] bool: causal and not a padding key.

    A padding query may always see itself, so its softmax row is never empty (no NaN); its
    output is never used.
    """
    keys = torch.arange(start + length, device=valid.device)
    queries = torch.arange(start, start + length, device=valid.device)[:, None]
    causal = keys <= queries
    return ((causal & valid[:, None, :start + length]) | (keys == queries))[:, None]


def _positions(valid: torch.Tensor) -> torch.Tensor:
    """Position of each token counting real tokens only, so a left-padded prompt starts at 0."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def _logits(layers, idx, pos, mask, cache: list | None) -> torch.Tensor:
    """Run the layers over idx [B, t]; logits [B, vocab] of the last position."""
    h, block = idx, 0
    for layer in layers:
        if isinstance(layer, Embedding):
            h = layer(h, pos)
        elif isinstance(layer, Block):
            h = layer(h, mask, cache[block] if cache is not None else None)
            block += 1
        else:
            if isinstance(layer, FinalNorm):
                h = h[:, -1:]  # only the last position's logits are needed
            h = layer(h)
    return h[:, -1].float()


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None,
          generator: torch.Generator | None) -> torch.Tensor:
    """Next token [B, 1]: argmax when temperature is 0, else a sample of softmax(logits / T) over the top k."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def _check_generate(layers, idx, new_tokens, temperature, top_k, mask) -> tuple[int, int]:
    """(blocks, seq_len) of the layers after checking the arguments."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype != torch.long:
        raise TypeError(f"generate: idx must be a [batch, tokens] LongTensor, got {getattr(idx, 'shape', idx)!r}")
    if not isinstance(new_tokens, int) or new_tokens < 0:
        raise ValueError(f"generate: new_tokens={new_tokens!r}, expected an integer >= 0")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(f"generate: temperature={temperature} must be >= 0 (0: greedy) and top_k={top_k} "
                         "None or >= 1")
    if mask is not None and mask.shape != idx.shape:
        raise ValueError(f"generate: attention_mask of shape {tuple(mask.shape)} must match idx "
                         f"{tuple(idx.shape)} (1 for tokens, 0 for left padding)")
    embed = next((m for m in layers if isinstance(m, Embedding)), None)
    if embed is None:
        raise TypeError("generate: the layers hold no Embedding; pass GPT.layers (or gpt_from_pipeline(...).layers)")
    return sum(isinstance(m, Block) for m in layers), embed.seq_len


def _check_graph(cuda_graph: bool | None, use_cache: bool, idx: torch.Tensor) -> None:
    """cuda_graph=True needs the KV cache and CUDA tensors."""
    if cuda_graph and not use_cache:
        raise ValueError("generate(cuda_graph=True) replays the KV-cache decode step, but the cache is off "
                         f"(use_cache=False, or {idx.size(1)} prompt + new tokens exceed seq_len); pass "
                         "cuda_graph=None or False")
    if cuda_graph and not idx.is_cuda:
        raise ValueError(f"generate(cuda_graph=True): idx is on {idx.device}, CUDA graphs need CUDA tensors; "
                         "move the model and prompts to a GPU, or pass cuda_graph=None (on only for CUDA)")


@torch.no_grad()
def generate(layers, idx: torch.Tensor, new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             attention_mask: torch.Tensor | None = None, use_cache: bool | None = None,
             generator: torch.Generator | None = None, cuda_graph: bool | None = None) -> torch.Tensor:
    """Extend idx [B, T] by new_tokens tokens: greedy (temperature=0) or sampled (temperature, top_k).

    attention_mask [B, T] (1 token, 0 padding) lets prompts of different lengths share a batch,
    left-padded: padding keys are masked out and positions count real tokens only, so each row
    gets the tokens it would get alone. With the KV cache (use_cache=True; None: when
    T + new_tokens fits in seq_len) the prompt is run once and each new token costs one
    position per layer; without it every step reruns the whole sequence (the last seq_len
    tokens). Both run the same layers through their __call__, so module hooks (ZeRO-3) see them.
    cuda_graph (None: on for CUDA tensors with the cache) replays the decode step as a CUDA
    graph; it needs weights that stay put for the call (else None falls back, True raises).
    """
    blocks, seq_len = _check_generate(layers, idx, new_tokens, temperature, top_k, attention_mask)
    total = idx.size(1) + new_tokens
    if use_cache is None:
        use_cache = total <= seq_len
    if use_cache and total > seq_len:
        raise ValueError(f"generate: {idx.size(1)} prompt + {new_tokens} new tokens exceed seq_len={seq_len} "
                         "(the KV cache holds seq_len positions); pass use_cache=False to slide a window")
    _check_graph(cuda_graph, use_cache, idx)
    valid = torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.bool()

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return _pick(logits, temperature, top_k, generator)
    if not use_cache:
        return _generate_windowed(layers, idx, valid, new_tokens, seq_len, pick)
    return _generate_cached(layers, idx, valid, new_tokens, blocks, pick, cuda_graph)


def _generate_windowed(layers, idx, valid, new_tokens: int, seq_len: int, pick: Callable) -> torch.Tensor:
    """No cache: every token reruns the whole sequence (its last seq_len tokens)."""
    out, ones = idx, torch.ones_like(valid[:, :1])
    for _ in range(new_tokens):
        start = max(0, out.size(1) - seq_len)
        window = valid[:, start:]
        logits = _logits(layers, out[:, start:], _positions(window), _attention_mask(window, 0, window.size(1)), None)
        out = torch.cat([out, pick(logits)], dim=1)
        valid = torch.cat([valid, ones], dim=1)
    return out


def _generate_cached(layers, idx, valid, new_tokens: int, blocks: int, pick: Callable,
                     cuda_graph: bool | None) -> torch.Tensor:
    """Prefill the KV cache with the prompt, then one static-shape decode step per further token."""
    if new_tokens == 0:
        return idx
    (b, t), device = idx.shape, idx.device
    cache = KVCache(blocks, t + new_tokens)
    out = torch.cat([idx, idx.new_zeros(b, new_tokens)], dim=1)
    out[:, t:t + 1] = pick(_logits(layers, idx, _positions(valid), _attention_mask(valid, 0, t), cache))
    # the step's inputs, updated in place: token and its position [B, 1], the write index [1],
    # the mask [B, 1, 1, capacity] of the keys written (prompt padding stays False)
    token, index = out[:, t:t + 1].clone(), torch.full((1,), t, dtype=torch.long, device=device)
    count = valid.sum(-1, keepdim=True)  # real prompt tokens: the first new token's position
    pos = count.clone()
    mask = torch.zeros(b, 1, 1, t + new_tokens, dtype=torch.bool, device=device)
    mask[:, 0, 0, :t] = valid
    static = [StaticLayerCache(c, index) for c in cache]
    graphed = cuda_graph if cuda_graph is not None else idx.is_cuda

    def step() -> torch.Tensor:
        return _logits(layers, token, pos, mask, static)
    run = step
    for p in range(t, t + new_tokens - 1):  # p: the position of the token fed in
        token.copy_(out[:, p:p + 1])
        index.fill_(p)
        torch.add(count, p - t, out=pos)
        mask[:, 0, 0, p] = True
        if p == t and graphed:  # captured with the first step's inputs in place
            run = capture_step(step, [m for m in layers if isinstance(m, nn.Module)], device,
                               required=cuda_graph is True) or step
        out[:, p + 1:p + 2] = pick(run())
    return out


# -- the sampling command -------------------------------------------------------------------------

def load_exported(path: str | Path) -> GPT:
    """The GPT that train_gpt.py exported: `path` is its --out folder or the model.safetensors file.

    The file's header holds the model's GPTConfig as JSON ("gpt_config"), so the shape is
    never guessed from flags.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: pass the --out folder of a finished train_gpt.py run "
                                "(it exports model.safetensors there at the end)")
    with safe_open(str(file), framework="pt") as f:
        config = (f.metadata() or {}).get("gpt_config")
    if config is None:
        raise ValueError(f"{file} records no model config (exported before configs were recorded): "
                         "run train_gpt.py again with the same --out to re-export it")
    model = GPT(GPTConfig(**json.loads(config)))
    model.load_state_dict(load_file(str(file)))
    return model.eval()


def main(argv: list[str] | None = None) -> str:
    """Sample text from an exported model; prints and returns the prompt plus the new text."""
    p = argparse.ArgumentParser(description="sample from the GPT that examples/train_gpt.py exported",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default="runs/gpt", help="train_gpt.py's --out folder, or a .safetensors file")
    p.add_argument("--prompt", default="def ", help="text to continue (byte tokens)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    model = load_exported(args.checkpoint).to(args.device)
    idx = torch.tensor([list(args.prompt.encode("utf-8"))], device=args.device)
    gen = torch.Generator(args.device).manual_seed(args.seed)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print(text)
    return text


if __name__ == "__main__":
    main()
