"""Short training jobs run as real processes, for the exit-code test (tests/test_exit.py).

    python tests/jobs/exit_job.py CASE [CASE ...]      # CASE = STAGE-OFFLOAD-PRECISION-KIND-DESTROY

STAGE 0-3; OFFLOAD none|optimizer|both; PRECISION fp32|fp16|bf16; KIND model (the seed's
loop: a small MLP through initialize, DeepSpeed-style) or pipe (a tiny GPT through build,
one stage per rank); DESTROY yes|no (whether the job calls destroy_process_group itself).

torch is imported once here; each case forks two ranks that set up a gloo group, train
three steps and then leave the way a script does (the end of the file: atexit, interpreter
finalisation). One line per case reports the ranks' exit codes: "CASE 0 0".
"""

import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPTConfig, gpt_loss, gpt_specs  # noqa: E402

from pipezero.train import build, initialize  # noqa: E402

WORLD = 2


def ds_config(stage: str, offload: str, precision: str, kind: str) -> dict:
    zero = {"stage": int(stage), "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto"}
    if offload in ("optimizer", "both"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "both":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2 if kind == "pipe" else 1,
           "zero_optimization": zero, "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
           "bf16": {"enabled": precision == "bf16"}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    if kind == "pipe":
        cfg["pipeline"] = {"stages": WORLD}
    return cfg


def train(case: str) -> None:
    """One rank of one case: three steps, then (maybe) destroy the process group."""
    stage, offload, precision, kind, destroy = case.split("-")
    gen = torch.Generator().manual_seed(0)
    if kind == "model":  # no hidden_size: "auto" sizes follow the model's width
        model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(),
                                     config=ds_config(stage, offload, precision, kind))
        for _ in range(3):
            x, y = torch.randn(4, 32, generator=gen), torch.randint(0, 4, (4,), generator=gen)
            engine.backward(nn.functional.cross_entropy(engine(x.to(engine.dtype)).float(), y))
            engine.step()
    else:
        parts = build(ds_config(stage, offload, precision, kind), loss_fn=gpt_loss, hidden_size=16,
                      specs=gpt_specs(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)))
        for _ in range(3):
            tokens = torch.randint(0, 256, (8, 9), generator=gen)
            parts.runner.train_step(tokens[:, :-1], tokens[:, 1:])
            parts.optimizer.step()
            parts.optimizer.zero_grad()
    if destroy == "yes":
        dist.destroy_process_group()


def launch(case: str) -> bool:
    """Fork the ranks of one case; True in a child (which then trains and leaves normally)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD),
                              RANK=str(rank), LOCAL_RANK=str(rank))
            train(case)
            return True
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(case, *codes, flush=True)
    return False


if __name__ == "__main__":
    for case in sys.argv[1:]:
        if launch(case):
            break  # a child: fall off the end of the script, as a user's job does
