"""The one training loop (train/loop.py) behind the three doors, and its rules held once.

The loop, on a one-stage GPT with a Door whose third step's gradients are inf, trains to exactly
the losses, learning rates and parameters of the same parts driven by hand with the rule written
out (the chain's step, the LR schedule only if it stepped, zero_grad): the skipped step leaves the
LR, and the loop evaluates, saves and prints at its cadence, keeping the two newest checkpoints.
The doors (the main job, pipezero finetune, initialize's engine) hold none of those rules
themselves: their source names none of the calls the loop owns.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from harness import run

ROOT = Path(__file__).resolve().parents[1]
DOORS = ("train/gpt/job.py", "train/finetune.py", "train/initialize.py")
STEPS, BAD_STEP = 6, 3  # BAD_STEP's gradients are inf (1-based): the chain skips it


def _parts(out: str):
    from pipezero.train.build import build
    from pipezero.train.gpt.model import GPTConfig, gpt_loss, gpt_specs

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
           "steps_per_print": 4, "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}}}
    return build(cfg, specs=gpt_specs(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)), loss_fn=gpt_loss)


def _batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(x, x) for x in (torch.randint(0, 256, (4, 8), generator=g) for _ in range(n))]


class _Poison:
    """Makes every gradient of the first parameter inf while `on` (the step the chain must skip)."""

    def __init__(self, parts):
        self.on = False
        next(parts.module.parameters()).register_hook(lambda g: g * float("inf") if self.on else g)


class _Door:
    """A door that records what the loop asks of it; its checkpoints are the real ones (save_state)."""

    def __init__(self, parts, out: str):
        self.parts, self.out, self.poison = parts, Path(out), _Poison(parts)
        self.batches, self.saved, self.printed, self.lrs = iter(_batches(STEPS, 1)), [], [], []

    def next_batch(self):
        self.poison.on = len(self.lrs) + 1 == BAD_STEP
        return next(self.batches)

    def tokens(self, inputs) -> int:
        return inputs.numel()

    def save(self, step: int, loss: float) -> Path:
        from pipezero.train.checkpoint.state import save_state

        self.saved.append(step)
        return save_state(self.parts, self.out / "checkpoints", step)

    def numbers(self, step, printing: bool):
        self.lrs.append((step.done, step.lr, step.stepped, step.loss))
        if printing:
            self.printed.append(step.done)
        return {"door/step": float(step.done)}, [f"door {step.done}"]


class _HeldOut:
    steps_per_epoch = 2

    def __init__(self):
        self.batches, self.calls = _batches(2, 2), 0

    def load_state_dict(self, state: dict) -> None:
        self.at = state["step"]
        self.calls += 1

    def next_batch(self):
        self.at += 1
        return self.batches[self.at - 1]


def _through_the_loop(out: str) -> dict:
    from pipezero.train.loop import Cadence, HeldOut, train_loop

    parts = _parts(out)
    door, held_out = _Door(parts, out), _HeldOut()
    last = train_loop(parts, door, HeldOut(held_out, 4, "val"), Cadence(STEPS, 4, 2, 4), 0)
    return {"steps": door.lrs, "last": last, "saved": door.saved, "printed": door.printed,
            "evals": held_out.calls, "kept": sorted(p.name for p in (Path(out) / "checkpoints").glob("step_*")),
            "params": [p.detach().clone() for p in parts.module.parameters()]}


def _by_hand(out: str) -> dict:
    """The same parts stepped by the rule written out, the pre-loop doors' code."""
    parts = _parts(out)
    poison, steps = _Poison(parts), []
    for i, (x, y) in enumerate(_batches(STEPS, 1)):
        poison.on = i + 1 == BAD_STEP
        loss = parts.runner.train_step(x, y)
        lr = parts.optimizer.param_groups[0]["lr"]
        stepped = parts.optimizer.step()
        if stepped:
            parts.scheduler.step()
        parts.optimizer.zero_grad()
        steps.append((i + 1, lr, stepped, loss.item()))
    return {"steps": steps, "params": [p.detach().clone() for p in parts.module.parameters()]}


def _both(root: str) -> tuple[dict, dict]:
    return _through_the_loop(f"{root}/loop"), _by_hand(f"{root}/hand")


def test_the_loop_trains_as_the_rule_by_hand_and_keeps_its_cadence(tmp_path):
    loop, hand = run(_both, 1, str(tmp_path))[0]
    assert [s[2] for s in loop["steps"]] == [s != BAD_STEP for s in range(1, STEPS + 1)]
    lrs = [s[1] for s in loop["steps"]]
    assert lrs[BAD_STEP] == lrs[BAD_STEP - 1] and lrs[BAD_STEP - 1] > lrs[BAD_STEP - 2]  # the skip left the LR
    assert loop["steps"] == hand["steps"] and loop["last"] == hand["steps"][-1][3]
    for p, q in zip(loop["params"], hand["params"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert loop["saved"] == [2, 4, 6] and loop["kept"] == ["step_00000004", "step_00000006"]
    assert loop["printed"] == [1, 4, 6] and loop["evals"] == 2  # eval at 4 and at the last step


# what the loop owns; a door that writes one of these again holds its own copy of a rule
_LOOP_CALLS = [r"(opt|optimizer|scheduler)\.step\(\)", r"zero_grad\(", r"Preemption\(", r"prune_checkpoints\(", r"eval_step\(",
               r"TensorBoardWriter\(", r"tok/s", r"steps_per_print ==", r"% args\.(eval|save)_interval"]


def test_the_doors_hold_none_of_the_loops_rules():
    for door in DOORS:
        source = (ROOT / door).read_text()
        found = [pattern for pattern in _LOOP_CALLS if re.search(pattern, source)]
        assert not found, f"{door} repeats the loop's {found}: use train/loop.py's optimizer_step / train_loop"
    loop = (ROOT / "train" / "loop.py").read_text()
    assert all(re.search(pattern, loop) for pattern in _LOOP_CALLS[:7])
