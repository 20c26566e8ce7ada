"""The benchmarks' --tiny forms run on CPU as their docstrings show, and measure the same work.

bench/moe.py --tiny: every runner on a tiny Qwen3-MoE (fp32) in one process. pipezero and the
transformers runners start from the same weights and train the same tokens, so their first
losses (the cross-entropy plus the load-balancing term) agree; a runner that cannot run on CPU
(the Hub-kernel experts, torchtitan without its package or a CPU attention backward) names why.
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _table(out: str) -> dict[str, list[str]]:
    """The printed table's rows by run name (the header and its rule left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| run |")]
    return {row[0]: row[1:] for row in rows}


def test_moe_bench_tiny_runs_every_runner_on_the_same_work():
    from bench.moe import DEFAULT_RUNS

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--tiny"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _table(done.stdout)
    assert list(rows) == list(DEFAULT_RUNS), done.stdout
    measured = ["pipezero", "pipezero-compiled", "hf-grouped_mm", "hf-grouped_mm-compiled", "hf-batched_mm",
                "hf-eager"]
    for run in measured:
        assert float(rows[run][0].replace(",", "")) > 0, (run, rows[run])
    first = {run: float(rows[run][-1]) for run in measured}
    for run, loss in first.items():
        assert loss == pytest.approx(first["hf-grouped_mm"], abs=1e-4), (run, first)
    for run in ("hf-sonicmoe", "hf-deepgemm", "torchtitan"):  # a reason, not a number, on CPU
        assert rows[run][0] and not rows[run][0][0].isdigit(), (run, rows[run])
