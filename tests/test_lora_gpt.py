"""LoRA on the project's GPT (examples/gpt.py) through the pipeline equals apply_lora on the one-process GPT.

pipe 2 x data 1 under ZB-V (the tied embedding and head on one rank) with activation
checkpointing, ZeRO-1, against the single-process GPT with the same adapters trained with
plain AdamW on the whole batch: the same losses and adapters (fp32 1e-5), the frozen base
unchanged bit for bit.
"""

import sys
from pathlib import Path

import torch

from harness import run
from pipezero.pipe import PipelineModule, PipelineRunner, ZeroBubbleV
from pipezero.pipe.lora import (LoraConfig, adapter_state_dict, apply_lora, load_adapter_state_dict, lora_specs,
                                trainable_parameters)
from pipezero.topology import Grid
from pipezero.zero import ZeroOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, gpt_loss, gpt_specs  # noqa: E402

CFG = GPTConfig(vocab_size=64, n_layer=3, n_head=2, d_model=16, seq_len=8, seed=1)
LORA = LoraConfig(r=2, lora_alpha=4, target_modules=["qkv", "fc", "out"])
STEPS, LR = 3, 1e-2


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, 64, (4, 8), generator=gen), torch.randint(0, 64, (4, 8), generator=gen)


def _truth() -> tuple[dict, list[float], dict, dict]:
    model = GPT(CFG)
    assert len(apply_lora(model, LORA)) == 9
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    start = {n: t.clone() for n, t in adapter_state_dict(model).items()}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(trainable_parameters(model), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = gpt_loss(model(_batch(step)[0]), _batch(step)[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    return start, losses, adapter_state_dict(model), base


def _train(start: dict) -> tuple[list[float], dict, dict]:
    grid = Grid(pipe=2)
    model = PipelineModule(lora_specs(gpt_specs(CFG), LORA), grid=grid, loss_fn=gpt_loss, num_chunks=2,
                           placement="v", activation_checkpoint_interval=1)
    load_adapter_state_dict(model, start)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = ZeroOptimizer(torch.optim.AdamW(trainable_parameters(model), lr=LR), stage=1, group=grid.data_group)
    runner = PipelineRunner(model, ZeroBubbleV(num_microbatches=2), optimizer=opt)
    losses = []
    for step in range(STEPS):
        losses.append(runner.train_step(*_batch(step)).item())
        opt.step()
        opt.zero_grad()
    same = all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    return losses, {n: t.clone() for n, t in adapter_state_dict(model).items()}, same


def test_gpt_lora_pipe2_zbv_equals_one_process():
    start, losses, adapters, _ = _truth()
    seen = set()
    for got_losses, got, same in run(_train, 2, start):
        assert same
        torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=1e-5)
        for n, t in got.items():
            torch.testing.assert_close(t, adapters[n], rtol=1e-5, atol=1e-5, msg=n)
            seen.add(n)
    assert seen == set(adapters)
