"""A LoRA checkpoint holds the adapters and their optimizer state only, and resumes exactly.

pipe 2 x data 2 (1F1B, ZeRO-1) trains two steps, saves with save_adapters and trains a third;
a fresh pipeline (same base, adapters initialised anew) loads the checkpoint and must train the
third step bit for bit as the first did: same loss, same adapters. The checkpoint must hold
no base weight. Onto another grid (pipe 1 x data 4) the third step must match within fp32 noise.
"""

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs  # noqa: E402
from pipezero.pipe.lora import LoraConfig, adapter_state_dict, lora_specs, trainable_parameters  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.train.checkpoint import load_checkpoint  # noqa: E402
from pipezero.train.config.batch import BatchConfig  # noqa: E402
from pipezero.train.checkpoint.lora_state import load_adapters, save_adapters  # noqa: E402
from pipezero.zero import ZeroOptimizer  # noqa: E402

_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (8, 8), generator=gen), torch.randint(0, 64, (8, 8), generator=gen)


def _parts(path: str, pipe: int, seed: int):
    grid = Grid(pipe=pipe)
    model = PipelineModule(lora_specs(hf_layer_specs(path), CONFIG), grid=grid, loss_fn=causal_lm_loss,
                           partition_method="uniform", seed=seed)
    opt = ZeroOptimizer(torch.optim.AdamW(trainable_parameters(model), lr=1e-2), stage=1, group=grid.data_group)
    batch = BatchConfig(train_batch_size=8, micro_batch_size=8 // grid.data_size // 2, accumulation_steps=2,
                        data_degree=grid.data_size)
    parts = types.SimpleNamespace(module=model, optimizer=opt, grid=grid, scheduler=None, dtype=torch.float32,
                                  config=types.SimpleNamespace(batch=batch))
    return parts, PipelineRunner(model, OneFOneB(num_microbatches=2), optimizer=opt)


def _step(parts, runner, step: int) -> float:
    share = 8 // parts.grid.data_size
    mine = slice(parts.grid.data_rank * share, (parts.grid.data_rank + 1) * share)
    ids, targets = _batch(step)
    loss = runner.train_step(ids[mine], targets[mine]).item()
    parts.optimizer.step()
    parts.optimizer.zero_grad()
    return loss


def _save_then_resume(path: str, ckpt: str):
    parts, runner = _parts(path, 2, seed=0)
    _step(parts, runner, 0), _step(parts, runner, 1)
    save_adapters(parts, ckpt, step=2)
    third = _step(parts, runner, 2)
    after = {n: t.clone() for n, t in adapter_state_dict(parts.module).items()}
    fresh, fresh_runner = _parts(path, 2, seed=7)    # other adapters until the checkpoint is loaded
    assert load_adapters(fresh, ckpt)["step"] == 2
    again = _step(fresh, fresh_runner, 2)
    return third, again, after, {n: t.clone() for n, t in adapter_state_dict(fresh.module).items()}


def _resume_on_one_stage(path: str, ckpt: str):
    parts, runner = _parts(path, 1, seed=3)
    load_adapters(parts, ckpt)
    return _step(parts, runner, 2), {n: t.clone() for n, t in adapter_state_dict(parts.module).items()}


def test_adapters_only_checkpoint_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_LLAMA)).save_pretrained(tmp_path / "base")
    path, ckpt = str(tmp_path / "base"), str(tmp_path / "ckpt")
    results = run(_save_then_resume, 4, path, ckpt)
    for third, again, after, resumed in results:
        assert third == again
        assert after.keys() == resumed.keys() and all(torch.equal(after[n], resumed[n]) for n in after)
    saved = load_checkpoint(ckpt).tensors
    weights = [k for k in saved if k.startswith("model/")]
    assert weights and all(".lora_" in k for k in weights), weights
    assert any(k.startswith("optim/") and k.endswith("/exp_avg") for k in saved)
    assert all(".lora_" in k for k in saved if k.startswith("optim/"))
    truth = {n: t for *_, after, _ in results for n, t in after.items()}
    for loss, adapters in run(_resume_on_one_stage, 4, path, ckpt):
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-5)
        assert adapters.keys() == truth.keys()
        for n in truth:
            torch.testing.assert_close(adapters[n], truth[n], rtol=1e-5, atol=1e-5, msg=n)
