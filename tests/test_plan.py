"""The planner: valid layouts, the ZeRO formulas, sane time trends, a parseable winner, the CLI.

No process group: the planner is arithmetic over the simulator and measured layer times.
"""

import contextlib
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import FakeTensor

from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from harness import run
from pipezero.pipe import costs
from pipezero.pipe.schedule.registry import make_schedule
from pipezero.train.cli import main
from pipezero.train.config import parse_config
from pipezero.train.plan import ds_config, plan, predict
from pipezero.train.plan.hardware import h200
from pipezero.train.plan.layout import Layout, enumerate_layouts
from pipezero.train.plan.zero3 import partitioned
from pipezero.train.plan.memory import model_state_bytes
from pipezero.train.plan.model import ModelShape, flops_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import Block, GPTConfig, gpt_loss, gpt_specs  # noqa: E402
from test_zero_memory import expected  # noqa: E402  the formulas ZeroOptimizer is tested against

SMALL = ModelShape(layers=8, d_model=256, heads=8, seq_len=256, vocab=1024)
HW = h200(nodes=1)
PROFILE = flops_profile(SMALL, HW.peak_tflops * 1e12 * HW.efficiency)


def test_every_layout_fills_the_world_and_its_schedule_is_valid():
    layouts = list(enumerate_layouts(8, 8, 32, len(PROFILE), SMALL.heads))
    assert {lay.schedule for lay in layouts} >= {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"}
    for lay in layouts:
        assert lay.pipe * lay.data * lay.tensor == 8, lay
        assert lay.data * lay.microbatches * lay.microbatch_size == 32, lay
        assert not lay.reshard or (lay.zero == 3 and lay.chunks >= 3), lay  # where resharding can save memory
        chunks = lay.chunks if lay.schedule == "interleaved_1f1b" else None
        make_schedule(lay.schedule, lay.microbatches, chunks).actions(lay.pipe)  # raises if invalid
    assert {lay.schedule for lay in layouts if lay.zero == 3 and lay.pipe > 1} >= {"1f1b", "interleaved_1f1b",
                                                                                   "zbv", "dualpipev"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_model_state_equals_the_zero_formulas(stage, dtype, precision):
    psi, n = 1_000_000, 4
    assert sum(model_state_bytes(psi, stage, n, precision)) == pytest.approx(expected(stage, dtype, psi, n))


def test_block_activation_bytes_match_autograd():
    cfg = GPTConfig(n_layer=1, n_head=4, d_model=64, seq_len=32)
    block, saved = Block(cfg, 0), {}
    x = torch.randn(2, 32, 64, requires_grad=True)

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    measured = sum(v for k, v in saved.items() if k not in params)
    model = flops_profile(ModelShape(layers=1, d_model=64, heads=4, seq_len=32), 1.0)[1].act_bytes("fp32") * 64
    assert model == pytest.approx(measured, rel=0.25), (model, measured)


def test_more_data_parallel_means_less_compute_per_device():
    base = Layout(1, 1, 1, "1f1b", 1, 32, 1, 0)
    times = [predict(PROFILE, replace(base, data=d, microbatches=32 // d), HW, SMALL, "bf16").time.compute
             for d in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 6, times


def test_more_microbatches_shrink_the_bubble():
    bubbles = [predict(PROFILE, Layout(4, 1, 1, "1f1b", 1, m, 1, 0), HW, SMALL, "bf16").time.bubble
               for m in (4, 8, 16, 64)]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[0] >= 3 / 7 - 1e-9  # (p-1)/(m+p-1) for balanced stages; imbalance only adds


def test_zero_stages_trade_memory_for_traffic():
    mems = [predict(PROFILE, Layout(1, 8, 1, "1f1b", 1, 1, 4, z), HW, SMALL, "bf16").memory for z in range(4)]
    totals = [m.total for m in mems]
    assert totals[:3] == sorted(totals[:3], reverse=True) and totals[3] < totals[0]
    # ZeRO-3 under the runner with one chunk a rank holds every partitioned parameter whole through the step
    # (zero3.py; the tied head is the embedding's weight), 2 bytes each in bf16
    whole = sum(partitioned(p) for p in PROFILE if not (p.kind == "Head" and p.tied))
    assert mems[3].buffers - mems[0].buffers == pytest.approx(2 * whole)


def test_stage_2_holds_whole_gradients_while_micro_batches_accumulate():
    one, four = (predict(PROFILE, Layout(1, 8, 1, "1f1b", 1, m, 4 // m, 2), HW, SMALL, "bf16").memory for m in (1, 4))
    assert four.grads == pytest.approx(one.grads * 9)  # G/8 shard + the whole G (TransientShardSync holds it)


def test_winner_ds_config_parses_and_layouts_that_do_not_fit_are_dropped():
    preds = plan(SMALL, PROFILE, replace(HW, memory_gb=2.5), 32, "bf16")
    assert all(p.memory.total <= 2.5e9 for p in preds)
    assert [p.tokens_per_second for p in preds] == sorted((p.tokens_per_second for p in preds), reverse=True)
    cfg = parse_config(ds_config(preds[0]), world_size=8, tensor=preds[0].layout.tensor)
    assert cfg.pipeline.stages == preds[0].layout.pipe and cfg.zero.stage == preds[0].layout.zero
    with pytest.raises(ValueError, match="no layout"):
        plan(SMALL, PROFILE, replace(HW, memory_gb=0.001), 32, "bf16")


def test_cli_plan_prints_the_table_and_writes_the_config(tmp_path, capsys, monkeypatch):
    from pipezero.train.plan import hardware as plan_hardware

    monkeypatch.setattr(plan_hardware, "_measure_ranks", lambda processes: (2.0, 1e-3, 1e9))  # spawns: own test
    path = tmp_path / "ds.json"
    assert main(["plan", "--layers", "2", "--d-model", "64", "--heads", "2", "--seq-len", "32",
                 "--global-batch", "8", "--top", "3", "--write-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "winner:" in out and "torchrun --standalone --nproc-per-node 4" in out
    # the launch line runs the job by module: an installed wheel has no examples/train_gpt.py
    assert f"torchrun --standalone --nproc-per-node 4 -m pipezero.train.gpt.job --config {path}" in out
    tensor = int(out.split(" --tensor ")[1].split()[0])  # the winner's, as its launch line passes it
    parse_config(json.loads(path.read_text()), world_size=4, tensor=tensor)
    assert main(["plan", "--hardware", "h200", "--layers", "4", "--d-model", "512", "--heads", "8",
                 "--seq-len", "512", "--vocab", "1024", "--global-batch", "16", "--top", "2"]) == 0
    out = capsys.readouterr().out  # the launch line's job is byte-level: said, not silently another model
    assert "MFU" in out and "vocabulary 256, on the winner's layout; for the planned vocabulary 1024" in out


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2),
                                         ("dualpipev", 2)])
def test_extrapolated_simulation_matches_the_full_one(name, chunks):
    from pipezero.train.plan import step_time as plan_time

    layout = Layout(4, 2, 1, name, chunks, 24, 1, 0)
    sim, held, _ = plan_time.simulate_layout(PROFILE, layout, HW, "bf16", SMALL.d_model, SMALL.seq_len)
    costs = {k: plan_time._chunk_costs(PROFILE, layers, layout, HW, "bf16", SMALL.d_model, SMALL.seq_len, 0.0)[0]
             for k, layers in held.items()}
    bw, lat = HW.link(layout.tensor * layout.data + 1)
    p2p = lat + SMALL.seq_len * SMALL.d_model * 2 / bw
    costs = {k: replace(c, p2p=p2p) for k, c in costs.items()}
    full = plan_time._run(layout, 24, costs)
    assert sim.makespan == pytest.approx(full.makespan, rel=0.01)
    assert sim.live == pytest.approx(full.live, rel=0.01)


def test_the_floor_bounds_every_prediction_and_top_equals_the_full_ranking():
    from pipezero.train.plan.step_time import step_time_floor

    for lay in enumerate_layouts(8, 8, 32, len(PROFILE), SMALL.heads, checkpoints=(0,)):
        floor = step_time_floor(PROFILE, lay, HW, "bf16", SMALL.d_model, SMALL.seq_len)
        assert floor <= predict(PROFILE, lay, HW, SMALL, "bf16").time.total * (1 + 1e-9), lay
    full, top = plan(SMALL, PROFILE, HW, 32, "bf16"), plan(SMALL, PROFILE, HW, 32, "bf16", top=8)
    assert [p.layout for p in top] == [p.layout for p in full[:8]]


def test_an_extrapolated_schedule_never_ends_before_its_busiest_rank():
    shape = ModelShape(layers=24, d_model=2048, heads=16, seq_len=2048, vocab=50304)
    profile = flops_profile(shape, HW.peak_tflops * 1e12 * HW.efficiency)
    pred = predict(profile, Layout(2, 4, 1, "interleaved_1f1b", 2, 64, 2, 2), HW, shape, "bf16")
    assert pred.time.pipeline >= pred.time.compute and pred.time.bubble >= 0


def test_local_cpu_measures_contention_and_gloo_with_spawned_ranks():
    from pipezero.train.plan.hardware import _measure_ranks

    slowdown, latency, bandwidth = _measure_ranks(2, seconds=0.2)
    assert slowdown >= 1.0 and 0 < latency < 1.0 and bandwidth > 1e6, (slowdown, latency, bandwidth)


class _PeakBytes(TorchDispatchMode):
    """The exact peak of live CPU tensor storage while active, counting what existed before."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple] = {}
        self.peak = 0
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                self._add(obj)

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, FakeTensor) or t.device.type == "meta":  # no storage (e.g. what a compile left behind)
            return
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in self.live:
            self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._add(t)
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _measured_and_predicted(rows: list) -> list[tuple[float, float]]:
    """One rank: each layout built from the planner's ds_config in bf16, the peak of its second step."""
    from pipezero.train import build

    shape = ModelShape(layers=2, d_model=128, heads=4, seq_len=64, vocab=2048)
    hw = replace(h200(1, 1), reserved_gb=0.0)
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=128, seq_len=64, vocab_size=2048)
    out = []
    for row in rows:
        pred = predict(flops_profile(shape, 1e12), Layout(*row), hw, shape, "bf16")
        parts = build(ds_config(pred), specs=gpt_specs(cfg), loss_fn=gpt_loss, hidden_size=128)
        for group in parts.inner.param_groups:
            group["foreach"] = True  # a GPU's default, which Hardware.optimizer_temp_bytes describes
        x = torch.randint(0, 2048, (pred.layout.microbatches * pred.layout.microbatch_size, 65))
        for tracked in (False, True):
            gc.collect()
            with _PeakBytes() if tracked else contextlib.nullcontext() as peak:
                parts.runner.train_step(x[:, :-1], x[:, 1:])
                parts.optimizer.step()
                parts.optimizer.zero_grad()
        out.append((peak.peak, pred.memory.total))
        del parts
    return out


def test_peak_memory_prediction_matches_the_tensors_a_step_allocates():
    """Micro-batch 1 x 8 peaks in the optimizer step (fp32 grad copies, Adam's temporary), 8 x 1
    in the loss's backward (8 x vocab bytes a token), checkpointing keeps run inputs: the 1.3B GPT
    on one H200 missed these by -17% and -30% before."""
    rows = [(1, 1, 1, "1f1b", 1, 8, 1, 0), (1, 1, 1, "1f1b", 1, 1, 8, 0), (1, 1, 1, "1f1b", 1, 1, 8, 0, False, 1)]
    for row, (measured, predicted) in zip(rows, run(_measured_and_predicted, 1, rows)[0]):
        assert predicted == pytest.approx(measured, rel=0.05), (Layout(*row).label, measured, predicted)


def _checkpoint_leaves_nothing_for_gc() -> int:
    from pipezero.pipe import PipelineModule
    from pipezero.topology import Grid

    cfg = GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=32, vocab_size=256)
    model = PipelineModule(gpt_specs(cfg), Grid(pipe=1, data=None, tensor=1), loss_fn=gpt_loss,
                           activation_checkpoint_interval=1)
    x = torch.randint(0, 256, (2, 33))
    gc.collect()
    before = {id(o) for o in _activations()}  # what earlier tests in this pooled worker left alive
    gc.disable()
    try:
        model.loss(model(x[:, :-1]), x[:, 1:]).backward()
        return sum(1 for o in _activations() if id(o) not in before)
    finally:
        gc.enable()


def _activations() -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() == 3 and
            not isinstance(o, torch.nn.Parameter)]


def test_checkpointed_recompute_frees_its_tensors_without_the_garbage_collector():
    """torch's checkpoint stops a recompute by raising through PipelineModule._run; re-raising it
    as its own cause kept every recomputed tensor in a reference cycle (+1.5-3.8 GB on the GPU)."""
    assert run(_checkpoint_leaves_nothing_for_gc, 1)[0] == 0


class _FakeGPU:
    """A stream that runs queued work in real time behind the CPU, with torch.cuda's timing calls."""

    def __init__(self):
        self.free_at = time.perf_counter()

    def enqueue(self, ms: float) -> None:
        self.free_at = max(self.free_at, time.perf_counter()) + ms / 1e3

    def synchronize(self, device=None) -> None:
        time.sleep(max(0.0, self.free_at - time.perf_counter()))

    def event(self, **_):
        gpu = self

        class Event:
            def record(self):
                self.at = max(gpu.free_at, time.perf_counter())

            def query(self):
                return time.perf_counter() >= self.at

            def synchronize(self):
                time.sleep(max(0.0, self.at - time.perf_counter()))

            def elapsed_time(self, other):
                return (other.at - self.at) * 1e3
        return Event()


@pytest.mark.parametrize("cpu_ms,gpu_ms,floor_ms,expected", [(1.0, 12.0, 0.0, 12.0), (16.0, 4.0, 12.0, 4.0)])
def test_cuda_layer_time_is_the_slower_of_gpu_and_launches_without_the_harness(monkeypatch, cpu_ms, gpu_ms,
                                                                               floor_ms, expected):
    """A layer whose launches outlast its kernels measured 16 ms between synchronisations; a step
    that launches ahead pays the kernels' 4 ms, or the launches less the harness's 12."""
    gpu = _FakeGPU()
    monkeypatch.setattr(torch.cuda, "Event", gpu.event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: gpu.enqueue(cycles / 1e6))
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setitem(costs._CYCLES_PER_MS, 0, 1e6)
    layer = lambda: (time.sleep(cpu_ms / 1e3), gpu.enqueue(gpu_ms))  # noqa: E731
    ms = costs._time_ms(layer, torch.device("cuda", 0), 3, floor_ms)
    assert expected * 0.9 <= ms <= expected + 3.0, ms


def test_checkpointing_adds_the_measured_recompute_to_the_backward():
    """At micro-batch 1 on one H200 checkpointing cost 2.2x the step, not the 4/3 of one more forward."""
    layout, plain = Layout(1, 1, 1, "1f1b", 1, 4, 2, 0, False, 1), Layout(1, 1, 1, "1f1b", 1, 4, 2, 0)
    tokens = layout.microbatches * layout.microbatch_size * SMALL.seq_len
    blocks = [i for i, p in enumerate(PROFILE) if p.kind == "Block"]
    third = sum(PROFILE[i].seconds for i in range(len(PROFILE))) / 3 * tokens
    for recompute, added in ((None, third), (1e-6, len(blocks) * 1e-6 * tokens
                                             + sum(p.seconds for p in PROFILE if p.kind != "Block") / 3 * tokens)):
        profile = [replace(p, recompute_seconds=recompute) if p.kind == "Block" else p for p in PROFILE]
        hw = replace(HW, layer_overhead_us=0.0)
        ck = predict(profile, layout, hw, SMALL, "bf16").time.pipeline
        assert ck - predict(profile, plain, hw, SMALL, "bf16").time.pipeline == pytest.approx(added, rel=1e-6)


def test_selective_adds_the_measured_selective_cost_to_the_backward():
    """A measured profile's selective_seconds (the block eager under torch's selective checkpoint, less the
    block as it runs unchecked) is what selective recomputation adds; without it, the modelled bytes."""
    layout, plain = Layout(1, 1, 1, "1f1b", 1, 4, 2, 0, False, 1, selective=True), Layout(1, 1, 1, "1f1b", 1, 4, 2, 0)
    tokens = layout.microbatches * layout.microbatch_size * SMALL.seq_len
    blocks = [i for i, p in enumerate(PROFILE) if p.kind == "Block"]
    hw = replace(HW, layer_overhead_us=0.0)
    profile = [replace(p, selective_seconds=2e-6) if p.kind == "Block" else p for p in PROFILE]
    added = [predict(prof, layout, hw, SMALL, "bf16").time.pipeline - predict(prof, plain, hw, SMALL, "bf16").time.pipeline
             for prof in (PROFILE, profile)]
    assert added[1] == pytest.approx(len(blocks) * 2e-6 * tokens + (added[0] - _modelled_selective(layout)), rel=1e-6)


def _modelled_selective(layout: Layout) -> float:
    """The modelled selective cost of PROFILE's blocks (step_time.kit_seconds' bytes at the memory bandwidth)."""
    from pipezero.train.plan.memory import tiled

    tokens, tile = layout.microbatches * layout.microbatch_size * SMALL.seq_len, tiled(layout, SMALL.seq_len)
    return sum(2 * (p.act_bytes("bf16", 1, tile) - p.selective_bytes("bf16", 1, tile) - p.loss_bytes) * tokens
               / (HW.memory_gbps * 1e9) for p in PROFILE if p.kind == "Block")


def test_a_split_schedule_pays_what_the_runners_split_measured():
    """ZB-V at micro-batch 1 on 2 H200s ran at twice 1F1B while the planner assumed I + W = B:
    under a split schedule I and W take measure_profile's split time, other schedules B's."""
    from pipezero.train.plan.step_time import simulate_layout

    zbv, one_f_one_b = Layout(2, 1, 1, "zbv", 2, 8, 1, 0), Layout(2, 1, 1, "1f1b", 1, 8, 1, 0)
    hw = replace(HW, layer_overhead_us=0.0)
    extra = sum(p.seconds for p in PROFILE if p.kind == "Block") * 8 * SMALL.seq_len  # twice F + B: one more

    def busy(layout, factor):
        profile = [replace(p, split_seconds=factor * p.seconds) if p.kind == "Block" else p for p in PROFILE]
        return sum(simulate_layout(profile, layout, hw, "bf16", SMALL.d_model, SMALL.seq_len)[0].busy.values())
    assert busy(zbv, 2.0) - busy(zbv, 1.0) == pytest.approx(extra, rel=1e-6)
    assert busy(one_f_one_b, 2.0) == busy(one_f_one_b, 1.0)


def test_measured_profile_times_the_split_backward():
    from pipezero.train.plan.model import measure_profile

    profile = measure_profile(ModelShape(layers=2, d_model=32, heads=2, seq_len=16, vocab=64), microbatch=1, rounds=1)
    # the local-tensor split costs a few hooks: measured, it may round to 0 on a busy machine (below)
    assert all(p.split_seconds > 0 and p.tensor_overhead >= 0 for p in profile if p.kind == "Block")
    assert all(p.split_seconds is None and p.tensor_overhead == 0 for p in profile if p.kind != "Block")


def test_measured_profile_times_what_runs_compiled_or_not():
    """With compile on (the default on CUDA) the planner times the block and the loss compiled, as
    PipelineModule runs them; a counting backend sees them compiled, and nothing with compile=False."""
    import torch

    from pipezero.pipe.compile import CompileConfig
    from pipezero.train.plan.model import measure_profile

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    shape = ModelShape(layers=2, d_model=32, heads=2, seq_len=16, vocab=64)
    try:
        torch._dynamo.reset()
        profile = measure_profile(shape, microbatch=1, rounds=1, compile=CompileConfig(backend=counting))
        assert len(graphs) >= 2, graphs  # the block (alone, checkpointed, split: one code object) and the loss
        assert all(p.seconds > 0 for p in profile)
        # the selective block runs eager (compiles_checkpointed): timed so, and what it adds is measured
        assert all(p.selective_seconds is not None for p in profile if p.kind == "Block")
        graphs.clear()
        measure_profile(shape, microbatch=1, rounds=1, compile=False)
        assert not graphs
    finally:
        torch._dynamo.reset()


def test_tensor_overhead_is_the_split_block_as_the_pipeline_runs_it_less_the_whole(monkeypatch):
    """The planner's tensor cost: the Block split over a one-rank mesh into local-tensor shards (what
    PipelineModule runs, not DTensor) timed against the same Block whole, per round the fastest."""
    from pipezero import pipe
    from pipezero.comm.tensor_shard import tensor_shard
    from pipezero.train.plan.model import measure_profile

    seen, fake_ms = [], iter([2.0, 5.0, 1.0, 4.5] * 2)  # whole, split per round: min 1.0 and 4.5

    def timed(layers, hidden, repeats):
        block = layers[0]
        shards = [tensor_shard(m.weight) for m in block.modules() if isinstance(m, torch.nn.Linear)]
        seen.append((any(isinstance(p, DTensor) for p in block.parameters()), sum(s is not None for s in shards)))
        return [next(fake_ms)]

    monkeypatch.setattr(pipe, "measure_layer_costs", timed)
    from pipezero.train.plan import model as plan_model

    ms = plan_model._tensor_overhead_ms(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=64),
                                        torch.float32, torch.randn(1, 16, 32), repeats=1, rounds=2)
    assert ms == 3.5, ms
    whole, split = seen[0], seen[1]
    assert whole == (False, 0) and split[0] is False and split[1] >= 2, seen  # plain tensors, marked shards


def test_tensor_parallel_layouts_pay_dtensor_dispatch_per_block_and_microbatch():
    """Tensor 2 on 2 H200s ran 8x its prediction, CPU-bound on DTensor's dispatch (~30 operators
    per block): a fixed cost per block and micro-batch that neither the micro-batch nor the
    tensor degree shrinks."""
    from pipezero.train.plan.step_time import simulate_layout

    tp2, tp1 = Layout(1, 1, 2, "1f1b", 1, 8, 1, 0), Layout(1, 1, 1, "1f1b", 1, 8, 1, 0)
    hw = replace(HW, layer_overhead_us=0.0)
    blocks = sum(1 for p in PROFILE if p.kind == "Block")

    def busy(layout, overhead):
        profile = [replace(p, tensor_overhead=overhead) if p.kind == "Block" else p for p in PROFILE]
        return sum(simulate_layout(profile, layout, hw, "bf16", SMALL.d_model, SMALL.seq_len)[0].busy.values())
    assert busy(tp2, 1e-3) - busy(tp2, 0.0) == pytest.approx(8 * blocks * 1e-3, rel=1e-6)
    assert busy(tp1, 1e-3) == busy(tp1, 0.0)


def test_zero3_in_a_pipeline_holds_and_gathers_what_the_schedule_says():
    """Interleaved 1F1B, four chunks a rank: resharding after each run of a chunk holds less (the running
    chunk and the prefetched next, not every chunk) and gathers more (train/plan/zero3.py; the counts
    are checked against real runs in tests/test_zero3_pipe.py)."""
    whole = Layout(2, 4, 1, "interleaved_1f1b", 4, 8, 1, 3)
    whole_p, resharded = (predict(PROFILE, lay, HW, SMALL, "bf16") for lay in (whole, replace(whole, reshard=True)))
    assert resharded.memory.buffers < whole_p.memory.buffers
    assert resharded.time.data_comm > whole_p.time.data_comm
    assert ds_config(resharded)["pipeline"]["reshard_after_forward"] is True
