"""Schedules as data: structure, coverage, validation and its error messages (no process group)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from pipezero.pipe import (Action, Custom, DualPipeV, GPipe, Interleaved1F1B, OneFOneB, Op,
                           ScheduleError, ZeroBubbleH1, ZeroBubbleV, to_text, validate)

P_RANGE = range(1, 9)
M_RANGE = range(1, 33)


def _schedules(p: int, m: int):
    """Every built-in schedule that accepts (p, m)."""
    out = [GPipe(m), OneFOneB(m), ZeroBubbleH1(m), ZeroBubbleV(m)]
    if m % p == 0:
        out += [Interleaved1F1B(m), Interleaved1F1B(m, num_chunks=3)]
    if m >= 2 * p:
        out.append(DualPipeV(m))
    return out


def _cells(text: str) -> dict[int, list[str]]:
    rows = [line.split() for line in text.strip().splitlines()]
    return {r: [row[r] for row in rows if row[r] != "."] for r in range(len(rows[0]))}


def test_attributes():
    assert (OneFOneB(4).num_chunks, OneFOneB(4).placement, OneFOneB(4).split_backward) == (1, "looped", False)
    assert (GPipe(4).num_chunks, GPipe(4).split_backward) == (1, False)
    assert Interleaved1F1B(8).num_chunks == 2 and Interleaved1F1B(8, num_chunks=4).num_chunks == 4
    assert Interleaved1F1B(8).placement == "looped" and not Interleaved1F1B(8).split_backward
    assert (ZeroBubbleH1(4).num_chunks, ZeroBubbleH1(4).placement, ZeroBubbleH1(4).split_backward) == (1, "looped", True)
    assert (ZeroBubbleV(4).num_chunks, ZeroBubbleV(4).placement, ZeroBubbleV(4).split_backward) == (2, "v", True)
    with pytest.raises(AttributeError):  # frozen
        OneFOneB(4).num_microbatches = 5


@pytest.mark.parametrize("p", P_RANGE)
def test_all_schedules_validate_and_cover_every_microbatch_once(p):
    for m in M_RANGE:
        for sched in _schedules(p, m):
            table = sched.actions(p)
            validate(table, p, sched)
            for r, acts in table.items():
                seen = Counter(acts)
                assert all(n == 1 for n in seen.values()), (sched, p, r)
                for c in range(sched.num_chunks):
                    for i in range(m):
                        assert Action(Op.FORWARD, c, i) in seen
                        whole = Action(Op.BACKWARD, c, i) in seen
                        split = {Action(Op.BACKWARD_INPUT, c, i), Action(Op.BACKWARD_WEIGHT, c, i)} <= set(seen)
                        assert whole != split, (sched, p, r, c, i)
                        assert whole or sched.split_backward
                want = (3 if sched.split_backward else 2) * sched.num_chunks * m
                if not isinstance(sched, DualPipeV):  # DualPipeV mixes B and I+W
                    assert len(acts) == want, (sched, p, r)


def test_one_f_one_b_phases():
    p, m = 4, 8
    table = OneFOneB(m).actions(p)
    for r, acts in table.items():
        first_b = next(k for k, a in enumerate(acts) if a.op is Op.BACKWARD)
        assert first_b == p - r, "warm-up p-r-1 forwards, then one more F before the first B"
        steady = acts[first_b - 1:first_b - 1 + 2 * (m - (p - r - 1))]
        assert [a.op for a in steady] == [Op.FORWARD, Op.BACKWARD] * (m - (p - r - 1))
    assert [str(a) for a in GPipe(2).actions(2)[1]] == ["0F0", "0F1", "0B0", "0B1"]


def test_interleaved_orders_chunks_in_groups_of_p():
    fwd = [a for a in Interleaved1F1B(4).actions(2)[0] if a.op is Op.FORWARD]
    assert [str(a) for a in fwd] == ["0F0", "0F1", "1F0", "1F1", "0F2", "0F3", "1F2", "1F3"]
    bwd = [a for a in Interleaved1F1B(4).actions(2)[0] if a.op is Op.BACKWARD]
    assert [str(a) for a in bwd][:4] == ["1B0", "1B1", "0B0", "0B1"]


def test_zero_bubble_h1_defers_w_by_rank():
    acts = ZeroBubbleH1(6).actions(3)[2]  # last rank: no warm-up, W trails I by 2
    assert [str(a) for a in acts[:7]] == ["0F0", "0I0", "0F1", "0I1", "0F2", "0I2", "0W0"]


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1, ValueError), ("4", TypeError),
                                      (True, TypeError), (2.0, TypeError)])
def test_bad_microbatches(bad, exc):
    for cls in (GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1, ZeroBubbleV, DualPipeV):
        with pytest.raises(exc, match="num_microbatches"):
            cls(num_microbatches=bad)


def test_bad_stages_and_chunks():
    with pytest.raises(ValueError, match="num_stages"):
        OneFOneB(4).actions(0)
    with pytest.raises(ValueError, match=r"multiple of num_stages.*e\.g\. 4 or 8"):
        Interleaved1F1B(6).actions(4)
    with pytest.raises(ValueError, match="num_chunks"):
        Interleaved1F1B(4, num_chunks=1)
    with pytest.raises(ValueError, match=r"num_microbatches >= 2 \* num_stages = 8"):
        DualPipeV(7).actions(4)


def test_validate_bad_containers():
    good = OneFOneB(2).actions(2)
    with pytest.raises(ValueError, match=r"ranks \[0, 2\]"):
        validate({0: good[0], 2: good[1]})
    with pytest.raises(TypeError, match="Action.parse"):
        validate({0: ["0F0", "0B0"]})
    with pytest.raises(TypeError, match="dict rank"):
        validate([good[0]])
    with pytest.raises(ValueError, match="placement 'zigzag'"):
        validate(good, 2, "zigzag")
    with pytest.raises(ScheduleError, match="num_microbatches=3"):
        validate(good, 2, num_microbatches=3)
    with pytest.raises(ValueError, match="pass num_stages"):
        validate(OneFOneB(2))


def _assert_marked(err: ScheduleError, *cells: str) -> None:
    text = str(err)
    assert isinstance(err, ValueError)
    assert text.splitlines()[1].split()[:3] == ["step", "rank", "0"], "grid follows the reason"
    for cell in cells:
        assert f"[{cell}]" in text, f"{cell} not marked in\n{text}"


def test_deadlock_is_reported_with_marked_grid():
    # rank 0 waits for the gradient of microbatch 0 before sending the forward of 1;
    # rank 1 wants that forward before it runs the backward of 0.
    sched = Custom(_cells("""
        0F0  0F0
        0B0  0F1
        0F1  0B0
        0B1  0B1"""))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(sched, 2)
    _assert_marked(info.value, "0B0", "0F1")
    assert info.value.marks == [(0, 1), (1, 1)]


def test_missing_backward_is_reported():
    table = OneFOneB(3).actions(2)
    table[1] = [a for a in table[1] if str(a) != "0B2"]
    with pytest.raises(ScheduleError, match=r"rank 1 runs 0F2 but never its backward") as info:
        validate(table, 2)
    _assert_marked(info.value, "0F2")


def test_receive_order_must_match_send_order():
    sched = Custom(_cells("""
        0F0  0F1
        0F1  0F0
        0B0  0B0
        0B1  0B1"""))
    with pytest.raises(ScheduleError, match="out of order") as info:
        validate(sched, 2)
    _assert_marked(info.value, "0F0", "0F1")


@pytest.mark.parametrize("cells, reason", [
    ("0F0 0B0 0F0 0B0", "runs 0F0 twice"),
    ("0B0 0F0", "0B0 comes before 0F0"),
    ("0F0 0I0 0B0 0W0", "both 0B0 and the split backward"),
    ("0F0 0W0 0I0", "0W0 comes before 0I0"),
    ("0F0 0I0", "never its backward"),
])
def test_single_rank_mistakes(cells, reason):
    with pytest.raises(ScheduleError, match=re.escape(reason)):
        validate({0: [Action.parse(c) for c in cells.split()]})


def test_missing_forward_on_one_rank():
    table = OneFOneB(2).actions(2)
    table[1] = [a for a in table[1] if a.microbatch == 0]
    with pytest.raises(ScheduleError, match="rank 1 never runs 0F1"):
        validate(table, 2)


@pytest.mark.parametrize("sched", [GPipe(4), OneFOneB(4), Interleaved1F1B(4), ZeroBubbleH1(4), ZeroBubbleV(4),
                                   DualPipeV(4)],
                         ids=lambda s: type(s).__name__)
def test_dropping_or_swapping_an_action_breaks_validation(sched):
    table = sched.actions(2)
    validate(table, 2, sched)
    dropped = {r: list(a) for r, a in table.items()}
    dropped[1].pop()
    with pytest.raises(ScheduleError):
        validate(dropped, 2, sched)
    swapped = {r: list(a) for r, a in table.items()}
    swapped[0].reverse()  # every backward before its forward
    with pytest.raises(ScheduleError):
        validate(swapped, 2, sched)


def test_v_schedule_needs_v_placement():
    table = ZeroBubbleV(6).actions(3)
    validate(table, 3, "v")
    with pytest.raises(ScheduleError):
        validate(table, 3, "looped")


def test_custom_round_trips_through_text():
    for sched, p in [(OneFOneB(5), 3), (ZeroBubbleV(5), 3), (Interleaved1F1B(4), 2)]:
        table = sched.actions(p)
        back = Custom.from_text(to_text(table), placement=sched.placement)
        assert back.actions(p) == table
        assert (back.num_microbatches, back.num_chunks, back.split_backward) == \
            (sched.num_microbatches, sched.num_chunks, sched.split_backward)
        validate(back, p)


def test_custom_from_rows_with_idle_dots():
    sched = Custom.from_text("""
        0F0 .
        0F1 0F0
        .   0B0
        0B0 0F1
        .   0B1
        0B1 .
    """)
    assert [str(a) for a in sched.actions(2)[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert validate(sched, 2) == OneFOneB(2).actions(2)


def test_custom_bad_input():
    with pytest.raises(ValueError, match="line 1 has 1 cells"):
        Custom.from_text("0F0 0F0\n0B0")
    with pytest.raises(ValueError, match="num_stages=2"):
        Custom({0: ["0F0", "0B0"], 1: ["0F0", "0B0"]}).actions(3)
    with pytest.raises(ValueError, match="cannot read action"):
        Custom({0: ["0X0"]})
    with pytest.raises(ValueError, match="placement"):
        Custom({0: ["0F0", "0B0"]}, placement="ring")


def test_marked_grid_text():
    text = to_text({0: [Action.parse("0F0"), Action.parse("0B0")], 1: [Action.parse("0F0")]},
                   mark=[(1, 0)])
    assert text.splitlines() == ["step  rank 0  rank 1", "   0  0F0     [0F0]", "   1  0B0"]
    with pytest.raises(TypeError, match=r"sched.actions\(num_stages\)"):
        to_text(OneFOneB(2))


def test_executor_models():
    # the 1F1B family runs on the plainest executor: one untagged channel per rank pair
    # and sends that block until the peer posts the receive
    for p in (2, 3, 4):
        for m in (1, p, 2 * p + 1):
            for sched in (GPipe(m), OneFOneB(m), ZeroBubbleH1(m)):
                validate(sched, p, channels="pair", sends="blocking")
    # ZB-V mixes activations and gradients between the same two ranks in different orders
    with pytest.raises(ScheduleError, match=r"rank 0 -> rank 1 out of order.*channels='pair'") as info:
        validate(ZeroBubbleV(4), 2, channels="pair")
    _assert_marked(info.value, "0F2", "1I0")
    # interleaved (m > p) and ZB-V need sends that do not hold up the sender
    with pytest.raises(ScheduleError, match=r"deadlock.*to take the message.*sends='blocking'") as info:
        validate(Interleaved1F1B(4), 2, sends="blocking")
    _assert_marked(info.value, "0F3", "0F2")
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(ZeroBubbleV(4), 2, sends="blocking")
    with pytest.raises(ValueError, match="sends='eager'"):
        validate(OneFOneB(2), 2, sends="eager")
    with pytest.raises(ValueError, match="channels='tag'"):
        validate(OneFOneB(2), 2, channels="tag")


def _torch_order(cls_name: str, p: int, m: int, placement: str) -> dict[int, list[Action]]:
    """torch.distributed.pipelining's order for the same schedule (private API: skip if gone)."""
    from pipezero.pipe.schedule.placement import owner
    tps = pytest.importorskip("torch.distributed.pipelining.schedules")
    try:
        sched = object.__new__(getattr(tps, cls_name))
        sched.pp_group_size, sched._n_microbatches, sched.n_local_stages = p, m, 2
        sched.num_stages, sched.microbatches_per_round = 2 * p, m // max(1, m // p)
        order = {r: sched._calculate_single_rank_operations(r) for r in range(p)}
        ops = {"F": Op.FORWARD, "B": Op.BACKWARD, "I": Op.BACKWARD_INPUT, "W": Op.BACKWARD_WEIGHT}
        flat = {r: [x for a in acts if a is not None for x in (a.sub_actions or (a,))]  # overlapped pairs: F, B
                for r, acts in order.items()}
        return {r: [Action(ops[a.computation_type.value], owner(a.stage_index, p, placement)[1],
                           a.microbatch_index) for a in acts]
                for r, acts in flat.items()}
    except (AttributeError, TypeError, KeyError) as e:  # torch changed its private API
        pytest.skip(f"torch pipelining internals changed: {e!r}")


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_same_orders_as_torch_pipelining(p):
    for m in (1, p, 2 * p, 2 * p + 1, 4 * p):
        assert ZeroBubbleV(m).actions(p) == _torch_order("ScheduleZBVZeroBubble", p, m, "v"), m
        if m % p == 0:
            assert Interleaved1F1B(m).actions(p) == \
                _torch_order("ScheduleInterleaved1F1B", p, m, "looped"), m
        if m >= 2 * p:
            assert DualPipeV(m).actions(p) == _torch_order("ScheduleDualPipeV", p, m, "v"), m
