"""Fine-tune a Hugging Face causal LM with a pipeline, ZeRO and mixed precision, top to bottom.

    torchrun --standalone --nproc-per-node 4 examples/train_hf.py                 # pipe 2 x data 2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --model ./my-llama --schedule zbv
    torchrun --standalone --nproc-per-node 8 examples/train_hf.py --pipe 2 --data 2 --tensor 2

--model is a local directory written by save_pretrained (nothing is downloaded): each stage
reads only its own layers' tensors from its safetensors shards. Without it, a small
random-initialised Llama-style model is built from a config. The corpus is the standard
library's own sources, tokenised with the model's tokenizer when the directory has one,
as bytes otherwise. At the end the trained model is exported to <out>/model, which
`AutoModelForCausalLM.from_pretrained` loads. Needs the hf extra: pip install -e ".[hf]".
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule, schedule_names
from pipezero.pipe.hf import causal_lm_loss, hf_config, hf_layer_specs, hf_tensor_plan
from pipezero.precision import LossScaler
from pipezero.topology import Grid
from pipezero.train.data import ShardedBatches, TokenData, stdlib_corpus, stdlib_files
from pipezero.train.hf_export import export_hf
from pipezero.train.log import get_logger
from pipezero.zero import ZeroOptimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
log = get_logger("train_hf")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a local save_pretrained directory (default: a small random Llama)")
    p.add_argument("--pipe", type=int, default=2)
    p.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (attention heads and MLP split)")
    p.add_argument("--schedule", default="1f1b", choices=schedule_names())
    p.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2])
    p.add_argument("--precision", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch per data rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint-layers", type=int, default=0, help="activation checkpointing: layers per segment")
    p.add_argument("--out", default="runs/hf")
    return p.parse_args(argv)


def default_config():
    """A small Llama-style model for byte tokens: 4 layers, hidden 128, grouped-query attention."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def corpus(model: str | None, vocab_size: int, seq_len: int) -> TokenData:
    """The stdlib corpus through the model's own tokenizer if its directory has one, else as bytes."""
    if model is not None and any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        text = "".join(p.read_text(errors="replace") for p in stdlib_files()[:40])
        return TokenData(torch.tensor(tokenizer(text)["input_ids"]), seq_len, source=f"stdlib:{model}")
    if vocab_size < 256:
        raise ValueError(f"the model's vocabulary has {vocab_size} entries and no tokenizer was found next to it; "
                         "byte-level tokens need at least 256")
    tokens, digest = stdlib_corpus()
    return TokenData(tokens, seq_len, source=f"stdlib:{digest}")


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    grid = Grid(pipe=args.pipe, tensor=args.tensor)
    specs = hf_layer_specs(args.model or default_config())
    config = hf_config(specs)
    schedule = make_schedule(args.schedule, args.micro_batches)
    model = PipelineModule(specs, grid=grid, loss_fn=causal_lm_loss, num_chunks=schedule.num_chunks,
                           placement=schedule.placement,
                           activation_checkpoint_interval=args.checkpoint_layers,
                           tensor_plan=hf_tensor_plan() if args.tensor > 1 else None)
    model.to(DTYPES[args.precision])
    scaler = LossScaler(torch.optim.AdamW(model.parameters(), lr=args.lr), dynamic=args.precision == "fp16",
                        init_scale=2.0 ** 16 if args.precision == "fp16" else 1.0, clip_grad_norm=1.0)
    opt = ZeroOptimizer(scaler, stage=args.zero_stage, group=grid.data_group)
    runner = PipelineRunner(model, schedule, optimizer=opt)
    data = corpus(args.model, config.vocab_size, args.seq_len)
    batches = ShardedBatches(data, args.batch_size * args.micro_batches, grid.data_rank, grid.data_size)
    if grid.rank == 0:
        log.info("%s: %s tokens (%s)\n%s", type(config).__name__, data.tokens.numel(),
                 data.source, model.describe())
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = batches.next_batch()
        loss = runner.train_step(inputs.to(model.device), targets.to(model.device))
        opt.step()
        opt.zero_grad()
        if grid.rank == 0 and (step % 10 == 0 or step == 1):
            log.info("step %d loss %.4f (%.1f s)", step, loss.item(), time.perf_counter() - start)
    out = export_hf(model, Path(args.out) / "model")
    if grid.rank == 0:
        log.info("exported to %s: AutoModelForCausalLM.from_pretrained(%r)", out, str(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
