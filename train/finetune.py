"""Fine-tune (or keep pre-training) a Hugging Face causal LM on the user's data, top to bottom.

    pipezero finetune --model ./my-llama --data ./chats.jsonl                 # one process (one per GPU)
    pipezero finetune --nproc 2 --model DIR --data PATH --lora-r 8            # 2 processes through torchrun
    torchrun --nproc-per-node 4 -m pipezero.train.finetune --model DIR --data DIR --pipe 2
    torchrun --nproc-per-node 4 examples/train_hf.py --model DIR --data x.parquet --config ds_config.json

--model is a local save_pretrained directory (nothing is downloaded): each stage reads only
its own layers' tensors, and the directory's tokenizer tokenizes --data (text files and
folders, JSON Lines of text / prompt+completion / chat messages, Parquet or Arrow tables) once
into a memory-mapped cache every rank and later run reads. Documents are packed into rows of
--seq-len (--no-packing: one per row, padded per micro-batch); the loss covers completions and
assistant turns only where the records say so (TRL's SFT semantics), as a mean per trained
token. The last --val-fraction of the documents is held out for evaluation (more, said in the
log, when that many do not fill one held-out batch: a row per micro-batch per data rank).
Checkpoints (weights, optimizer, LR schedule, data position, and fingerprints of --model's
weights and of --data) go to <out>/checkpoints and a rerun resumes from the latest, also on
another data degree, or from --resume-from's step; a rerun on another model or on edited data
is refused. --out is one job's (a second job there is refused: train/run_dir.py). TensorBoard
logs to <out>; at the end the model is exported to <out>/model for
AutoModelForCausalLM.from_pretrained (under ZeRO-3 too). Without --model a small random
Llama-style model trains on the standard library's sources as bytes. With LoRA (--lora-r or
--lora-config: train/finetune_lora.py) the base is frozen, checkpoints hold the adapters only and
the peft adapter goes to <out>/adapter beside the merged model. --chat-template FILE replaces the
tokenizer's chat template (train/data/chat_template.py). Outside torchrun, --nproc N (default: one
per GPU) launches N processes of this job through torchrun. The log opens with the layout. A MoE
whose config has output_router_logits=True adds router_aux_loss_coef x its load-balancing loss,
each micro-batch's (as each forward call in transformers), the step's term the mean of its
micro-batches' (pipe/hf/router.py's WithRouterLoss says why, and why not the Trainer's sum).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipezero.pipe import PipelineModule
from pipezero.pipe.float8 import Float8Config
from pipezero.pipe.hf import hf_config, hf_layer_specs, hf_tensor_plan
from pipezero.pipe.hf.router import WithRouterLoss
from pipezero.pipe.lora import LoraConfig, lora_specs
from pipezero.pipe.sequence import ShardSum
from pipezero.train import finetune_lora, loop
from pipezero.train.build import Parts, build
from pipezero.train.checkpoint.resume import point_batch, resume_point
from pipezero.train.cli import launch
from pipezero.train.config import parse_config
from pipezero.train.config.batch import keep_global_batch
from pipezero.train.config.recompute import apply_recompute_flags
from pipezero.train.data import (MemoryCorpus, PackedBatches, corpus_hash, load_tokenizer, pack, stdlib_files,
                                 token_mean_loss, tokenized_corpus)
from pipezero.train.data.chat_template import with_chat_template
from pipezero.train.failure import run_as_command
from pipezero.train.fingerprint import weights_fingerprint
from pipezero.train.flags import finetune_parser, layout_section
from pipezero.train.log import get_logger
from pipezero.train.loop import Cadence, HeldOut, StepRecord
from pipezero.train.run_dir import claim_run_dir
from pipezero.train.checkpoint.from_deepspeed import load_deepspeed_checkpoint

__all__ = ["main", "parse_args", "run"]

log = get_logger("finetune")


def parse_args(argv: list[str] | None = None, prog: str = "pipezero finetune") -> argparse.Namespace:
    """The flags (train/flags.py, read without torch for --help); they override --config's keys."""
    return finetune_parser(prog).parse_args(argv)


def run(argv: list[str] | None = None, prog: str = "pipezero finetune") -> float:
    """main() as a command: a known cause of failure (bad data, a refused checkpoint) ends the process with
    one line per failing rank, not a traceback of each (train/failure.py). Outside torchrun with --nproc
    N > 1 (or several GPUs) it launches N processes of this job through torchrun instead and returns nan
    (the loss is in their log), or exits with their failing status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    nproc = parse_args(argv, prog).nproc or max(1, torch.cuda.device_count())
    if nproc > 1 and "RANK" not in os.environ:  # not under torchrun: start its processes, as `pipezero train`
        status = launch("pipezero.train.finetune", _without_nproc(argv), nproc, prog)
        if status:
            raise SystemExit(status)
        return float("nan")
    return run_as_command(lambda args: main(args, prog), argv, prog)


def _without_nproc(argv: list[str]) -> list[str]:
    """argv less --nproc N: torchrun would read it as an abbreviation of its own --nproc-per-node (an
    error), and its workers need it not."""
    out, skip = [], False
    for arg in argv:
        if not skip and arg != "--nproc" and not arg.startswith("--nproc="):
            out.append(arg)
        skip = arg == "--nproc"
    return out


def main(argv: list[str] | None = None, prog: str = "pipezero finetune") -> float:
    """The whole job; returns the last training loss (`prog`: the command named in usage and errors)."""
    args = parse_args(argv, prog)
    check_out(args.out)                                     # an unwritable --out fails now, not after training
    lora = finetune_lora.lora_config(args)                 # None: LoRA off
    specs = hf_layer_specs(args.model or default_config(), fused_loss=True)  # the logits never whole
    model_config = hf_config(specs)
    specs = lora_specs(specs, lora) if lora is not None else specs  # a bad target fails here, on every rank
    point = resume_point(Path(args.out) / "checkpoints", args.resume_from)  # the latest, or --resume-from's
    tokenizer = tokenizer_dir(args)
    corpus, pad_id, data_id = documents(args, model_config, tokenizer)  # bad data fails here, before a collective
    cfg = train_config(args, point_batch(point), model_config.hidden_size)
    plan = finetune_lora.tensor_plan(hf_tensor_plan(), lora) if args.tensor > 1 else None  # adapter-aware
    loss_fn = WithRouterLoss(ShardSum(token_mean_loss))   # a MoE's router term once, beside the token mean
    parts = build(cfg, specs=specs, loss_fn=loss_fn, hidden_size=model_config.hidden_size,
                  tensor=args.tensor, tensor_plan=plan,
                  float8=Float8Config(recipe=args.float8) if args.float8 else None)
    log_layout(parts, lora)
    train, val = batches(args, parts, corpus, pad_id)
    identity = {"--model weights": weights_fingerprint(args.model) if args.model else "default (random)",
                "--data": data_id, **finetune_lora.identity(lora)}  # recorded in every checkpoint, checked on resume
    with claim_run_dir(args.out, parts.grid):  # one job per --out: another job's pid and host in the error
        meta = finetune_lora.resume(parts, point, identity, lora)
        start = 0 if meta is None else meta["step"]
        if meta is not None:
            train.load_state_dict(meta["data"])
            log.info("resumed from %s at step %d%s", meta["path"], start, "" if args.from_deepspeed is None else
                     f" (its own checkpoint: --from-deepspeed {args.from_deepspeed} was where this run began)")
        elif args.from_deepspeed is not None:  # DeepSpeed's names onto this grid (the data starts afresh)
            start = load_deepspeed_checkpoint(parts, args.from_deepspeed)["step"]
            log.info("resumed DeepSpeed's checkpoint %s at step %d", args.from_deepspeed, start)
        loss = train_loop(args, parts, train, val, start, identity, lora)
        exported = finetune_lora.export(parts, Path(args.out), lora, args.model)  # ZeRO-3: gathered
        if args.data is not None and parts.grid.rank == 0:  # the tokenizer that made the ids, beside the weights
            for out in exported:                           # (without --data the ids were bytes: none to save)
                load_tokenizer(tokenizer).save_pretrained(out)
    log.info("exported to %s: AutoModelForCausalLM.from_pretrained(%r)", exported[0], str(exported[0]))
    if lora is not None:
        log.info("exported the LoRA adapter to %s: PeftModel.from_pretrained(base, %r)", exported[1],
                 str(exported[1]))
    return loss


# -- before any collective --------------------------------------------------------------------------
def check_out(out: str) -> None:
    """Create --out and write a probe file into it, on every rank (each its own file); the folders the
    job writes later (checkpoints/, tensorboard/, model/, adapter/, tokenizer/) must be folders or absent."""
    folder = Path(out)
    probe = folder / f".write-probe-{os.environ.get('RANK', '0')}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise OSError(f"--out {out!r} is not writable ({err.strerror or err}): pass a folder you can write to; "
                      f"checkpoints, TensorBoard logs and the exported model go there") from err
    for sub in ("checkpoints", "tensorboard", "model", "adapter", "tokenizer"):
        if (folder / sub).exists() and not (folder / sub).is_dir():
            raise OSError(f"--out {out!r} holds a file {sub!r} where the job writes its {sub}/ folder (the export "
                          f"comes after all training): move the file away or pass another --out")


def default_config() -> Any:
    """A small Llama-style model for byte tokens: 4 layers, hidden 128, grouped-query attention."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tokenizer_dir(args: argparse.Namespace) -> str | None:
    """The folder of the tokenizer that reads --data: --model's, or a copy with --chat-template's template
    under <out>/tokenizer (another template: another folder, so another token cache)."""
    if args.chat_template is None:
        return args.model
    if args.model is None or args.data is None:
        raise ValueError(f"--chat-template {args.chat_template} needs --model DIR and --data PATH: the template "
                         f"replaces --model's tokenizer's for --data's chats")
    return str(with_chat_template(args.model, args.chat_template, Path(args.out) / "tokenizer"))


def log_layout(parts: Parts, lora: LoraConfig | None) -> None:
    """The job's layout, first in the log: grid, optimizer chain, schedule, micro-batches, LoRA, partition."""
    cfg, batch = parts.config, parts.config.batch
    log.info("layout: %r | %r | schedule %s | %d micro-batches of %d rows per data rank, %d rows per step | "
             "LoRA %s", parts.grid, parts.optimizer, cfg.pipeline.schedule, batch.accumulation_steps,
             batch.micro_batch_size, batch.train_batch_size, finetune_lora.describe(lora))
    if isinstance(parts.module, PipelineModule):
        log.info("partition of the layers to stages:\n%s", parts.module.describe())


def documents(args: argparse.Namespace, config: Any, tokenizer: str | None = None) -> tuple[Any, int, str]:
    """(the corpus, the padding id, its fingerprint): --data through `tokenizer`'s folder (default --model's),
    or the stdlib sources as bytes."""
    tokenizer = tokenizer or args.model
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.seq_len > positions:
        raise ValueError(f"--seq-len {args.seq_len} is longer than the model's {positions} positions "
                         f"(max_position_embeddings): pass --seq-len {positions} or less")
    if args.data is None:
        files = stdlib_files()
        docs = [np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int64) for p in files]
        return MemoryCorpus([d for d in docs if len(d) >= 2]), 0, f"stdlib sha256 {corpus_hash(files)}"
    if args.model is None:
        raise ValueError(f"--data {args.data} needs --model DIR: its tokenizer turns the text into the model's ids")
    corpus = tokenized_corpus(args.data, tokenizer, args.text_field, args.cache_dir, args.tokenize_workers,
                              progress=os.environ.get("RANK", "0") == "0")
    corpus.check_vocab(config.vocab_size)
    loaded = load_tokenizer(tokenizer)
    pad = loaded.pad_token_id if loaded.pad_token_id is not None else loaded.eos_token_id
    return corpus, int(pad or 0), f"sha256 {corpus.folder.name}"  # the cache's name: its files' and tokenizer's


class _Subset:
    """Documents `index` of a corpus (the train or the held-out split)."""

    def __init__(self, corpus: Any, index: np.ndarray):
        self.corpus, self.index = corpus, index

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.corpus.doc(int(self.index[i]))

    def lengths(self) -> np.ndarray:
        return np.asarray(self.corpus.lengths())[self.index]

    def label_counts(self) -> np.ndarray:
        return np.asarray(self.corpus.label_counts())[self.index]


def batches(args: argparse.Namespace, parts: Parts, corpus: Any, pad_id: int) -> tuple[PackedBatches, PackedBatches]:
    """This data rank's train and held-out batches (the last documents: --val-fraction of them, or more); rows
    by data x expert rank (with an expert axis, each of those ranks reads its own rows)."""
    n = len(corpus.lengths())
    grid, batch = parts.grid, parts.config.batch
    readers = grid.data_expert_size
    cut = n - held_out(args, corpus, pad_id, batch.accumulation_steps * readers)
    splits = []
    for name, index in (("train", np.arange(cut)), ("held-out", np.arange(cut, n))):
        layout = pack(_Subset(corpus, index), args.seq_len, args.packing, args.long_docs, pad_id,
                      source=f"{args.data or 'stdlib'} ({name})")
        size = batch.per_rank_batch_size if name == "train" else batch.accumulation_steps  # held out: a row per mb
        if name == "train" and layout.num_rows < size * readers:  # held_out() sized the other
            raise ValueError(f"the train split has {layout.num_rows} rows of --seq-len {args.seq_len} ({cut} of the "
                             f"{n} documents), fewer than one batch of {size * readers} (--batch-size "
                             f"{batch.micro_batch_size} x --micro-batches {batch.accumulation_steps} x "
                             f"{readers} data ranks): give more documents, or a smaller --batch-size or "
                             f"--micro-batches")
        splits.append(PackedBatches(layout, _Subset(corpus, index), size, batch.accumulation_steps,
                                    grid.data_expert_rank, readers, seed=args.seed, shuffle=name == "train",
                                    hf_inputs=True, sequence_rank=grid.sequence_rank,
                                    sequence_degree=grid.sequence_size))
    log.info("packing efficiency %.1f%% (real tokens / token slots) over %d train rows of %d tokens",
             100 * splits[0].efficiency(), splits[0].layout.num_rows, args.seq_len)
    return splits[0], splits[1]


def held_out(args: argparse.Namespace, corpus: Any, pad_id: int, rows: int) -> int:
    """How many of the last documents to hold out: --val-fraction of them, or the fewest that fill one
    held-out batch (`rows`: a row per micro-batch per data rank), which the log says; the rest train."""
    n = len(corpus.lengths())
    asked = max(1, int(round(n * args.val_fraction)))
    if n - asked < 1:
        raise ValueError(f"--data has {n} document(s): too few to hold out --val-fraction {args.val_fraction} "
                         f"and train on the rest; give more documents")
    if _rows(args, corpus, pad_id, n - asked, n) >= rows:
        return asked
    low, high = asked, asked  # low is too few; double high until it is enough, then bisect
    while _rows(args, corpus, pad_id, n - high, n) < rows:
        if high == n - 1:
            raise ValueError(f"--data has {n} documents: one held-out batch needs {rows} rows of --seq-len "
                             f"{args.seq_len} (a row per micro-batch per data rank) and all but one document make "
                             f"{_rows(args, corpus, pad_id, 1, n)}: give more documents, or fewer --micro-batches")
        low, high = high, min(2 * high, n - 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if _rows(args, corpus, pad_id, n - mid, n) >= rows else (mid, high)
    log.info("holding out the last %d of %d documents: --val-fraction %g gives %d, fewer than one held-out batch "
             "of %d rows (a row per micro-batch per data rank)", high, n, args.val_fraction, asked, rows)
    return high


def _rows(args: argparse.Namespace, corpus: Any, pad_id: int, start: int, stop: int) -> int:
    """Rows of --seq-len that documents start..stop-1 make (pack's arithmetic, its log lines held back)."""
    quiet = logging.getLogger("pipezero.data")
    was, quiet.disabled = quiet.disabled, True
    try:
        return pack(_Subset(corpus, np.arange(start, stop)), args.seq_len, args.packing, args.long_docs,
                    pad_id).num_rows
    finally:
        quiet.disabled = was


def train_config(args: argparse.Namespace, saved: Any, hidden_size: int) -> Any:
    """The ds_config: --config with the flags on top; resumed on another data degree, its global batch."""
    raw = json.loads(Path(args.config).read_text()) if args.config else {}
    if args.batch_size is not None or args.micro_batches is not None or not any(
            k in raw for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")):
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            raw.pop(key, None)
        raw["train_micro_batch_size_per_gpu"] = args.batch_size or 1
        raw["gradient_accumulation_steps"] = args.micro_batches or 4
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout_section(raw, args, stages=2 if world % 2 == 0 else 1, zero_stage=1)  # train/flags.py's, as the job's
    apply_recompute_flags(raw, args)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    raw.setdefault("optimizer", {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}})
    raw.setdefault("scheduler", {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": warmup, "total_num_steps": args.steps, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}})
    raw.setdefault("steps_per_print", 10)
    cfg = parse_config(raw, tensor=args.tensor, hidden_size=hidden_size, auto_values={
        "optimizer.params.lr": args.lr, "scheduler.params.total_num_steps": args.steps,
        "scheduler.params.warmup_num_steps": warmup, "gradient_clipping": 1.0})
    return dataclasses.replace(cfg, batch=keep_global_batch(cfg.batch, saved))


# -- the loop: train/loop.py's, with finetune's door -------------------------------------------------
def train_loop(args: argparse.Namespace, parts: Parts, train: PackedBatches, val: PackedBatches, start: int,
               identity: dict[str, str] | None = None, lora: LoraConfig | None = None) -> float:
    """Steps start+1 .. --steps through the one loop (train/loop.py)."""
    door = FinetuneDoor(args, parts, train, identity or {}, lora)
    cadence = Cadence(args.steps, args.eval_interval, args.save_interval, parts.config.steps_per_print)
    return loop.train_loop(parts, door, HeldOut(val, args.eval_batches, "held-out"), cadence, start,
                           save_on_signal=args.save_on_signal)


@dataclasses.dataclass
class FinetuneDoor:
    """finetune's side of the loop: packed batches (tokens counted), LoRA-aware checkpoints, the data share."""

    args: argparse.Namespace
    parts: Parts
    train: PackedBatches
    identity: dict[str, str]
    lora: LoraConfig | None

    def next_batch(self) -> tuple[Any, Any]:
        return self.train.next_batch()

    def tokens(self, inputs: Any) -> int:
        rows = inputs if isinstance(inputs, list) else [inputs]  # unpacked: one per micro-batch
        return sum(int(r[0].numel()) for r in rows) * self.parts.grid.data_sequence_size  # a rank holds a slice

    def save(self, step: int, loss: float) -> Path:
        ckpt_dir = Path(self.args.out) / "checkpoints"
        saved = finetune_lora.save(self.parts, ckpt_dir, step, self.train.state_dict(), self.identity, self.lora)
        log.info("saved checkpoint %s to %s", saved.name, ckpt_dir)
        return saved

    def numbers(self, step: StepRecord, printing: bool) -> tuple[dict[str, float], list[str]]:
        share = step.data_seconds / step.seconds
        return ({"perf/data_share": share, "data/packing_efficiency": self.train.efficiency()},
                [f"data {100 * share:.1f}% of the step"])


if __name__ == "__main__":
    run()
