"""`pipezero finetune` reaches the library: LoRA, --chat-template, --nproc, and the layout in its log.

One world of 2 (pipe 2) fine-tunes a tiny Llama with LoRA from the flags and a chat template of
the user's: 4 steps straight, then 2 steps and a rerun to 4 that resumes (the adapters bitwise
the straight run's), the same 4 steps under ZeRO-3 on pipe 1 x data 2 (the same global batch,
the adapters partitioned). Checkpoints hold adapters only; the
exported adapter loads through peft's own PeftModel.from_pretrained on the base and gives the
logits of pipezero's trained model (its last checkpoint loaded into a pipeline), the merged
export loads with from_pretrained and gives them too, and ZeRO-3's exports equal them. A rerun
with other adapters is refused. A peft adapter_config.json written by peft itself gives the
same LoraConfig as the flags, and an option the pipeline's LoRA lacks is refused. Another chat
template is another token cache. `pipezero finetune --nproc 2` in a subprocess launches 2
processes, whose log shows the layout and a line per saved checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_tokenizer import CHAT_TEMPLATE
from harness import run
from test_finetune import _chats, _model_dir

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = ("--lora-r", "4", "--lora-alpha", "16", "--lora-targets", "q_proj", "v_proj", "down_proj")
OTHER_TEMPLATE = CHAT_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}<system> the sky is blue <eot> ")


def _job(root: str, out: str, steps: int, *extra: str) -> float:
    from pipezero.train.finetune import main
    return main(["--model", f"{root}/model", "--data", f"{root}/chat.jsonl", "--pipe", "2", "--seq-len", "32",
                 "--steps", str(steps), "--lr", "1e-2", "--out", out, "--cache-dir", f"{root}/cache",
                 "--tokenize-workers", "0", "--eval-interval", "2", "--save-interval", "2", "--val-fraction", "0.1",
                 "--micro-batches", "2", "--batch-size", "2", "--chat-template", f"{root}/other.jinja", *LORA,
                 *extra])


def _lora_jobs(root: str) -> dict:
    from pipezero.train.checkpoint.files import CheckpointError, checkpoint_names

    _job(root, f"{root}/straight", 4)
    _job(root, f"{root}/resumed", 2)
    _job(root, f"{root}/resumed", 4)
    _job(root, f"{root}/zero3", 4, "--config", f"{root}/zero3.json", "--pipe", "1", "--batch-size", "1")  # data 2
    with pytest.raises(CheckpointError, match=r"--lora='r=4 alpha=16 .*' \(here 'r=8 alpha=16"):
        _job(root, f"{root}/straight", 6, "--lora-r", "8")  # other adapters than the checkpoint's: refused
    names = checkpoint_names(f"{root}/straight/checkpoints")
    return {"logits": _trained_logits(root), "model_names": [n for n in names if n.startswith("model/")]}


def _trained_logits(root: str) -> torch.Tensor | None:
    """pipezero's trained model: the base with the straight run's last checkpoint, through a pipeline."""
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.lora import LoraConfig, lora_specs, trainable_parameters
    from pipezero.topology import Grid
    from pipezero.train.checkpoint.lora_state import load_adapters
    from pipezero.zero import ZeroOptimizer

    config = LoraConfig(r=4, lora_alpha=16, target_modules=("q_proj", "v_proj", "down_proj"))
    grid = Grid(pipe=2)
    model = PipelineModule(lora_specs(hf_layer_specs(f"{root}/model"), config), grid=grid, loss_fn=causal_lm_loss)
    opt = ZeroOptimizer(torch.optim.AdamW(trainable_parameters(model)), group=grid.data_group)
    parts = argparse.Namespace(module=model, optimizer=opt, grid=grid, scheduler=None, config=None,
                               dtype=torch.float32)
    load_adapters(parts, f"{root}/straight/checkpoints", optimizer=False)
    return PipelineRunner(model, OneFOneB(num_microbatches=1)).eval_step(_ids())


def _ids() -> torch.Tensor:
    return torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(0))


def test_lora_from_the_command_line_resumes_and_exports_what_peft_loads(tmp_path):
    from safetensors.torch import load_file

    _model_dir(tmp_path)
    _chats(tmp_path / "chat.jsonl")
    (tmp_path / "other.jinja").write_text(OTHER_TEMPLATE)
    (tmp_path / "zero3.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}))
    results = run(_lora_jobs, 2, str(tmp_path), timeout=300)
    names = results[0]["model_names"]
    assert names and all(".lora_" in n for n in names), names  # adapters only, no base weight
    logits = next(r["logits"] for r in results if r["logits"] is not None)
    straight = tmp_path / "straight"
    a, b = load_file(straight / "adapter" / "adapter_model.safetensors"), \
        load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        assert not torch.allclose(base(_ids()).logits, logits, atol=1e-3)  # the adapters trained
        for run_dir in ("straight", "zero3"):
            loaded = peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model"), tmp_path / run_dir / "adapter")
            torch.testing.assert_close(loaded(_ids()).logits, logits, rtol=1e-5, atol=1e-5, msg=run_dir)
            merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / run_dir / "model")
            torch.testing.assert_close(merged(_ids()).logits, logits, rtol=1e-5, atol=1e-5, msg=run_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(straight / "model")
    assert tokenizer.chat_template == OTHER_TEMPLATE  # the template that made the ids, beside the weights


def _args(**flags) -> argparse.Namespace:
    from pipezero.train.finetune import parse_args
    return parse_args([x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", *v.split())])


def test_lora_flags_and_peft_config_file(tmp_path):
    from pipezero.pipe.lora import LoraConfig
    from pipezero.train.finetune_lora import lora_config

    assert lora_config(_args()) is None
    flags = lora_config(_args(lora_r="4", lora_alpha="16", lora_dropout="0.1", lora_targets="v_proj q_proj"))
    assert flags == LoraConfig(r=4, lora_alpha=16, lora_dropout=0.1, target_modules=("v_proj", "q_proj"))
    assert lora_config(_args(lora_r="2", lora_targets="all-linear")).target_modules == "all-linear"
    peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]).save_pretrained(
        tmp_path / "plain")
    from_file = lora_config(_args(lora_config=str(tmp_path / "plain")))
    assert from_file == LoraConfig(r=4, lora_alpha=16, lora_dropout=0.1, target_modules=("q_proj", "v_proj"))
    assert lora_config(_args(lora_config=str(tmp_path / "plain" / "adapter_config.json"))) == from_file
    peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True).save_pretrained(tmp_path / "dora")
    with pytest.raises(ValueError, match=r"--lora-config .*dora with \{'use_dora': True\}"):
        lora_config(_args(lora_config=str(tmp_path / "dora")))
    with pytest.raises(ValueError, match=r"--lora-alpha without --lora-r"):
        lora_config(_args(lora_alpha="16"))
    with pytest.raises(ValueError, match=r"--lora-config .* and --lora-r: .* either the file or the flags"):
        lora_config(_args(lora_config=str(tmp_path / "plain"), lora_r="8"))
    with pytest.raises(ValueError, match=r"--lora-r 4 --lora-dropout 1.5: .*lora_dropout=1.5"):
        lora_config(_args(lora_r="4", lora_dropout="1.5"))


def test_another_chat_template_is_another_token_cache(tmp_path):
    from pipezero.train.finetune import documents, tokenizer_dir

    model = _model_dir(tmp_path)
    _chats(tmp_path / "chat.jsonl")
    (tmp_path / "other.jinja").write_text(OTHER_TEMPLATE)
    config = transformers.AutoConfig.from_pretrained(model)
    corpora = []
    for template in (None, str(tmp_path / "other.jinja")):
        args = _args(model=str(model), data=str(tmp_path / "chat.jsonl"), out=str(tmp_path / "out"),
                     cache_dir=str(tmp_path / "cache"), tokenize_workers="0", seq_len="32")
        args.chat_template = template
        corpora.append(documents(args, config, tokenizer_dir(args)))
    (own, _, own_id), (other, _, other_id) = corpora
    assert own_id != other_id and own.folder != other.folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    first = tokenizer.decode(other.doc(0)[0].tolist())
    assert first.startswith("<bos> <system> the sky is blue <eot>"), first
    assert not tokenizer.decode(own.doc(0)[0].tolist()).startswith("<bos> <system>")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    args.chat_template = str(tmp_path / "broken.jinja")
    with pytest.raises(ValueError, match=r"--chat-template .*broken.jinja:1: not a Jinja template"):
        tokenizer_dir(args)


def test_nproc_launches_processes_and_the_log_shows_the_layout(tmp_path):
    _model_dir(tmp_path)
    _chats(tmp_path / "chat.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "pipezero.train.cli", "finetune", "--nproc", "2", "--model", str(tmp_path / "model"),
           "--data", str(tmp_path / "chat.jsonl"), "--seq-len", "32", "--steps", "2", "--save-interval", "1",
           "--micro-batches", "2", "--batch-size", "2", "--out", str(tmp_path / "out"), "--cache-dir",
           str(tmp_path / "cache"), "--tokenize-workers", "0", "--lora-r", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    log = done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "torch.distributed.run --standalone --nproc-per-node=2" in log, log[-3000:]
    assert "layout: Grid(pipe=2, data=1, tensor=1) | ZeroOptimizer(stage=1" in log, log[-3000:]
    assert ("schedule 1f1b | 2 micro-batches of 2 rows per data rank, 4 rows per step | "
            "LoRA r=2 alpha=8 dropout=0 targets q_proj v_proj") in log, log[-3000:]
    assert "partition of the layers to stages:\nstage  rank  chunk" in log, log[-3000:]
    for step in (1, 2):
        assert f"saved checkpoint step_{step:08d} to {tmp_path / 'out' / 'checkpoints'}" in log, log[-3000:]
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
