"""Beyond one machine, on one machine: two torchrun agents as two nodes, an elastic restart, the Slurm script.

* Two agents (c10d rendezvous, --nnodes 2, 2 processes each) run the main job's short form on
  pipe 2 x data 2 and log exactly the losses of one 4-process run; their rendezvous logs show
  each stage's data group on one node and the pipeline across the two.
* Elastic: --nnodes 1:2, one agent stopped (SIGTERM, a preempted node) after the step-K
  checkpoint; the other restarts on 2 processes (pipe 2 x data 1) with twice the accumulation
  steps, keeps the global batch and every loss stays within 1e-5 of the 4-process run.
* The same resume on half the data degree through the harness's pools (no torchrun start-up).
* The Slurm script: its shell syntax, and the torchrun line it builds has the flags used here.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

from harness import run
from pipezero.topology import rank_coords
from pipezero.train.config.batch import BatchConfig, keep_global_batch
from pipezero.config_fields import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "train_gpt.sbatch"
sys.path.insert(0, str(ROOT / "examples"))

N, K = 8, 4  # steps, and the checkpoint after which a node is lost
ARGS = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
        "--micro-batches", "2", "--pipe", "2", "--steps", str(N), "--save-interval", str(K),
        "--eval-interval", "100", "--steps-per-print", "100"]
# quick re-rendezvous on one machine: a lost agent is noticed after 3 missed 1 s heartbeats
FAST_RDZV = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def launch_flags(nnodes: str, endpoint: str, rdzv_id: str) -> list[str]:
    """The torchrun flags of a multi-node launch, as examples/slurm/train_gpt.sbatch builds them."""
    return ["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]


# -- runs ----------------------------------------------------------------------------------------------

class _Stop(Exception):
    """Ends a run at the top of a step, on every rank alike."""


def _main(out: str, stop_at: int | None = None) -> None:
    """examples/train_gpt.py in a harness worker, stopped at the top of step `stop_at` if given."""
    import train_gpt

    from pipezero.train.data import ShardedBatches
    real = ShardedBatches.next_batch

    def next_batch(self):  # the training batch of step `stop_at` is never taken
        if self.split == "train" and self.epoch * self.steps_per_epoch + self.step == stop_at:
            raise _Stop
        return real(self)

    ShardedBatches.next_batch = next_batch
    try:
        train_gpt.main(["--out", out, *ARGS])
    except _Stop:
        pass
    finally:
        ShardedBatches.next_batch = real


def _agents(out: Path, nnodes: str, rdzv_conf: list[str], env: list[dict], restarts: int = 0,
            script: Path = ROOT / "examples" / "train_gpt.py") -> list[tuple[int, str]]:
    """Start one torchrun agent per entry of `env` on one rendezvous; (exit code, log) of each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], [out.parent / f"{out.name}.agent{i}.log" for i in range(len(env))]
    for conf, extra, log in zip(rdzv_conf, env, logs):
        cmd = [sys.executable, "-m", "torch.distributed.run",
               *launch_flags(nnodes, f"127.0.0.1:{port}", "pipezero-test"), f"--max-restarts={restarts}",
               *(["--rdzv-conf", conf] if conf else []), str(script),
               "--out", str(out), *ARGS]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO", **extra}
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the agent stops its own workers
                p.wait(timeout=60)
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def losses(out: Path) -> dict[int, float]:
    """train/loss by step from a run's TensorBoard logs (a resumed run appends to the same folder)."""
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


def _rendezvous(log: str) -> list[tuple[int, list[int], list[int]]]:
    """(restart_count, global_ranks, global_world_sizes) of every rendezvous an agent logged."""
    pattern = r"restart_count=(\d+).*?global_ranks=\[([\d, ]*)\].*?global_world_sizes=\[([\d, ]*)\]"
    ints = lambda text: [int(v) for v in text.split(",") if v.strip()]  # noqa: E731
    return [(int(c), ints(r), ints(w)) for c, r, w in re.findall(pattern, log, re.S)]


def _manifest(out: Path, step: int) -> dict:
    return json.loads((out / "checkpoints" / f"step_{step:08d}" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def straight_4(tmp_path_factory) -> Path:
    """The uninterrupted pipe 2 x data 2 run of N steps, on 4 processes of one launch."""
    out = tmp_path_factory.mktemp("straight4")
    run(_main, 4, str(out), timeout=240)
    return out


# -- two nodes ------------------------------------------------------------------------------------------

def test_two_agents_match_one_launch_and_keep_data_groups_inside_a_node(straight_4, tmp_path):
    out = tmp_path / "two_nodes"
    agents = _agents(out, "2", ["", ""], [{}, {}])
    for code, log in agents:
        assert code == 0, log[-4000:]
    nodes = [set(_rendezvous(log)[0][1]) for _, log in agents]  # the global ranks each agent got
    assert sorted(map(sorted, nodes)) == [[0, 1], [2, 3]]
    for ranks in nodes:  # one pipeline stage per node: its whole data group, never half a pipeline
        coords = [rank_coords(r, (2, 2, 1)) for r in ranks]
        assert len({c.pipe for c in coords}) == 1 and {c.data for c in coords} == {0, 1}
    assert losses(out) == losses(straight_4)


# -- elastic: a node lost, the job goes on with fewer ------------------------------------------------------

def _check_resumed_on_half(out: Path, straight: Path) -> None:
    """The last checkpoint is from 2 processes that kept the global batch; losses match the straight run."""
    manifest = _manifest(out, N)
    assert manifest["world"] == 2 and manifest["grid"]["data"] == 1
    assert manifest["meta"]["batch"] == {"train_batch_size": 8, "micro_batch_size": 2,
                                         "accumulation_steps": 4, "data_degree": 1}
    assert _manifest(out, K)["meta"]["batch"]["data_degree"] == 2
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == K
    truth, resumed = losses(straight), losses(out)
    assert sorted(resumed) == list(range(1, N + 1))
    torch.testing.assert_close(torch.tensor([resumed[s] for s in range(1, N + 1)]),
                               torch.tensor([truth[s] for s in range(1, N + 1)]), rtol=0, atol=1e-5)


def test_elastic_restart_on_fewer_nodes_keeps_the_global_batch(straight_4, tmp_path):
    out = tmp_path / "elastic"
    # agent 0 hosts the rendezvous store and survives; agent 1 stops itself at step K (the fault is
    # injected by tests/faults/crash_train_gpt.py, which runs the example)
    (code0, log0), (code1, log1) = _agents(out, "1:2", [f"is_host=1,{FAST_RDZV}", f"is_host=0,{FAST_RDZV}"],
                                           [{}, {"PIPEZERO_STOP_AGENT_AT": str(K)}], restarts=1,
                                           script=ROOT / "tests" / "faults" / "crash_train_gpt.py")
    assert code0 == 0, log0[-4000:]
    assert code1 != 0 and "PIPEZERO_STOP_AGENT_AT: stopping this node's agent at step 4" in log1
    rounds = _rendezvous(log0)
    assert (rounds[0][0], rounds[0][2]) == (0, [4, 4]) and (rounds[-1][0], rounds[-1][2]) == (1, [2, 2])
    assert "4 accumulation steps (it had 2) keep its global batch of 8" in log0
    _check_resumed_on_half(out, straight_4)


def test_resume_on_half_the_data_degree_keeps_the_global_batch(straight_4, tmp_path):
    run(_main, 4, str(tmp_path), K, timeout=240)  # 4 processes until the step-K checkpoint
    run(_main, 2, str(tmp_path), timeout=240)     # the same command on 2: pipe 2 x data 1
    _check_resumed_on_half(tmp_path, straight_4)


def _batch(tbs: int, mbs: int, gas: int, dp: int) -> BatchConfig:
    return BatchConfig(train_batch_size=tbs, micro_batch_size=mbs, accumulation_steps=gas, data_degree=dp)


def test_keep_global_batch_rule():
    saved = _batch(16, 2, 2, 4)
    assert keep_global_batch(_batch(8, 2, 2, 2), saved) == _batch(16, 2, 4, 2)    # fewer nodes: more steps
    assert keep_global_batch(_batch(4, 2, 2, 1), saved) == _batch(16, 2, 8, 1)
    assert keep_global_batch(_batch(32, 2, 2, 8), saved) == _batch(16, 2, 1, 8)   # more nodes: fewer
    assert keep_global_batch(_batch(8, 2, 1, 4), saved) == _batch(8, 2, 1, 4)     # same degree: untouched
    assert keep_global_batch(_batch(8, 2, 2, 2), None) == _batch(8, 2, 2, 2)      # no checkpoint
    with pytest.raises(ConfigError, match=r"16 is not divisible by micro batch 2 x data degree 3 = 6"):
        keep_global_batch(_batch(12, 2, 2, 3), saved)


# -- the Slurm script -------------------------------------------------------------------------------------

def _sbatch(tmp_path: Path, **env: str) -> list[str]:
    """The command the script hands to srun, with fake scontrol/srun on PATH and a 2-node allocation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\nprintf "gpu-node-07\\ngpu-node-08\\n"\n')
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path / "srun.args"}\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    slurm = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_JOB_ID": "4242",
             "SLURM_GPUS_ON_NODE": "2"}
    mine = {k: v for k, v in os.environ.items() if k != "OUT"}  # the script's own knob (some CI machines set it)
    full_env = {**mine, **slurm, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(SBATCH), "--steps", "10"], check=True, env=full_env, cwd=ROOT,
                   capture_output=True, text=True, timeout=30)
    return (tmp_path / "srun.args").read_text().splitlines()


def test_slurm_script_syntax():
    done = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("min_nodes, nnodes", [(None, "2"), ("1", "1:2")])
def test_slurm_script_builds_the_tested_torchrun_line(tmp_path, min_nodes, nnodes):
    args = _sbatch(tmp_path, **({"MIN_NODES": min_nodes} if min_nodes else {}))
    line = args[args.index("torchrun"):]
    script = line.index("examples/train_gpt.py")
    flags = dict(zip(line[1:script:2], line[2:script:2]))
    assert flags.items() >= dict(zip(*[iter(launch_flags(nnodes, "gpu-node-07:29500", "4242"))] * 2)).items()
    assert flags["--max-restarts"] == "3"
    assert line[script:] == ["examples/train_gpt.py", "--out", "runs/gpt", "--steps", "10"]
