"""The data path beside the training step: tokenizing, the cache, packed batches, and their share of a step.

    python bench/data.py                                   # CPU: a small GPT step, the stdlib sources as JSONL
    python bench/data.py --device cuda --hf-layers 16 --hidden 2048 --seq-len 2048 --batch 8   # ~1B Llama, H200
    python bench/data.py --model DIR --data PATH           # your tokenizer and data

Measures (one process): tokenizing --data with the tokenizer in 0 and --workers processes into
the memory-mapped cache (tokens/s), reopening the cache (the second run and every other rank),
building packed and unpacked batches (PackedBatches.next_batch: tokens/s), and one training
step (forward, backward, AdamW) of a model on the same batches; prints the loader's time as
a share of the step. Without --model a byte-level BPE tokenizer is trained on the corpus
first (the `tokenizers` library, offline). The corpus defaults to the standard library's
.py files, one JSON Lines record each (real text, present on every machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipezero.train.data import PackedBatches, pack, stdlib_files, token_mean_loss, tokenized_corpus


def corpus_jsonl(folder: Path, max_docs: int) -> Path:
    path = folder / "stdlib.jsonl"
    with open(path, "w") as f:
        for file in stdlib_files()[:max_docs]:
            f.write(json.dumps({"text": file.read_text(errors="replace")}) + "\n")
    return path


def bpe_tokenizer(folder: Path, data: Path, vocab: int) -> Path:
    """A byte-level BPE trained on `data` and saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    texts = (json.loads(line)["text"] for line in open(data))
    inner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", pad_token="<pad>").save_pretrained(folder)
    return folder


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_step(args: argparse.Namespace, vocab: int):
    """A closure: one forward + backward + AdamW step on a batch (inputs, targets)."""
    dev = torch.device(args.device)
    if args.hf_layers:
        import transformers
        from pipezero.pipe.hf import hf_layer_specs
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                                       num_hidden_layers=args.hf_layers, num_attention_heads=max(1, args.hidden // 128),
                                       num_key_value_heads=max(1, args.hidden // 512), max_position_embeddings=args.seq_len)
        layers = torch.nn.Sequential(*(s.build() for s in hf_layer_specs(cfg)))
        hf = True
    else:
        import sys
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from gpt import GPT, GPTConfig
        layers, hf = GPT(GPTConfig(vocab_size=vocab, n_layer=args.layers, n_head=4, d_model=args.hidden,
                                   seq_len=args.seq_len)).layers, False
        layers = torch.nn.Sequential(*layers)
    layers = layers.to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-4)

    def step(batch) -> None:
        inputs, targets = batch
        inputs = tuple(t.to(dev, non_blocking=True) if t is not None else None for t in inputs)
        targets = tuple(t.to(dev, non_blocking=True) for t in targets)
        x = inputs
        for layer in layers:
            x = layer(x)
        token_mean_loss(x, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    return step, hf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a tokenizer directory (default: a BPE trained here)")
    p.add_argument("--data", default=None, help="a file or folder (default: the stdlib sources as JSONL)")
    p.add_argument("--max-docs", type=int, default=120)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks (without --hf-layers)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--hf-layers", type=int, default=0, help="a Llama of this many layers through pipe/hf/specs.py")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pipezero-bench-data-"))
    try:
        data = Path(args.data) if args.data else corpus_jsonl(work, args.max_docs)
        model = Path(args.model) if args.model else bpe_tokenizer(work / "tok", data, args.vocab)
        rows = []
        for workers in sorted({0, args.workers}):
            shutil.rmtree(work / "cache", ignore_errors=True)
            t0 = time.perf_counter()
            corpus = tokenized_corpus(data, model, cache_dir=work / "cache", workers=workers)
            dt = time.perf_counter() - t0
            rows.append((f"tokenize, {workers} worker process(es)", corpus.meta["tokens"] / dt, dt))
        t0 = time.perf_counter()
        corpus = tokenized_corpus(data, model, cache_dir=work / "cache")
        rows.append(("reopen the cache (2nd run, other ranks)", corpus.meta["tokens"] / (time.perf_counter() - t0),
                     time.perf_counter() - t0))
        vocab = max(int(corpus.meta["max_id"]) + 1, args.vocab)
        step, hf = model_step(args, vocab)
        for packing in (True, False):
            layout = pack(corpus, args.seq_len, packing=packing, source="bench")
            batches = PackedBatches(layout, corpus, args.batch, 1, hf_inputs=hf, pad="step")
            build_s = _median_s(batches.next_batch, args.repeat)
            tokens = args.batch * (args.seq_len if packing else max(layout.row_length(r) for r in range(layout.num_rows)))
            step(batches.next_batch())  # warm-up
            step_s = _median_s(lambda: step(batches.next_batch()), args.repeat) - build_s
            name = "packed" if packing else "unpacked (padded per step)"
            rows.append((f"{name} batches ({100 * layout.efficiency():.0f}% real tokens)", tokens / build_s, build_s))
            rows.append((f"  the step on {args.device}: loader share {100 * build_s / (build_s + step_s):.2f}%",
                         tokens / step_s, step_s))
        print(f"{'what':58s} {'tokens/s':>12s} {'seconds':>10s}")
        for what, rate, seconds in rows:
            print(f"{what:58s} {rate:12.0f} {seconds:10.4f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
