"""A DualPipeV pair's forward and backward in turns (pipe/expert/relay.py, pipe/pairs.py, overlap_pairs).

The relay alone, on threads (no process group): two sides strictly alternate at each hand-over, each
finds its own value of a kept global at its turn, one that ends lets the other run to its end, and an
exception on either side (before the other started, or while it waits) is raised on the caller with
the helper thread gone, within seconds. The plan alone: DualPipeV pairs its steady state, 1F1B its
F(i + 1) | B(i) but on the last rank, ZB-V an F | I, and a hand-made table whose merged pair would
deadlock leaves that pair out (and keeps the other rank's).
Four gloo ranks, Grid(pipe=2, expert=2): OLMoE under DualPipeV (four microbatches a rank), and
Mixtral under 1F1B and ZB-V (two; their F | B and F | I neighbours), with
PipelineRunner(overlap_pairs=True) equals transformers in one process (loss and every clipped
gradient, fp32 1e-5, as tests/test_expert.py checks them); OLMoE at ZeRO-1, with the two-halves
overlap on too, at ZeRO-3, and with every layer recomputed in backward (the recompute's launches switch too, and its
DeferringLinear layers must see the backward's sink, not the waiting forward's); at ZeRO-1 it equals
the same run with pairs off exactly (the same ops on the same values). Its all-to-alls recorded
(dist.all_to_all_single wrapped): some launch of the forward (the calling thread) is followed by a
backward's launch (the relay's thread) before its own wait, on pipe rank 1 (the V's middle: both its
chunks hold experts; pipe rank 0's second chunk is the head); with pairs off no such event. Without
experts (expert 1) the option plans no pair; beside compiled layers, or not a bool, it is refused.
build() with ds_config's "overlap_pairs" plans the pairs and trains transformers' loss.
"""

import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from test_expert import WORLD, _clipped, _expert_step, _rows  # noqa: E402
from test_hf_router import _batch, _model, _targets  # noqa: E402

CASE = ("olmoe", 2, 2, 1, "dualpipev", 4)  # family, expert, pipe, ZeRO stage, schedule, microbatches a rank
PAIRED = [(CASE, dict(pairs=True)), (CASE, dict(pairs=True, overlap=True)),
          ((*CASE[:3], 3, *CASE[4:]), dict(pairs=True)), (CASE, dict(pairs=True, recompute="full")),
          (("mixtral", 2, 2, 1, "1f1b", 2), dict(pairs=True)), (("mixtral", 2, 2, 1, "zbv", 2), dict(pairs=True))]
# 1F1B pairs pipe rank 0's F1 | B0; ZB-V pipe rank 1's 1F1 | 1I0 (the split backward's input half)


# -- the relay alone --------------------------------------------------------------------------------
def _relay_run(steps: tuple[int, int], fail: tuple[str, int] | None = None) -> tuple:
    """A Relay over sides "F" (steps[0] hand-overs) and "B" (steps[1]), a kept global each sets to its name:
    (the log of (side, step, the global's value), the result or the raised error, the global after,
    switches). Run on a thread joined with a timeout: a hang fails the test."""
    from pipezero.pipe.expert.relay import Relay, hand_over

    state, log, out = {"v": "start"}, [], {}

    def side(name: str, count: int):
        def fn():
            state["v"] = name
            for k in range(count):
                log.append((name, k, state["v"]))
                if fail == (name, k):
                    raise ValueError(f"{name} failed at {k}")
                hand_over()
            log.append((name, "end", state["v"]))
            return name
        return fn

    relay = Relay(kept=[(lambda: state["v"], lambda v: state.__setitem__("v", v))])

    def caller():
        try:
            out["result"] = relay.run(side("F", steps[0]), side("B", steps[1]))
        except BaseException as err:  # noqa: BLE001 - the test reads it
            out["result"] = err
    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), f"the relay hung: {log}"
    assert not [t for t in threading.enumerate() if t.name == "pipezero-relay"], "a relay thread outlived run"
    return log, out["result"], state["v"], relay.switches


def test_relay_alternates_and_keeps_each_sides_global():
    log, result, after, switches = _relay_run((3, 2))
    assert result == ("F", "B") and after == "start" and switches == 5, (result, after, switches)
    assert [(s, k) for s, k, _ in log] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", "end"),
                                           ("F", "end")], log
    assert all(name == value for name, _, value in log), log  # each side found its own value at its turn
    log, result, _, _ = _relay_run((0, 2))  # F never hands over: B runs after it, to its end
    assert result == ("F", "B") and [(s, k) for s, k, _ in log] == [("F", "end"), ("B", 0), ("B", 1), ("B", "end")]


@pytest.mark.parametrize("fail", [("F", 0), ("F", 1), ("B", 0), ("B", 1)])
def test_relay_raises_either_sides_error_without_a_hang(fail):
    """F at 0 fails before B started; F at 1 while B waits at its switch; B's while F waits."""
    from pipezero.pipe.expert.relay import RelayAborted

    log, result, after, _ = _relay_run((3, 3), fail)
    assert isinstance(result, ValueError) and not isinstance(result, RelayAborted), result
    assert str(result) == f"{fail[0]} failed at {fail[1]}" and after == "start", (result, after)
    assert not any(k == "end" for _, k, _ in log), log  # the other side stopped at its switch


# -- the plan alone -----------------------------------------------------------------------------------
def test_pairs_are_planned_where_the_merged_table_runs():
    from pipezero.pipe.pairs import schedule_pairs
    from pipezero.pipe.schedule.schedules import Custom, DualPipeV, OneFOneB, ZeroBubbleH1, ZeroBubbleV

    assert schedule_pairs(DualPipeV(4), 2) == {0: (7, 9, 12), 1: (4, 6, 8, 10)}  # 0F3|1B1, 1F2|0B0, ...
    assert [len(ks) for ks in schedule_pairs(DualPipeV(16), 4).values()] == [21, 24, 24, 24]  # F | I too
    # 1F1B: F(i + 1) | B(i) on rank 0, none on the last rank (F(i), B(i) need each other); ZB-V: F | I
    assert schedule_pairs(OneFOneB(8), 2) == {0: (1, 3, 5, 7, 9, 11, 13), 1: ()}
    assert schedule_pairs(ZeroBubbleV(2), 2) == {0: (), 1: (3,)}  # 1F1 | 1I0
    assert [len(ks) for ks in schedule_pairs(ZeroBubbleH1(8), 2).values()] == [7, 0]  # as 1F1B's, W's between
    # rank 0's 0F1|1B0 would wait for rank 1's 1B0, which comes after rank 1's 0F1 that needs rank 0's 0F1
    steps = "0F0 1F0 0F1 1B0 1F1 1B1 0B0 0B1".split()
    assert schedule_pairs(Custom({0: steps, 1: steps}), 2) == {0: (), 1: (2,)}


# -- four ranks ---------------------------------------------------------------------------------------
def _recorded(fn):
    """fn() with every async all-to-all recorded: [("launch" | "wait", n, on the calling thread)]."""
    import torch.distributed as dist

    events, real, caller = [], dist.all_to_all_single, threading.get_ident()

    class Work:
        def __init__(self, work, n):
            self.work, self.n = work, n

        def wait(self):
            events.append(("wait", self.n, threading.get_ident() == caller))
            return self.work.wait()

    def recording(out, rows, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        work = real(out, rows, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if not async_op:
            return work
        n = sum(e[0] == "launch" for e in events)
        events.append(("launch", n, threading.get_ident() == caller))
        return Work(work, n)

    dist.all_to_all_single = recording
    try:
        return fn(), events
    finally:
        dist.all_to_all_single = real


def _interleaved(events: list) -> bool:
    """Some launch on the calling thread (a forward's) followed by another thread's launch (a paired
    backward's, its compute before it) before that launch's own wait."""
    for i, (kind, n, here) in enumerate(events):
        if kind == "launch" and here:
            until = next(j for j, e in enumerate(events) if e[:2] == ("wait", n))
            if any(e[0] == "launch" and not e[2] for e in events[i + 1:until]):
                return True
    return False


def _refusals() -> list:
    """overlap_pairs at expert 1 (no experts split: no pair), not a bool, beside compiled layers."""
    from pipezero.pipe import DualPipeV, PipelineModule, PipelineRunner
    from pipezero.pipe.compile import CompileConfig
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.topology import Grid

    grid, refused = Grid(pipe=2), []
    for compiled in (False, True):
        module = PipelineModule(hf_layer_specs(_model("olmoe")), grid=grid, loss_fn=causal_lm_loss,
                                partition_method="uniform", num_chunks=2, placement="v",
                                compile=CompileConfig(backend="aot_eager") if compiled else False)
        if not compiled:
            assert PipelineRunner(module, DualPipeV(4), overlap_pairs=True).pairs == frozenset()
            with pytest.raises(TypeError, match="overlap_pairs='yes'.* True or False"):
                PipelineRunner(module, DualPipeV(4), overlap_pairs="yes")
            continue
        with pytest.raises(ValueError, match="overlap_pairs=True. beside compiled layers.*compile=False"):
            PipelineRunner(module, DualPipeV(4), overlap_pairs=True)
        refused.append(compiled)
    return refused


def _built() -> tuple:
    """build() from a ds_config with "expert_parallel" "overlap_pairs" under DualPipeV at pipe 2 x expert 2: its
    runner's pairs and one step's loss (the CASE's rows, four microbatches a replica)."""
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.train import build

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": CASE[5],
              "pipeline": {"stages": 2, "schedule": "dualpipev"}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 0.0}},
              "expert_parallel": {"enabled": True, "autoep_size": 2, "overlap_pairs": True}}
    parts = build(config, specs=hf_layer_specs(_model(CASE[0])), loss_fn=causal_lm_loss)
    ids, mask, labels = _batch(True, _rows(CASE, WORLD))
    rows = slice(parts.grid.data_expert_rank * CASE[5], (parts.grid.data_expert_rank + 1) * CASE[5])
    return len(parts.runner.pairs), parts.runner.train_step((ids[rows], mask[rows]), _targets(labels)[rows])


def _paired(norms: list[float]) -> list:
    off, off_events = _recorded(lambda: _expert_step(norms[0], *CASE))
    results = [_recorded(lambda c=case, o=options, m=m: _expert_step(m, *c, **o))
               for (case, options), m in zip(PAIRED, norms)]
    return [off, _interleaved(off_events)] + [(r, _interleaved(e)) for r, e in results] + [_refusals(), _built()]


def test_paired_dualpipev_equals_one_process():
    """Fails (before pipe/pairs.py and the relay) with overlap_pairs unknown; with the pairs run one after the
    other, on the interleaving check; with the collecting sink shared by both sides, on the gradients."""
    keys = [(case[0], _rows(case, WORLD)) for case, _ in PAIRED]
    truths = {key: _clipped(*key) for key in set(keys)}
    results = run(_paired, WORLD, [truths[key][2] for key in keys], timeout=300)
    names: list[set] = [set() for _ in keys]
    interleaving = [False] * len(keys)
    for rank, (off, off_interleaved, *paired, refused, (built_pairs, built_loss)) in enumerate(results):
        assert refused == [True] and not off_interleaved, rank
        assert built_pairs > 0 or rank < WORLD // 2, rank  # build() passed ds_config's key on (pipe rank 1 pairs)
        torch.testing.assert_close(built_loss, truths[keys[0]][0], rtol=1e-5, atol=1e-5)
        for i, ((got, interleaved), key) in enumerate(zip(paired, keys)):
            names[i] |= set(got[1])
            if i < 4:  # DualPipeV: pipe rank 1's chunks both hold experts, a backward launched inside a forward's
                assert interleaved == (rank >= WORLD // 2), (rank, i)  # launch and wait (rank 0's B has none)
            interleaving[i] |= interleaved
            loss, grads, (lo, hi) = got[:3]
            family, (want_loss, want_grads) = key[0], truths[key][:2]
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{rank} {i}: {m}")
            for name, value in grads.items():
                want = want_grads[name][lo:hi] if ".experts." in name else want_grads[name]
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{i} {name}: {m}")
            if i == 0:  # pairs on, ZeRO-1: the same numbers as pairs off
                assert torch.equal(loss, off[0]) and all(torch.equal(v, off[1][n]) for n, v in grads.items())
    assert all(seen == set(truths[key][1]) for seen, key in zip(names, keys))  # every gradient checked
    assert all(interleaving), interleaving  # 1F1B's and ZB-V's pairs too, on some rank
