"""Fine-tune a Hugging Face causal LM on your data with a pipeline, ZeRO and mixed precision.

    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --pipe 2            # stdlib bytes, pipe 2 x data 2
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --pipe 2 --model ./my-llama \
        --data ./chats.jsonl --schedule zbv --seq-len 1024
    pipezero finetune --model ./my-llama --data ./corpus/ --config ds_config.json      # the same job, installed

The job is pipezero.train.finetune (in the package, so the wheel runs it): --data in any of
the formats of pipezero.train.data (text files and folders, JSON Lines of text, prompt /
completion pairs or chat messages, Parquet / Arrow), tokenized once by --model's tokenizer
into a cache, packed into rows with attention kept inside each document, loss on the
completions / assistant turns only, checkpoints and resume in --out, an LR schedule,
TensorBoard, held-out evaluation, and the export to <out>/model. Read it top to bottom there.
Needs the hf extra: pip install -e ".[hf]".
"""

from pipezero.train.finetune import run

if __name__ == "__main__":
    run(prog="examples/train_hf.py")
