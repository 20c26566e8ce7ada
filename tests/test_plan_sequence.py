"""The planner's sequence axis (Ulysses, pipe/sequence/): layouts that divide the heads and the
sequence, activations and stage traffic divided by the degree, ZeRO over data x sequence, the
all-to-alls' cost, a long sequence's plan and how its layers are timed.

No process group: arithmetic over the simulator and (faked) measured layer times.
"""

import json
from dataclasses import replace

import pytest

from pipezero.train.cli import main
from pipezero.train.config import parse_config
from pipezero.train.plan import ds_config, plan, predict
from pipezero.train.plan.layout import Layout, enumerate_layouts
from pipezero.train.plan.model import ModelShape, flops_profile

from test_plan import HW, PROFILE, SMALL

LONG = ModelShape(layers=4, d_model=1024, heads=8, seq_len=524288, vocab=1024)
LONG_PROFILE = flops_profile(LONG, HW.peak_tflops * 1e12 * HW.efficiency)


def test_sequence_layouts_fill_the_world_and_divide_the_heads_and_the_sequence():
    layouts = list(enumerate_layouts(8, 8, 32, len(PROFILE), 6, seq_len=96))
    assert {lay.sequence for lay in layouts} == {1, 2}  # 4 and 8 do not divide 6 heads
    for lay in layouts:
        assert lay.pipe * lay.data * lay.sequence * lay.tensor == lay.world == 8, lay
        assert lay.data * lay.microbatches * lay.microbatch_size == 32, lay
        assert (6 // lay.tensor) % lay.sequence == 0, lay  # each tensor rank's heads split over sequence
    assert {lay.sequence for lay in layouts if lay.tensor == 2} == {1}  # 3 heads per tensor rank
    both = {(lay.tensor, lay.sequence) for lay in enumerate_layouts(8, 4, 32, len(PROFILE), 8, seq_len=64)}
    assert both >= {(2, 2), (4, 1), (1, 4)} and all(t * s <= 4 for t, s in both)  # within a node of 4
    assert (4, 2) not in both and (2, 4) not in both
    assert {lay.sequence for lay in enumerate_layouts(8, 8, 32, len(PROFILE), 8, seq_len=100)} == {1, 2, 4}
    assert {lay.sequence for lay in enumerate_layouts(8, 4, 32, len(PROFILE), 8, seq_len=256)} == {1, 2, 4}
    assert {lay.sequence for lay in enumerate_layouts(8, 8, 32, len(PROFILE), 8)} == {1}  # no length: no axis


def test_the_sequence_axis_divides_activations_and_what_crosses_stages():
    from pipezero.train.plan.memory import rank_memory

    base = Layout(2, 1, 1, "1f1b", 1, 4, 2, 0)
    whole, split = (rank_memory(PROFILE, range(5), 2.0, lay, HW, "bf16", SMALL.d_model, SMALL.seq_len)
                    for lay in (base, replace(base, sequence=4)))
    assert split.activations == pytest.approx(whole.activations / 4)
    reserve = HW.reserved_gb * 1e9  # ZeRO 0: the buffers are the p2p ones and the reserve
    assert split.buffers - reserve == pytest.approx((whole.buffers - reserve) / 4)
    assert (split.params, split.grads, split.optimizer) == (whole.params, whole.grads, whole.optimizer)


def test_activation_memory_is_linear_in_the_sequence():
    """No s x s term (fused attention, per-document masks): twice the tokens, twice the activations."""
    from pipezero.train.plan.memory import activation_bytes

    lay = Layout(1, 1, 1, "1f1b", 1, 1, 1, 0)
    acts = [activation_bytes(flops_profile(replace(LONG, seq_len=s), 1.0), range(7), 1.0, lay, "bf16",
                             LONG.d_model, s) for s in (65536, 131072, 262144)]
    assert acts[1] == pytest.approx(2 * acts[0]) and acts[2] == pytest.approx(2 * acts[1])


def test_zero_partitions_over_data_times_sequence():
    lay = Layout(1, 2, 1, "1f1b", 1, 2, 1, 1, sequence=4)
    one, eight = (predict(PROFILE, replace(lay, zero=z), HW, SMALL, "bf16") for z in (0, 1))
    assert eight.memory.optimizer == pytest.approx(one.memory.optimizer / 8)
    alone = predict(PROFILE, replace(lay, data=1), HW, SMALL, "bf16")  # the sequence ranks reduce too
    assert alone.time.data_comm > 0


def test_ulysses_all_to_alls_cost_eight_per_block_and_microbatch():
    """4 all-to-alls (q, k, v, out) forward, 4 backward, 4 more when checkpointed; each sends (P-1)/P of the
    rank's b x s/P x d slice and pays P-1 latencies (arXiv 2309.14509, section 3.2)."""
    from pipezero.train.plan.step_time import all_to_all_seconds

    p, m, b = 4, 3, 2
    lay = Layout(1, 1, 1, "1f1b", 1, m, b, 0, sequence=p)
    slice_bytes = b * SMALL.seq_len / p * SMALL.d_model * 2
    one = (p - 1) / p * slice_bytes / (HW.intra_gbps * 1e9) + (p - 1) * HW.intra_latency_us * 1e-6
    assert all_to_all_seconds(lay, HW, "bf16", SMALL.d_model, SMALL.seq_len) == pytest.approx(one)
    plain, ck = (predict(PROFILE, replace(lay, checkpoint=c), HW, SMALL, "bf16").time for c in (0, 1))
    assert plain.sequence_comm == pytest.approx(SMALL.layers * m * 8 * one)
    assert ck.sequence_comm == pytest.approx(SMALL.layers * m * 12 * one)
    whole = predict(PROFILE, replace(lay, sequence=1), HW, SMALL, "bf16").time
    launches = m * len(PROFILE) * 3 * HW.layer_overhead_us * 1e-6  # per layer and action, whatever the tokens
    assert plain.compute - plain.sequence_comm - launches == pytest.approx((whole.compute - launches) / p)
    beside = replace(lay, tensor=2)  # a tensor rank exchanges its heads / 2 only: half the bytes, same latency
    latency = (p - 1) * HW.intra_latency_us * 1e-6
    assert all_to_all_seconds(beside, HW, "bf16", SMALL.d_model, SMALL.seq_len) == pytest.approx(
        latency + (one - latency) / 2)


def test_a_long_sequence_plan_picks_a_sequence_axis(tmp_path, capsys):
    """At 512K tokens only a split sequence, or checkpointed inputs in host memory, fit 17 GB: plan says so
    and the winner's ds_config carries its sequence axis."""
    small = replace(HW, memory_gb=17.0)
    with pytest.raises(ValueError, match="no layout"):
        plan(LONG, LONG_PROFILE, small, 2, "bf16", top=3, seq_len=None, offload=False)  # neither
    preds = plan(LONG, LONG_PROFILE, small, 2, "bf16", top=3)
    assert preds[0].layout.sequence > 1 and all(p.memory.total <= 17e9 for p in preds)
    cfg = ds_config(preds[0])
    assert cfg["sequence_parallel_size"] == preds[0].layout.sequence
    assert parse_config(cfg, world_size=8).sequence == preds[0].layout.sequence
    path = tmp_path / "ds.json"
    assert main(["plan", "--hardware", "h200", "--layers", "4", "--d-model", "1024", "--heads", "8",
                 "--seq-len", "524288", "--vocab", "1024", "--global-batch", "2", "--precision", "bf16",
                 "--memory-gb", "17", "--top", "3", "--write-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f" s{preds[0].layout.sequence} " in out and "sequence all-to-all" in out
    assert json.loads(path.read_text())["sequence_parallel_size"] == preds[0].layout.sequence


def test_a_long_sequence_is_timed_short_and_scaled_by_the_flops(monkeypatch):
    """512K tokens are not timed on the host: the block at MEASURED_LEN, per token x the FLOPs' ratio."""
    from pipezero.train.plan import model as plan_model

    timed = []

    def fake(shape, *args):  # seconds = FLOPs: the scaled profile must be the long shape's FLOPs
        timed.append(shape.seq_len)
        return [replace(p, recompute_seconds=p.flops / 3, split_seconds=p.flops)
                for p in flops_profile(shape, 1.0)]
    monkeypatch.setattr(plan_model, "_measure", fake)
    profile = plan_model.measure_profile(LONG)
    assert timed == [plan_model.MEASURED_LEN]
    for got, want in zip(profile, flops_profile(LONG, 1.0)):
        assert got.seconds == pytest.approx(want.seconds) and got.params == want.params, got.kind
        if got.kind == "Block":
            assert got.recompute_seconds == pytest.approx(want.flops / 3)
    assert profile[1].seconds > 10 * flops_profile(replace(LONG, seq_len=4096), 1.0)[1].seconds  # attention grew
