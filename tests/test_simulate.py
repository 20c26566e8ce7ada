"""Simulator: the published bubble and memory results, exactly; rendering of a simulated run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipezero.pipe import (Costs, Custom, DualPipeV, GPipe, Interleaved1F1B, OneFOneB, Op, ZeroBubbleH1,
                           ZeroBubbleV, simulate, to_chrome_trace, to_image, to_png, to_text)
from pipezero.pipe.schedule.render import COLORS

P_RANGE = range(1, 9)
M_RANGE = range(1, 33)
SAME_FB = Costs(forward=2, backward_input=1, backward_weight=1)  # F = B = I + W


@pytest.mark.parametrize("p", P_RANGE)
def test_gpipe_and_1f1b_bubble_and_memory(p):
    for m in M_RANGE:
        for sched in (GPipe(m), OneFOneB(m)):
            res = simulate(sched, p, SAME_FB)
            assert res.makespan == (m + p - 1) * 4, (sched, p)  # (m+p-1)(F+B)
            assert res.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert simulate(OneFOneB(m), p).peak_activations[0] == min(p, m)
        assert simulate(GPipe(m), p).peak_activations[0] == m


@pytest.mark.parametrize("p", P_RANGE)
def test_interleaved_bubble(p):
    # per-chunk costs are a stage's divided by v; the fraction is the same for any common scale
    for v in (2, 3, 4):
        for m in range(p, 33, p):
            res = simulate(Interleaved1F1B(m, num_chunks=v), p, SAME_FB)
            assert res.makespan == (v * m + p - 1) * 4, (p, m, v)
            assert res.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    m = 2 * p
    scaled = simulate(Interleaved1F1B(m), p, Costs(forward=0.5, backward_input=0.25, backward_weight=0.25))
    assert scaled.makespan == (2 * m + p - 1) * (0.5 + 0.5) and scaled.bubble == pytest.approx((p - 1) / (2 * m + p - 1))


@pytest.mark.parametrize("p", P_RANGE)
def test_zero_bubble_h1_a_third_of_1f1b_idle_at_1f1b_memory(p):
    for m in M_RANGE:
        zb, base = simulate(ZeroBubbleH1(m), p), simulate(OneFOneB(m), p)  # F = I = W = 1
        if m >= p:
            assert zb.idle * 3 == base.idle
            assert zb.idle == p * (p - 1)  # each rank idles (p-1) F's worth
        else:
            assert zb.idle < base.idle or p == 1
        assert max(zb.peak_activations.values()) == max(base.peak_activations.values()) == min(p, m)


@pytest.mark.parametrize("p", P_RANGE)
def test_zero_bubble_v_reaches_the_fill_bound(p):
    # rank p-1 cannot start before p-1 chunk forwards have passed, and each rank has 6m work:
    # ZB-V reaches makespan 6m + p - 1 exactly once m >= 2p - 1 (bubble (p-1)/(6m+p-1)).
    for m in M_RANGE:
        res = simulate(ZeroBubbleV(m), p)
        if m >= 2 * p - 1:
            assert res.makespan == 6 * m + p - 1, (p, m)
            assert res.bubble == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
            assert max(res.peak_stage_activations().values()) == p  # 1F1B's peak, in stages
        assert max(res.peak_stage_activations().values()) <= max(p, min(m, p)), (p, m)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dual_pipe_v_run_in_order(p):
    # run one action at a time (no F/B overlap), DualPipeV has ZB-V's makespan and holds one
    # more chunk activation (its full backwards in the middle free them later)
    for m in range(2 * p, 33, 3):
        dual, zbv = simulate(DualPipeV(m), p), simulate(ZeroBubbleV(m), p)
        assert dual.makespan == zbv.makespan == 6 * m + p - 1, (p, m)
        assert max(dual.peak_activations.values()) == 2 * p + 1


def test_zero_bubble_v_beats_1f1b_and_h1_at_equal_work():
    p, m = 4, 16
    chunk = Costs(forward=1, backward_input=1, backward_weight=1)
    stage = Costs(forward=2, backward_input=2, backward_weight=2)   # one stage = two chunks
    v, h1, base = simulate(ZeroBubbleV(m), p, chunk), simulate(ZeroBubbleH1(m), p, stage), \
        simulate(OneFOneB(m), p, stage)
    assert v.bubble < h1.bubble < base.bubble
    assert v.idle * 2 == h1.idle and v.idle * 6 == base.idle


def test_p2p_latency_gpipe():
    p, m, c = 3, 4, 0.5
    res = simulate(GPipe(m), p, Costs(forward=1, backward_input=0.5, backward_weight=0.5, p2p=c))
    assert res.makespan == 2 * m + 2 * (p - 1) * (1 + c)
    same_rank = simulate(GPipe(m), 1, Costs(p2p=10.0))  # no cross-rank edges: no latency
    assert same_rank.makespan == m * 3


def test_timeline_respects_dependencies_and_rank_order():
    res = simulate(ZeroBubbleV(5), 3, Costs(forward=1.0, backward_input=1.5, backward_weight=0.5, p2p=0.25))
    by_rank: dict[int, list] = {}
    for e in res.timeline:
        by_rank.setdefault(e.rank, []).append(e)
        assert e.end - e.start == pytest.approx({Op.FORWARD: 1.0, Op.BACKWARD_INPUT: 1.5,
                                                 Op.BACKWARD_WEIGHT: 0.5}[e.action.op])
    for r, evs in by_rank.items():
        evs.sort(key=lambda e: e.step)
        assert all(a.end <= b.start for a, b in zip(evs, evs[1:]))
    end = {(e.rank, str(e.action)): e.end for e in res.timeline}
    # V placement, p = 3: stage 2 (rank 2, chunk 0) feeds stage 3 (rank 2, chunk 1) locally,
    # stage 3 feeds stage 4 (rank 1, chunk 1) across ranks (+p2p)
    start = {(e.rank, str(e.action)): e.start for e in res.timeline}
    assert start[(2, "1F0")] >= end[(2, "0F0")]
    assert start[(1, "1F0")] >= end[(2, "1F0")] + 0.25
    assert start[(2, "1I0")] >= end[(1, "1I0")] + 0.25


def test_costs_checked():
    with pytest.raises(ValueError, match="Costs.forward=-1"):
        Costs(forward=-1)
    with pytest.raises(TypeError, match="Costs.p2p"):
        Costs(p2p="1")
    with pytest.raises(TypeError, match="Costs"):
        simulate(OneFOneB(2), 2, costs={"forward": 1})
    assert Costs(backward_input=2, backward_weight=3).of(Op.BACKWARD) == 5


def test_custom_schedule_simulates():
    sched = Custom({0: ["0F0", "0F1", "0B0", "0B1"], 1: ["0F0", "0B0", "0F1", "0B1"]})
    res = simulate(sched, 2, Costs(forward=1, backward_input=1, backward_weight=1))
    # rank 1: 0F0 [1,2] 0B0 [2,4] 0F1 [4,5] 0B1 [5,7]; rank 0: 0B0 [4,6] 0B1 [7,9]
    assert res.makespan == 9
    assert res.peak_activations == {0: 2, 1: 1}


def test_text_of_a_simulation_shows_idle_as_blank():
    text = to_text(simulate(OneFOneB(4), 3))
    lines = text.splitlines()
    assert lines[1].split() == ["0", "0F0"]         # only rank 0 busy at t = 0
    assert lines[3].split() == ["2", "0F2", "0F1", "0F0"]


def test_chrome_trace():
    res = simulate(ZeroBubbleH1(4), 2, Costs(forward=1, backward_input=2, backward_weight=1))
    trace = json.loads(json.dumps(to_chrome_trace(res)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 4 * 3 and {e["tid"] for e in spans} == {0, 1}
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1"}
    i0 = next(e for e in spans if e["name"] == "0I0" and e["tid"] == 0)
    assert i0["dur"] == 2000.0 and i0["cat"] == "backward_input"
    assert max(e["ts"] + e["dur"] for e in spans) == res.makespan * 1000


def test_image_colours_ops_and_shades_chunks():
    res = simulate(ZeroBubbleV(4), 2)
    img = to_image(res, px_per_unit=10, row_height=12, gap=2, labels=False)
    assert img.dtype == np.uint8 and img.shape == (2 * 14 + 2, int(res.makespan * 10) + 4, 3)
    pixels = {tuple(px) for px in img.reshape(-1, 3)}
    for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
        assert COLORS[op] in pixels, op                           # chunk 0: base colour
        light = tuple(int(c + (255 - c) * 0.25) for c in COLORS[op])
        assert light in pixels, op                                # chunk 1: lighter
    assert COLORS[Op.BACKWARD] not in pixels
    # rank 1 is idle at t in [0, 1): white there, rank 0 busy
    row1, row0 = 2 + 14 + 6, 2 + 6
    assert tuple(img[row1, 2 + 5]) == (255, 255, 255) and tuple(img[row0, 2 + 5]) == COLORS[Op.FORWARD]


def test_picture_has_rank_labels_a_time_axis_and_a_legend():
    from pipezero.pipe.schedule.render import text_size

    res = simulate(ZeroBubbleH1(4), 2)
    bare = to_image(res, px_per_unit=10, row_height=12, gap=2, labels=False)
    img = to_image(res, px_per_unit=10, row_height=12, gap=2)
    h, w = bare.shape[:2]
    left = text_size("rank 1")[0] + 8                            # the widest rank label and a margin
    assert img.shape[0] > h and img.shape[1] > w
    ink = (img == 0).all(axis=2)
    assert ink[:h, :left].any()                                  # "rank 0", "rank 1" on the left
    assert ink[h, left:left + w].sum() >= int(res.makespan * 10)  # the time axis under the plot
    legend = {tuple(px) for px in img[h + 40:].reshape(-1, 3)}
    assert {COLORS[Op.FORWARD], COLORS[Op.BACKWARD_INPUT], COLORS[Op.BACKWARD_WEIGHT]} <= legend
    assert COLORS[Op.BACKWARD] not in legend                      # only the ops the schedule uses
    np.testing.assert_array_equal(img[:h, left:left + w], bare)   # the plot itself is unchanged


def test_png_with_pillow(tmp_path):
    image_mod = pytest.importorskip("PIL.Image")
    res = simulate(Interleaved1F1B(4), 2)
    path = to_png(res, tmp_path / "s.png")
    np.testing.assert_array_equal(np.asarray(image_mod.open(path).convert("RGB")), to_image(res))


def test_blocking_sends_can_only_delay():
    for sched, p in [(OneFOneB(8), 4), (ZeroBubbleH1(8), 4), (GPipe(3), 3)]:
        costs = Costs(forward=1, backward_input=1, backward_weight=1, p2p=0.5)
        fast = simulate(sched, p, costs)
        slow = simulate(sched, p, costs, channels="pair", sends="blocking")
        assert slow.makespan >= fast.makespan
    # ZB-H1 only beats 1F1B when a send does not hold up the sender: with blocking sends
    # the deferred W's wait for the peer and the makespan falls back to 1F1B's
    zb_async = simulate(ZeroBubbleH1(8), 4, SAME_FB)
    zb_blocking = simulate(ZeroBubbleH1(8), 4, SAME_FB, sends="blocking")
    one_f_one_b = simulate(OneFOneB(8), 4, SAME_FB, sends="blocking")
    assert zb_async.makespan < one_f_one_b.makespan == zb_blocking.makespan == (8 + 4 - 1) * 4


def test_per_chunk_costs_heavier_last_stage():
    """GPipe over 2 ranks, the last twice as slow: rank 1 works 4m, rank 0 waits for it (2m).

    Forwards end on rank 1 at 1 + 2m, its backwards at 1 + 4m, rank 0's last backward 1 later.
    """
    m = 4
    light = Costs(forward=1, backward_input=0.5, backward_weight=0.5)
    heavy = Costs(forward=2, backward_input=1, backward_weight=1)
    res = simulate(GPipe(m), 2, {(0, 0): light, (1, 0): heavy})
    assert res.makespan == 2 + 4 * m
    assert res.busy == {0: 2 * m, 1: 4 * m}
    assert abs(res.bubble - (1 - 6 * m / (2 * (2 + 4 * m)))) < 1e-12
    same = simulate(GPipe(m), 2, {(0, 0): light, (1, 0): light})
    assert same.makespan == simulate(GPipe(m), 2, light).makespan


def test_per_chunk_costs_errors():
    light = Costs()
    with pytest.raises(ValueError, match=r"\(1, 0\)"):
        simulate(GPipe(4), 2, {(0, 0): light})
    with pytest.raises(ValueError, match="p2p"):
        simulate(GPipe(4), 2, {(0, 0): light, (1, 0): Costs(p2p=1.0)})
    with pytest.raises(TypeError, match="Costs"):
        simulate(GPipe(4), 2, {(0, 0): 1.0, (1, 0): 1.0})


def test_measured_bubble_has_the_simulators_definition():
    """The runner's bubble_fraction over a simulated timeline is the simulator's bubble, also
    when a rank finishes early (1F1B's last stage idles while the first runs its last B)."""
    from pipezero.pipe.schedule.timeline import Event as Span
    from pipezero.pipe.schedule.timeline import bubble_fraction
    costs = {(0, 0): Costs(forward=1, backward_input=1, backward_weight=1),
             (1, 0): Costs(forward=2, backward_input=1.5, backward_weight=1.5)}
    for sched in (GPipe(4), OneFOneB(4)):
        res = simulate(sched, 2, costs)
        spans = [Span(str(e.action), "compute", e.rank, e.start, e.end) for e in res.timeline]
        spans += [Span("wait", "comm", r, 0.0, 0.0) for r in (0, 1)]  # every rank starts at the step's start
        assert abs(bubble_fraction(spans) - res.bubble) < 1e-12
