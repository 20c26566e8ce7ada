"""Host bytes the offloads pin: one block per buffer as torch's pinned allocator takes it, against one arena.

    python bench/pinned_host.py        # TinyLlama and the Llama-3-8B, ZeRO 1-3, the checkpointed inputs; CPU

Sizes only (no GPU, no allocation): the models are built on the meta device and cut into ZeRO buckets by
zero/partition.py's plan_groups with the planner's ds_config (reduce_bucket_size d x d). For each rank's
shards: the fp32 masters, the gradients' landing (fp32 at stages 0-1; bf16 beside an fp32 sum at 2-3),
as zero/offload.py allocates them on a GPU, counted three ways:
* per bucket: a pinned block per buffer, each rounded up to a power of two bytes (CachingHostAllocator:
  the code before the arenas);
* one block: each kind's buffers in one torch.empty(..., pin_memory=True), rounded once, but the whole;
* arena: each kind one allocation of its exact bytes, registered (comm/host_arena.py: the code now).
Adam's moments (8 bytes a parameter, never pinned) are added to each total. Then one checkpointed input
of TinyLlama (one [tokens, 2048] bf16 row) at a few lengths: a rounded block against its exact bytes.
"""

from __future__ import annotations

import argparse
import math

import torch

from pipezero.comm import arena_bytes
from pipezero.zero.partition import plan_groups
from pipezero.zero.reduction import Reduction

SHAPES = {  # (vocab, hidden, intermediate, layers, heads, kv heads)
    "tinyllama": (32000, 2048, 5632, 22, 32, 4),
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8),
}
CASES = [(1, 1), (2, 8), (3, 1)]  # (ZeRO stage, data ranks)
GB = 1e9


def pow2(nbytes: int) -> int:
    """What CUDA's caching host allocator takes for a block of nbytes."""
    return 2 ** math.ceil(math.log2(nbytes)) if nbytes > 0 else 0


def shards(shape: tuple, stage: int, parts: int) -> list[int]:
    """Elements of each bucket's shard on one rank, as ZeroOptimizer cuts them."""
    import transformers

    vocab, d, inter, layers, heads, kv = shape
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=inter,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    buckets = plan_groups([{"params": list(model.parameters())}], d * d, [Reduction(None, parts, 0, parts)],
                          True, model if stage == 3 else None, [float("inf")])
    return [b.shard_numel for b in buckets]


def kinds(stage: int) -> tuple[int, ...]:
    """Bytes per element of each pinned kind: the master, then the landing (and the sum at 2-3), bf16."""
    return (4, 4) if stage <= 1 else (4, 2, 4)


def optimizer_row(name: str, shape: tuple, stage: int, parts: int) -> str:
    s = shards(shape, stage, parts)
    pinned = [[e * n for n in s] for e in kinds(stage)]
    moments = 8 * sum(s)
    exact = sum(map(sum, pinned)) + moments
    per_bucket = sum(pow2(n) for kind in pinned for n in kind) + moments
    one_block = sum(pow2(sum(kind)) for kind in pinned) + moments
    arena = sum(arena_bytes(kind) for kind in pinned) + moments
    return (f"| {name} | {stage} | {parts} | {len(s)} | {exact / GB:.2f} | {per_bucket / GB:.2f} "
            f"| {one_block / GB:.2f} | {arena / GB:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    print("offloaded optimizer, one rank's host GB (masters, landing, sums pinned; Adam's moments not)")
    print("| model | ZeRO | data | buckets | tensors | per bucket (before) | one block | arena (now) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        for stage, parts in CASES:
            print(optimizer_row(name, SHAPES[name], stage, parts))
    print("\none checkpointed input, TinyLlama (hidden 2048, bf16), host GB")
    print("| tokens | bytes | rounded block (before) | pooled buffer (now) |")
    print("|---|---|---|---|")
    for tokens in (131072, 300000, 524288, 1000000):
        n = tokens * 2048 * 2
        print(f"| {tokens} | {n / GB:.3f} | {pow2(n) / GB:.3f} | {arena_bytes([n]) / GB:.3f} |")


if __name__ == "__main__":
    main()
