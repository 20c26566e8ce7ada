"""The benchmarks' --tiny forms run on CPU as their docstrings show, and measure the same work.

bench/moe.py --tiny: every runner on a tiny Qwen3-MoE (fp32) in one process. pipezero and the
transformers runners start from the same weights and train the same tokens, so their first
losses (the cross-entropy plus the load-balancing term) agree; a runner that cannot run on CPU
(the Hub-kernel experts, torchtitan without its package or a CPU attention backward) names why.
bench/moe.py --nproc's runs (issue 49's multi-GPU benchmark, bench/moe_multi.py), measured on the
harness's two gloo ranks as --tiny measures them: expert parallel 2 and pipe 2 under DualPipeV (the
final norm's load-balancing term crossing a stage in a split backward) train the same batch from the
same weights, so their first losses agree; the expert run's all-to-all is found in its profiled step,
and the pipeline's measured bubble stands beside the planner's. bench/overlap.py, on stand-in profiler
events: only the NCCL kernels launched from inside an all-to-all count, and only their time under other
kernels is hidden.
"""

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _table(out: str) -> dict[str, list[str]]:
    """The printed table's rows by run name (the header and its rule left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| run |")]
    return {row[0]: row[1:] for row in rows}


def test_moe_bench_tiny_runs_every_runner_on_the_same_work_and_explains_each(tmp_path):
    """Every runner on the same batch, and --explain's profiled step of each (its kernel table; the peak by
    place needs CUDA: no file for it here)."""
    from bench.moe import DEFAULT_RUNS

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--tiny", "--explain", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
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
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{run}.txt" for run in measured), done.stdout
    for run in measured:
        assert f"{run}: wall" in (tmp_path / f"{run}.txt").read_text(), run



def _layouts(runs: list[str]) -> dict:
    """bench/moe_multi.py's measure() of each run on this rank of the harness's gloo world (--tiny's args)."""
    sys.path.insert(0, str(ROOT / "bench"))  # the bench scripts import each other by name
    import moe_multi

    args = argparse.Namespace(tiny=True, shape="tiny", layers=None, seq=32, microbatches=2, warmup=1, steps=1,
                              backend="aot_eager", timeout=60, checkpoint="auto")
    config = moe_multi.qwen3_moe_config(args)
    return {run: moe_multi.measure(run, config, args, torch.device("cpu")) for run in runs}


def test_moe_bench_nproc_runs_expert_parallel_and_dualpipev_on_the_same_batch():
    from harness import run

    rows = run(_layouts, 2, ["expert", "dualpipev", "expert-overlap"], timeout=200)[0]
    expert, dualpipev = rows["expert"], rows["dualpipev"]
    assert rows["expert-overlap"]["loss"] == pytest.approx(expert["loss"], abs=1e-5), rows  # the halves: same loss
    assert expert["layout"].startswith("p1 d1 e2") and dualpipev["layout"].startswith("p2 d1 t1 dualpipev"), rows
    assert expert["ms"] > 0 and dualpipev["ms"] > 0 and expert["tokens"] == dualpipev["tokens"] == 2 * 2 * 32
    assert expert["loss"] == pytest.approx(dualpipev["loss"], abs=1e-5), rows  # same weights, same batch
    assert expert["a2a_ms"] > 0 and dualpipev["a2a_ms"] == 0, rows  # found in the profile (no expert axis at pipe 2)
    assert 0 <= dualpipev["bubble"] < 1 and 0 < dualpipev["plan_bubble"] < 1 and dualpipev["plan_ms"] > 0, rows


def _event(name, cuda, start, end, thread=1, corr=0, linked=0) -> SimpleNamespace:
    """A stand-in for a kineto event: what bench/overlap.py reads of one (times in ns), each a method."""
    from torch.autograd import DeviceType

    read = dict(name=name, device_type=DeviceType.CUDA if cuda else DeviceType.CPU, start_ns=start,
                duration_ns=end - start, start_thread_id=thread, correlation_id=corr, linked_correlation_id=linked)
    return SimpleNamespace(**{method: (lambda v=value: v) for method, value in read.items()})


def test_overlap_counts_the_all_to_all_kernels_that_ran_beside_compute():
    """On CUDA an NCCL kernel is the all-to-all's when the op that launched it started inside a c10d all-to-all
    op; other NCCL kernels (a pipeline send, ZeRO's gathers), copies and the ops themselves are neither."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    from overlap import all_to_all_overlap

    events = [_event("c10d::alltoall_base_", False, 0, 10, corr=1), _event("record_param_comms", False, 2, 8, corr=2),
              _event("c10d::send", False, 20, 22, corr=3), _event("aten::mm", False, 30, 31, corr=4),
              _event("ncclDevKernel_SendRecv", True, 100, 200, linked=2),  # the all-to-all: 100 ns
              _event("ncclDevKernel_SendRecv", True, 150, 400, linked=3),  # a pipeline send: not counted
              _event("Memcpy DtoD", True, 100, 200, linked=4),
              _event("sm90_gemm", True, 170, 190, linked=4), _event("sm90_gemm", True, 180, 240, linked=4)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    a2a, hidden = all_to_all_overlap(prof)
    assert a2a == pytest.approx(100e-9) and hidden == pytest.approx(30e-9)  # the GEMMs cover 170..200


def test_memory_history_names_what_is_alive_at_the_peak():
    """bench/memory_history.py on a stand-in allocator trace: the peak is the running sum's largest value
    (frees counted when completed), and what is alive then is grouped by its innermost frames outside torch."""
    sys.path.insert(0, str(ROOT / "bench"))
    from memory_history import summarize

    def at(file, line, name="f"):
        return {"filename": file, "line": line, "name": name}
    loss = [at("/x/torch/nn/functional.py", 1), at("/w/pipe/fused_loss.py", 160, "_chunk")]
    layer = [at("/tmp/torchinductor_u/ab/cab.py", 9, "call"), at("/w/pipe/hf/layers.py", 200, "forward")]
    trace = [{"action": "alloc", "addr": 1, "size": 300, "frames": layer},
             {"action": "alloc", "addr": 2, "size": 500, "frames": loss},
             {"action": "free_requested", "addr": 2, "size": 500, "frames": loss},
             {"action": "alloc", "addr": 3, "size": 400, "frames": layer},   # 2 is still held: the peak, 1200
             {"action": "free_completed", "addr": 2, "size": 500, "frames": loss},
             {"action": "alloc", "addr": 4, "size": 100, "frames": loss}]
    lines = summarize(trace, start=2**30)
    assert lines[0].startswith("allocated at the start 1.00 GiB; peak 1.00 GiB (+0.00) at event 3 of 6"), lines
    assert "cab.py:9 call < layers.py:200 forward" in lines[1] and " 2 x " in lines[1], lines
    assert "fused_loss.py:160 _chunk" in lines[2] and "functional.py" not in lines[2], lines
    assert len(lines) == 3, lines


def test_pipe_bench_costs_leave_out_a_pair_run_in_turns():
    """bench/pipe.py's per-op means read each compute span's action; a pair's span ("0F3|1B1", overlap_pairs)
    is no one op's time: left out, the singles' means as before."""
    from bench.pipe import _costs
    from pipezero.pipe.schedule.timeline import Event

    events = [Event("0F0", "compute", 0, 0.0, 1.0), Event("0F1", "compute", 0, 1.0, 4.0),
              Event("0F2|1B0", "compute", 0, 4.0, 9.0), Event("1B1", "compute", 0, 9.0, 11.0),
              Event("wait", "comm", 0, 11.0, 12.0)]
    costs = _costs(events)
    assert costs["all"] == {"F": 2.0, "B": 2.0}
    assert costs[(0, 0)] == {"F": 2.0} and costs[(0, 1)] == {"B": 2.0}
