"""A checkpoint DeepSpeed 0.19.8 itself writes resumes under pipezero with the losses DeepSpeed's own resume gives.

A tiny Hugging Face Qwen2 (tied embedding, biases, sizes that ZeRO-2 cuts mid-parameter
across ranks) trains for 2 steps under DeepSpeed at ZeRO-2 and at ZeRO-3 on 2 gloo ranks (fp32,
AdamW, clipping, WarmupLR mid warm-up) and is saved with engine.save_checkpoint; ZeRO-2's and
ZeRO-3's checkpoints also go through DeepSpeed's ds_to_universal. DeepSpeed resumes each for 3
more steps: the truth. pipezero resumes the same files for the same 3 steps on the same data,
through `engine.load_checkpoint(dir)` of pipezero's initialize (2 ranks, the ZeRO stages crossed,
the universal folders by tag) and through load_deepspeed_checkpoint onto a pipe 2 x data 1
PipelineModule of hf_layer_specs and onto one process: the mean loss of each step must agree
within 1e-5. Bad inputs (another model, a pipeline checkpoint's layer_* files) are refused
naming the file and the parameter.
"""

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
deepspeed = pytest.importorskip("deepspeed")

from harness import run  # noqa: E402
from test_initialize_deepspeed import _on_deepspeed, _on_pipezero  # noqa: E402

VOCAB, ROWS, SEQ, SAVED_AT, RESUMED = 61, 8, 6, 2, 3


def _hf_config(layers: int = 2):
    return transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=36, intermediate_size=50, num_hidden_layers=layers,
                                    num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=32,
                                    tie_word_embeddings=True, pad_token_id=None, bos_token_id=1, eos_token_id=2)


def _model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_hf_config())


def _config(stage: int, ranks: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ROWS // 2 // ranks,
            "steps_per_print": 10**9, "gradient_clipping": 1.0,  # ZeRO-3: parameters in several sub-groups
            "zero_optimization": {"stage": stage, **({"sub_group_size": 2000} if stage == 3 else {})},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 4}}}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: ROWS rows of token ids and their targets."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _engine_steps(engine, steps: range) -> list[float]:
    """DeepSpeed's loop, one backward + step per micro-batch of 2 rows of this data rank; each step's mean
    loss over the whole batch (all ranks)."""
    import torch.distributed as dist

    from pipezero.pipe.hf import causal_lm_loss

    ranks, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for step in steps:
        ids, targets = (t.chunk(ranks)[rank] for t in _batch(step))
        total = 0.0
        for x, y in zip(ids.split(2), targets.split(2)):
            loss = causal_lm_loss(engine(x).logits, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / (len(ids) // 2)
        mean = torch.tensor(total)
        dist.all_reduce(mean)
        out.append(mean.item() / ranks)
    return out


def _deepspeed_truth(initialize, root: str) -> dict:
    """Per ZeRO stage: train SAVED_AT steps, save; a fresh engine loads it and trains RESUMED more."""
    import torch.distributed as dist
    from deepspeed.checkpoint import ds_to_universal

    out = {}
    for stage in (2, 3):
        def engine():
            model = _model()
            return initialize(model=model, model_parameters=model.parameters(), config=_config(stage))[0]
        first = engine()
        _engine_steps(first, range(SAVED_AT))
        first.save_checkpoint(f"{root}/z{stage}", client_state={"epoch": 7})
        second = engine()
        second.load_checkpoint(f"{root}/z{stage}")
        out[stage] = _engine_steps(second, range(SAVED_AT, SAVED_AT + RESUMED))
        if dist.get_rank() == 0:  # DeepSpeed's own converter, in this process (one worker: no child processes)
            tag = f"{root}/z{stage}/global_step{SAVED_AT}"
            argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder", tag, "--output_folder",
                                        f"{tag}_universal", "--num_extract_workers", "1", "--num_merge_workers",
                                        "1", "--inject_missing_state"]
            try:
                ds_to_universal.main(ds_to_universal.parse_arguments())
            finally:
                sys.argv = argv
        dist.barrier()
    return out


def _pipezero_resumes(initialize, root: str, hf_dir: str) -> dict:
    """The checkpoints resumed by pipezero on 2 ranks: initialize's engine (data 2, other ZeRO stages, the
    universal folders) and a pipe 2 PipelineModule of hf_layer_specs (data 1)."""
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.train import build
    from pipezero.train.checkpoint.from_deepspeed import load_deepspeed_checkpoint

    out = {}
    for name, stage, tag, ours in [("z2", 2, None, 3), ("z3", 3, None, 2), ("z2", 2, "universal", 1),
                                   ("z3", 3, "universal", 0)]:
        model = _model()
        engine = initialize(model=model, model_parameters=model.parameters(), config=_config(ours))[0]
        _, client = engine.load_checkpoint(f"{root}/{name}", None if tag is None else f"global_step{SAVED_AT}_{tag}")
        assert (engine.global_steps, client["epoch"]) == (SAVED_AT, 7), (engine.global_steps, client)
        out[(stage, tag or "engine", ours)] = _engine_steps(engine, range(SAVED_AT, SAVED_AT + RESUMED))
    config = {**_config(1, ranks=1), "pipeline": {"stages": 2, "schedule": "1f1b"}}
    parts = build(config, specs=hf_layer_specs(hf_dir), loss_fn=causal_lm_loss)
    meta = load_deepspeed_checkpoint(parts, f"{root}/z3")
    losses = []
    for step in range(meta["step"], meta["step"] + RESUMED):
        losses.append(parts.runner.train_step(*_batch(step)).item())
        assert parts.optimizer.step()
        parts.scheduler.step()
        parts.optimizer.zero_grad()
    out[(3, "pipe 2", 1)] = losses
    return out


def _one_process(initialize, root: str) -> tuple[list[float], list[str]]:
    """ZeRO-2's 2-rank checkpoint on one process (4 accumulation steps: the same global batch); then what
    cannot be mapped: another model's checkpoint, a DeepSpeed pipeline's layer_* files."""
    import shutil

    from pipezero.train.checkpoint import CheckpointError

    model = _model()
    engine = initialize(model=model, model_parameters=model.parameters(), config=_config(1, ranks=1))[0]
    engine.load_checkpoint(f"{root}/z2")
    losses = _engine_steps(engine, range(SAVED_AT, SAVED_AT + RESUMED))
    errors = []
    other = transformers.AutoModelForCausalLM.from_config(_hf_config(layers=3))  # one layer more
    engine = initialize(model=other, model_parameters=other.parameters(), config=_config(1, ranks=1))[0]
    piped = f"{root}/piped/global_step{SAVED_AT}"
    shutil.copytree(f"{root}/z2/global_step{SAVED_AT}", piped)
    open(f"{piped}/layer_01-model_states.pt", "wb").close()
    for path in (f"{root}/z2", f"{root}/piped"):
        with pytest.raises(CheckpointError) as err:
            engine.load_checkpoint(path, tag=f"global_step{SAVED_AT}")
        errors.append(str(err.value))
    return losses, errors


def test_deepspeed_checkpoints_resume_with_deepspeeds_losses(tmp_path):
    root, hf_dir = str(tmp_path), str(tmp_path / "hf")
    _model().save_pretrained(hf_dir)
    truth = run(_on_deepspeed, 2, _deepspeed_truth, root, timeout=300, discard=True)[0]
    ours = run(_on_pipezero, 2, _pipezero_resumes, root, hf_dir, timeout=300)[0]
    ours[(2, "one process", 1)], (missing, piped) = run(_on_pipezero, 1, _one_process, root)[0]
    for (stage, how, zero), losses in ours.items():
        where = f"DeepSpeed ZeRO-{stage} resumed by pipezero ({how}, ZeRO-{zero})"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(truth[stage]), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{where}: {m}")
    assert "model.layers.2." in missing and "z2/global_step2" in missing, missing
    assert "layer_01-model_states.pt" in piped and "pipeline" in piped, piped
