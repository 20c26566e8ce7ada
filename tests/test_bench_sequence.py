"""bench/sequence_scaling.py (issue 48) runs its layouts on CPU, and counts what crosses stages as it should.

Its cases run on 4 gloo ranks at the tiny Llama's shape, one timed step each (the GPU run is the same
code at the 8B shape): Ulysses 2 x data 2, and pipe 2 under ZB-V with ZeRO-3 without and with a
sequence axis of 2. A rank of pipe 2 sends the other stage per micro-batch one [1, T, hidden] hidden
state with its [1, T] int64 position ids forward and the hidden state's gradient backward (what the
runner hands to P2P, counted by comm's TRAFFIC); split over sequence 2 each slice is half as long, so
exactly half the bytes (the issue's "divided by the degree").
The planner predicts every pipezero layout the bench builds (ALST's: none).
"""

import pytest

pytest.importorskip("transformers")

from harness import run  # noqa: E402

from bench.sequence_cases import Case, Options, run_cases  # noqa: E402
from bench.sequence_scaling import KITS, pipe_cases, predict_case, sequence_cases  # noqa: E402

LENGTH, HIDDEN = 256, 128  # the tiny shape's hidden size (bench/long_context.SHAPES)


def test_cases_run_on_four_ranks_and_pipe_bytes_halve_under_sequence_2():
    options = Options(shape="tiny", length=LENGTH, steps=1)
    cases = [Case("ulysses-2", sequence=2, rows=4), Case("pipe2-zbv", pipe=2, schedule="zbv", rows=8),
             Case("pipe2-seq2-zbv", pipe=2, sequence=2, schedule="zbv", rows=8)]
    results = {r["case"]: r for r in run(run_cases, 4, cases, options, timeout=240)[0]}
    for name, r in results.items():
        assert r["tokens_per_s_gpu"] > 0 and r["peak_gb"] > 0 and r["seconds"] > 0, (name, r)
    assert results["ulysses-2"]["stage_bytes_mb"] is None  # one stage: nothing crosses
    fp32, int64 = 4, 8
    assert results["pipe2-zbv"]["stage_bytes_mb"] == 2 * LENGTH * HIDDEN * fp32 + LENGTH * int64
    assert results["pipe2-seq2-zbv"]["stage_bytes_mb"] == results["pipe2-zbv"]["stage_bytes_mb"] / 2


def test_the_planner_predicts_every_pipezero_layout_the_bench_builds():
    from pipezero.train.plan.hardware import h100

    options = Options(shape="llama3-8b", layers=8, length=65536)
    for world in (2, 4, 8):
        cases = sequence_cases(world, heads=32) + pipe_cases(world)
        assert {c.name for c in cases} >= {"data", "ulysses-2", "alst-2", "pipe2-zbv", "pipe2-dualpipev"}
        assert ("pipe2-seq2-zbv" in {c.name for c in cases}) == (world >= 4)
        for case in cases:
            pred = predict_case(case, options, KITS["device"], world, h100(1, world), "bf16")
            assert (pred is None) == case.alst, case
            if pred is not None:
                assert pred.layout.world == world and pred.layout.sequence == case.sequence, case
                assert pred.tokens_per_step == case.rows * 65536 and pred.time.total > 0, case


def test_one_launch_keeps_alst_and_the_walk_apart_and_a_failed_launch_names_its_cause():
    """No process: --one-launch puts the pipezero cases of every group in one launch, each ALST case and each
    length of the walk in their own (ALST's Ulysses replaces transformers' attention for the process); a
    launch's failure is the first exception a worker raised, an out of memory, or a kill."""
    from argparse import Namespace

    pytest.importorskip("deepspeed")  # else the ALST cases are refused before any launch
    from bench.sequence_scaling import Group, _failure, _launches, longest_cases

    options = Options(shape="tiny", length=LENGTH)
    groups = [Group(name, cases, options, {}) for name, cases in
              (("sequence", sequence_cases(4, 4)), ("pipe", pipe_cases(4)),
               ("longest", longest_cases(4, 4, [256, 512])))]
    known: dict = {}
    launches = _launches(groups, Namespace(one_launch=True), 4, known)
    names = [[c.name for c in cases] for cases, _ in launches]
    assert names[0] == ["data", "ulysses-2", "ulysses-4", "pipe2-zbv", "pipe2-dualpipev", "pipe2-seq2-zbv",
                        "pipe2-seq2-dualpipev"], names
    assert names[1:] == [["alst-2"], ["alst-4"], ["longest-256"], ["longest-512"]], names
    assert _failure("Traceback\n[rank1]: ValueError: case x: pipe 2\ntorch.distributed.elastic.multiprocessing."
                    "errors.ChildFailedError: \n", 1) == "ValueError: case x: pipe 2"
    assert _failure("torch.OutOfMemoryError: CUDA out of memory. Tried", 1) == "out of memory"
    assert "killed" in _failure("exitcode  : -9 (pid: 12)\nSignal 9 (SIGKILL) received", 1)
