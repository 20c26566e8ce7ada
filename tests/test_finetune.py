"""pipezero.train.finetune (examples/train_hf.py): the job users run, on a chat JSONL and a local model.

One world of 2 (pipe 2) runs 4 steps straight, then 2 steps, then a rerun to 4 that resumes
from the checkpoint: the exported weights are bitwise those of the straight run (the data position,
LR schedule and optimizer state come back), and the export loads in transformers
with its tokenizer. The same 4 steps at ZeRO-3 (every parameter partitioned), on pipe 2 and on
pipe 1 x data 2 (the same global batch), export from the command too (issue 44 item 1: the export
failed after training) and load in transformers with the straight run's weights. An unwritable
--out fails before any training; a chat file for a tokenizer without a chat template fails with
the file and line. 2 steps with --sequence-parallel 2 give the 2-step pipe 2 loss.

A tiny Qwen3-MoE with output_router_logits=True (its coefficient raised so the term weighs) trains 3
steps at a constant lr (the default schedule's first two steps are at lr 0, DeepSpeed's) at one
process, at data 2, expert 2 and pipe 2 (ZB-V), and on four ranks at sequence 2 x data 2,
sequence 2 x expert 2 and tensor 2 x expert 2: each run's last loss and exported weights equal a plain transformers + torch
AdamW loop's on the same packed rows (transformers' token-mean cross-entropy and its aux_loss, the
mean over the step's micro-batches; fp32, 1e-5), and the weights moved.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from data_tokenizer import WORDS, make_tokenizer
from harness import run

LR = 3e-3  # the MoE's runs: a constant lr (its ds_config), its first steps too
# AdamW's eps in the MoE's runs and their transformers loop: at torch's 1e-8, an element whose gradient
# is near 0 moves by lr x g / (|g| + eps), so kernels' rounding (~1e-10) turned into 2.5e-5 of one
# q_proj element after 3 steps on a 2-core CPU (the four layouts agreeing to 1e-9); at 1e-6 it is 100x less
EPS = 1e-6


def _model_dir(root: Path) -> Path:
    import transformers

    folder = make_tokenizer(root / "model")
    vocab = len(transformers.AutoTokenizer.from_pretrained(folder))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def _moe_dir(root: Path) -> Path:
    """A tiny Qwen3-MoE (four experts a layer, its load-balancing term on and weighing) beside the Llama,
    with the same tokenizer; a ds_config of a constant lr beside it."""
    import shutil

    import transformers

    folder = root / "moe"
    shutil.copytree(root / "model", folder)
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=transformers.AutoConfig.from_pretrained(folder).vocab_size,
                                      hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                      output_router_logits=True, router_aux_loss_coef=0.5,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    (root / "constant.json").write_text(json.dumps({  # finetune's AdamW at EPS, a constant lr
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "eps": EPS}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": LR, "warmup_max_lr": LR,
                                                     "warmup_num_steps": 1}}}))
    return folder


def _chats(path: Path) -> Path:
    r = random.Random(0)
    with open(path, "w") as f:
        for _ in range(80):
            chat = [{"role": "user", "content": " ".join(r.choices(WORDS, k=5))},
                    {"role": "assistant", "content": " ".join(r.choices(WORDS, k=r.randint(1, 6)))}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return path


def _argv(root: str, out: str, steps: int, *extra: str) -> list[str]:
    return ["--model", f"{root}/model", "--data", f"{root}/chat.jsonl", "--pipe", "2", "--seq-len", "32",
            "--steps", str(steps), "--lr", str(LR), "--out", out, "--cache-dir", f"{root}/cache",
            "--tokenize-workers", "0", "--eval-interval", "2", "--save-interval", "2", "--val-fraction", "0.1",
            "--micro-batches", "2", "--batch-size", "2", *extra]


def _job(root: str, out: str, steps: int, *extra: str) -> float:
    from pipezero.train.finetune import main
    return main(_argv(root, out, steps, *extra))


def _three_jobs(root: str) -> list[float]:
    zero3 = ("--config", f"{root}/zero3.json")  # every parameter partitioned, however small
    return [_job(root, f"{root}/straight", 4), _job(root, f"{root}/resumed", 2), _job(root, f"{root}/resumed", 4),
            _bytes_job(root), _job(root, f"{root}/zero3-pipe2", 4, *zero3),
            _job(root, f"{root}/zero3-pipe1", 4, *zero3, "--pipe", "1", "--batch-size", "1"),
            _job(root, f"{root}/sequence", 2, "--pipe", "1", "--sequence-parallel", "2")]


def _bytes_job(root: str) -> float:
    """Without --data the stdlib sources train as bytes: a model directory without a tokenizer must export
    (the job used to fail after its last step, looking for the tokenizer it never used)."""
    from pipezero.train.finetune import main
    return main(["--model", f"{root}/bare", "--pipe", "2", "--seq-len", "32", "--steps", "1", "--out",
                 f"{root}/bytes", "--micro-batches", "2", "--batch-size", "2", "--eval-interval", "100",
                 "--save-interval", "100"])


def test_finetune_resumes_exactly_and_exports(tmp_path):
    import transformers

    _model_dir(tmp_path)
    _chats(tmp_path / "chat.jsonl")
    bare = transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(bare).save_pretrained(tmp_path / "bare")  # no tokenizer
    (tmp_path / "zero3.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}))
    losses = run(_three_jobs, 2, str(tmp_path), timeout=300)
    assert (tmp_path / "bytes" / "model" / "config.json").is_file()
    assert losses[0][0] == losses[0][2] and losses[0][1] != losses[0][2], losses
    # each row split over 2 sequence ranks (the prompts' untrained tokens unevenly): pipe 2's loss at step 2
    assert losses[0][6] == pytest.approx(losses[0][1], abs=1e-5), losses
    from safetensors.torch import load_file

    files = sorted((tmp_path / "straight" / "model").glob("*.safetensors"))
    assert files, list((tmp_path / "straight" / "model").iterdir())
    for file in files:
        a, b = load_file(file), load_file(tmp_path / "resumed" / "model" / file.name)
        for name in a:
            assert torch.equal(a[name], b[name]), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "model")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "resumed" / "model")
    assert model(**tok("the cat", return_tensors="pt")).logits.shape[-1] == len(tok)
    trained = model.state_dict()
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    for run_dir in ("zero3-pipe2", "zero3-pipe1"):  # issue 44 item 1
        zero3 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / run_dir / "model").state_dict()
        assert zero3.keys() == trained.keys()
        for name, value in trained.items():
            torch.testing.assert_close(zero3[name], value, rtol=1e-5, atol=1e-5, msg=f"{run_dir} {name}")
        assert not torch.equal(zero3["model.layers.0.self_attn.q_proj.weight"],
                               start["model.layers.0.self_attn.q_proj.weight"])


def test_unwritable_out_and_bad_data_fail_before_training(tmp_path, monkeypatch, capsys):
    from pipezero.train.finetune import main

    def started(*_, **__):
        raise AssertionError("a process group was started before the bad input was refused")
    monkeypatch.setattr("pipezero.topology.grid.init_distributed", started)  # every Grid() starts here

    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=r"--out .* is not writable"):
        main(["--out", str(tmp_path / "file" / "run")])
    make_tokenizer(tmp_path / "plain", chat=False)
    _chats(tmp_path / "chat.jsonl")
    with pytest.raises(ValueError, match=r"--seq-len 4096 is longer than the model's 1024 positions"):
        main(["--out", str(tmp_path / "o"), "--seq-len", "4096"])
    for flag, value, words in (("--seq-len", "1", "expected an integer >= 2"), ("--val-fraction", "1.5", "(0, 1)"),
                               ("--val-fraction", "-1", "(0, 1)"), ("--val-fraction", "0", "(0, 1)")):
        with pytest.raises(SystemExit):  # was: the model and the process group built, then a ValueError (1.5:
            main(["--out", str(tmp_path / "o"), flag, value])  # "give more documents"; -1 and 0 ran on)
        err = capsys.readouterr().err
        assert f"argument {flag}: {value}: expected" in err and words in err, err
    import transformers
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"chat.jsonl:1: a chat record, but the tokenizer has no chat template"):
        main(["--model", str(tmp_path / "plain"), "--data", str(tmp_path / "chat.jsonl"), "--out",
              str(tmp_path / "o"), "--cache-dir", str(tmp_path / "cache"), "--tokenize-workers", "0",
              "--seq-len", "32"])


def _moe_flags(root: str | Path) -> tuple[str, ...]:
    """The routed MoE at pipe 1, at a constant lr: 8 rows a step (2 a micro-batch) at every layout here."""
    return "--model", f"{root}/moe", "--pipe", "1", "--config", f"{root}/constant.json"


def _moe_runs(root: str, runs: list[tuple[str, tuple[str, ...]]]) -> list[float]:
    """3 steps of the routed MoE per (name, flags), each exported to <root>/moe-<name>/model."""
    return [_job(root, f"{root}/moe-{name}", 3, *_moe_flags(root), *flags) for name, flags in runs]


def _transformers_truth(root: Path) -> tuple[float, dict[str, torch.Tensor]]:
    """(the 3rd step's loss, the weights after 3 steps) of a plain transformers + torch AdamW loop on
    finetune's packed rows at one process: 4 micro-batches of 2 rows a step, each forward call's loss
    transformers' cross-entropy over the step's trained tokens (its loss_function with
    num_items_in_batch, as the Trainer passes it) plus router_aux_loss_coef x its aux_loss / 4 (the
    step's term the mean of its forward calls'); the global norm clipped at 1, a constant lr."""
    from types import SimpleNamespace

    import transformers

    from pipezero.train import finetune

    m = 4
    argv = _argv(str(root), str(root / "truth"), 3, *_moe_flags(root), "--micro-batches", str(m))
    args = finetune.parse_args(argv)  # the one-process run's flags: its rows
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "moe").train()
    cfg = model.config
    corpus, pad_id, _ = finetune.documents(args, cfg)
    one = SimpleNamespace(data_expert_size=1, data_expert_rank=0, sequence_rank=0, sequence_size=1)
    layout = SimpleNamespace(grid=one, config=finetune.train_config(args, None, cfg.hidden_size))
    train, _ = finetune.batches(args, layout, corpus, pad_id)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=EPS)
    for _ in range(3):
        (ids, _, positions), (labels, _) = train.next_batch()
        trained, loss = int((labels != -100).sum()), 0.0
        for rows in torch.arange(len(ids)).chunk(m):
            out = model(input_ids=ids[rows], position_ids=positions[rows], use_cache=False)  # documents apart
            ce = model.loss_function(out.logits, None, cfg.vocab_size, num_items_in_batch=trained,
                                     shift_labels=labels[rows])  # finetune's labels: shifted already
            part = ce + cfg.router_aux_loss_coef * out.aux_loss / m
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return loss, model.state_dict()


def _check_moe(root: Path, losses: list[float], names: list[str]) -> None:
    """Each run's last loss and exported weights are the transformers loop's, and they moved."""
    import transformers

    want_loss, want = _transformers_truth(root)
    start = transformers.AutoModelForCausalLM.from_pretrained(root / "moe").state_dict()
    for name, loss in zip(names, losses):
        assert loss == pytest.approx(want_loss, abs=1e-5), (name, loss, want_loss)
        got = transformers.AutoModelForCausalLM.from_pretrained(root / f"moe-{name}" / "model").state_dict()
        assert got.keys() == want.keys(), name
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")
            moved = not torch.equal(got[key], start[key]) or not value.is_floating_point()
            assert moved, (name, key)  # it trained (at lr 0 it would not)


def test_finetune_moe_router_loss_equals_transformers(tmp_path):
    """output_router_logits=True: the load-balancing term through finetune's token-mean loss (it failed at
    the first step: fused_cross_entropy got the head's Routed) at one process (4 micro-batches), at data 2
    and at expert 2 (each rank two of the four experts; 2 micro-batches each), and at pipe 2 under ZB-V (4
    micro-batches; the routing sums cross the stages both ways, the last chunk on rank 0): the same forward
    calls of 2 rows, each adding its term, as the transformers loop."""
    _model_dir(tmp_path)
    _moe_dir(tmp_path)
    _chats(tmp_path / "chat.jsonl")
    one = run(_moe_runs, 1, str(tmp_path), [("one", ("--micro-batches", "4"))], timeout=300)
    runs = [("data", ()), ("expert", ("--expert-parallel", "2")),
            ("zbv", ("--pipe", "2", "--schedule", "zbv", "--micro-batches", "4"))]
    two = run(_moe_runs, 2, str(tmp_path), runs, timeout=300)
    assert two[0] == two[1], two  # every rank logs the step's loss
    _check_moe(tmp_path, [one[0][0], *two[0]], ["one", "data", "expert", "zbv"])


def test_finetune_splits_experts_beside_a_sequence_split(tmp_path):
    """--expert-parallel 2 --sequence-parallel 2 (refused before: the experts' ranks would be data x
    sequence) trains as --sequence-parallel 2 at data 2, and both as the transformers loop: the router term
    counted once (ShardSum multiplies the token mean by the degree, not the term every slice holds whole).
    Fails with the experts reduced over the data axis alone (their mean's divisor is left to test_expert:
    Adam hides a uniform scale), and with the term inside ShardSum. And --expert-parallel 2 --tensor 2 (refused
    before): attention split by heads, each MoE block on its tensor rank's share of the tokens."""
    _model_dir(tmp_path)
    _moe_dir(tmp_path)
    _chats(tmp_path / "chat.jsonl")
    split = ("--sequence-parallel", "2")
    runs = [("s2-data", split), ("s2-expert", (*split, "--expert-parallel", "2")),
            ("t2-expert", ("--tensor", "2", "--expert-parallel", "2"))]
    losses = run(_moe_runs, 4, str(tmp_path), runs, timeout=300)
    _check_moe(tmp_path, losses[0], ["s2-data", "s2-expert", "t2-expert"])
