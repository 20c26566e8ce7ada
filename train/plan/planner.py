"""The planner: every layout of a job, its predicted step time and memory, ranked; the winner's config.

    preds = plan(ModelShape(layers=24, d_model=2048, heads=16, seq_len=2048, vocab=50304),
                 h200(nodes=1), global_batch=512, precision="bf16")
    print(format_table(preds[:10])); print(explain(preds[0])); ds_config(preds[0])

Each layout (layout.py) is timed by step_time.py (pipe/schedule/simulate.py per rank with
compute, p2p, tensor- and data-parallel traffic) and sized by memory.py (the ZeRO
formulas, the simulator's peak live micro-batches; and the host memory its offloads take);
layouts over the device's memory or the host's are dropped and the rest ranked by tokens/s
(less device memory breaks ties). Why a layout wins is in
its parts: compute, bubble, exposed communication, the optimizer, the memory breakdown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from pipezero.pipe.schedule.registry import schedule_entry
from pipezero.train.plan.hardware import Hardware
from pipezero.train.plan.layout import Layout, enumerate_layouts
from pipezero.train.plan.memory import HostBreakdown, MemoryBreakdown, rank_memory
from pipezero.train.plan.model import LayerProfile, ModelShape
from pipezero.train.plan.step_time import TimeBreakdown, chunk_layers, step_time, step_time_floor
from pipezero.train.plan.zero3 import layout_gathers

__all__ = ["Prediction", "ds_config", "explain", "format_table", "kit_table", "node_host", "plan", "predict",
           "predict_fitted", "torchrun_command"]

_MESSAGE_PREDICTIONS = 64  # layouts predicted, least host memory first, to say why none fits


@dataclass(frozen=True, slots=True)
class Prediction:
    """One layout's predicted step."""

    layout: Layout
    time: TimeBreakdown
    memory: MemoryBreakdown        # the fullest pipeline rank (its `host`: the fullest node's per device)
    tokens_per_step: int
    flops_per_step: float          # model FLOPs (no recompute), as MFU counts them
    hardware: Hardware
    shape: ModelShape
    precision: str
    partition_costs: tuple[float, ...]

    @property
    def tokens_per_second(self) -> float:
        """Global training throughput."""
        return self.tokens_per_step / self.time.total

    @property
    def fits(self) -> bool:
        """Within the device's memory and the host's (MemoryBreakdown.fits)."""
        return self.memory.fits(self.hardware)

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the devices' peak."""
        return self.flops_per_step / self.time.total / (self.layout.world * self.hardware.peak_tflops * 1e12)


def predict(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, shape: ModelShape,
            precision: str, memo: dict | None = None) -> Prediction:
    """Step time and peak memory of one layout (`memo`: see step_time.simulate_layout)."""
    return _predict(profile, layout, hw, shape, precision, memo)[0]


def predict_fitted(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, shape: ModelShape,
                   precision: str, memo: dict | None = None) -> Prediction:
    """predict(), or its twin that does less of the memory kit where that twin fits (what plan() ranks).

    A layout whose checkpointed inputs all on the host would overflow it, while the device holds the
    rest, comes back as its twin that offloads only the first layers' inputs, as many as the host
    holds (Layout.host_layers); one that checkpoints every layer on the device and fits, as its twin
    that checkpoints only the first layers, as few as the device holds (Layout.checkpoint_layers:
    less recompute)."""
    pred, live, held = _predict(profile, layout, hw, shape, precision, memo)
    twin = _fewer(profile, pred, live, held)
    if twin is None:
        return pred
    partial = _predict(profile, twin, hw, shape, precision, memo)[0]
    return partial if partial.fits else pred


def _predict(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, shape: ModelShape,
             precision: str, memo: dict | None) -> tuple[Prediction, Sequence[float], dict]:
    """predict() of the layout, the micro-batches each pipe rank holds at its peak, and each (rank, chunk)'s
    layers."""
    time, result, held = step_time(profile, layout, hw, precision, shape.d_model, shape.seq_len, memo)
    worst = _fullest(profile, layout, hw, precision, shape, held, result.live)
    tokens = layout.replicas * layout.microbatches * layout.microbatch_size * shape.seq_len
    flops = sum(p.flops for p in profile) * tokens
    total = sum(p.seconds for p in profile) or 1.0
    return Prediction(layout, time, worst, tokens, flops, hw, shape, precision,
                      tuple(round(p.seconds / total, 6) for p in profile)), result.live, held


def _fullest(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, precision: str, shape: ModelShape,
             held: dict, live: Sequence[float] | None) -> MemoryBreakdown:
    """The device's fullest pipe rank's memory, with the host's fullest node's (`live`: the micro-batches each
    rank holds at its peak; None: none, the floor)."""
    worst, hosts = None, []
    for rank in range(layout.pipe):
        layers = [i for (r, _), rng in sorted(held.items()) if r == rank for i in rng]
        mem = rank_memory(profile, layers, 0.0 if live is None else live[rank], layout, hw, precision,
                          shape.d_model, shape.seq_len, _gathered(profile, layout, held, rank))
        worst = mem if worst is None or mem.total > worst.total else worst
        hosts.append(mem.host)
    return replace(worst, host=node_host(hosts, layout, hw))


def _fewer(profile: Sequence[LayerProfile], pred: Prediction, live: Sequence[float], held: dict) -> Layout | None:
    """The twin predict_fitted() takes instead of pred's layout (its docstring), or None: the most first
    layers whose inputs the host holds, where offloading all overflows it and the device holds the rest;
    the fewest first layers checkpointed that the device holds, where checkpointing all of them fits."""
    lay, hw, mem = pred.layout, pred.hardware, pred.memory
    most = max(len(rng) for rng in held.values())
    if lay.may_offload_fewer and not mem.fits(hw) and mem.total <= hw.memory_gb * 1e9:
        options, fits = [replace(lay, host_layers=n) for n in range(most - 1, 0, -1)], \
            (lambda m: m.host.total <= hw.host_memory_gb * 1e9)
    elif lay.may_checkpoint_fewer and mem.fits(hw):
        options, fits = [replace(lay, checkpoint_layers=n) for n in range(1, most)], (lambda m: m.fits(hw))
    else:
        return None
    return _first(options, lambda option: fits(_fullest(profile, option, hw, pred.precision, pred.shape, held,
                                                         live)))


def _first(options: Sequence[Layout], fits: Callable[[Layout], bool]) -> Layout | None:
    """The first of `options` that fits, where each after a fitting one fits too: by bisection (the memory
    walk is as long as the rank's layers, and so are the options)."""
    lo, hi = 0, len(options)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(options[mid]):
            hi = mid
        else:
            lo = mid + 1
    return options[lo] if lo < len(options) else None


def plan(shape: ModelShape, profile: Sequence[LayerProfile], hw: Hardware, global_batch: int,
         precision: str = "bf16", *, keep_unfit: bool = False, top: int | None = None,
         **enumerate_kw: Any) -> list[Prediction]:
    """Every layout that fits, best tokens/s first (with keep_unfit, the rest after them).

    With `top`, only the `top` best that fit, found without simulating every layout: layouts
    are predicted in the order of their step-time floor (step_time.step_time_floor) and the
    search stops once a floor exceeds the step time of the `top`-th best so far; layouts whose
    memory without activations already exceeds the device are never simulated. The answer is
    the same as the full ranking's first `top` rows (every floor is a true lower bound), which
    is what makes 512-4096 GPU plans take seconds instead of hours.
    """
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r}: expected sequences per step >= 1")
    if top is not None and (top < 1 or keep_unfit):
        raise ValueError(f"plan(top={top!r}, keep_unfit={keep_unfit!r}): top must be >= 1 and excludes keep_unfit")
    memo: dict = {}
    enumerate_kw.setdefault("offload", hw.host_offload)
    enumerate_kw.setdefault("seq_len", shape.seq_len)
    enumerate_kw.setdefault("experts", shape.experts)
    layouts = list(enumerate_layouts(hw.world, hw.gpus_per_node, global_batch, len(profile), shape.heads,
                                     **enumerate_kw))
    if top is None:
        preds = [predict_fitted(profile, layout, hw, shape, precision, memo) for layout in layouts]
        fitting = {lay for p, asked in zip(preds, layouts) if p.fits for lay in (p.layout, asked)}
        preds = [p for p in preds if not _needless(p.layout, fitting)]
    else:
        preds = _bounded(profile, layouts, hw, shape, precision, top, memo)
    fits = [p for p in preds if p.fits]
    if not fits:
        raise ValueError(_none_fits(preds, hw, shape))
    rank = sorted(fits, key=lambda p: (-p.tokens_per_second, p.memory.total))
    if keep_unfit:
        rank += sorted((p for p in preds if p not in fits), key=lambda p: -p.tokens_per_second)
    return rank[:top]


def node_host(hosts: Sequence[HostBreakdown], layout: Layout, hw: Hardware) -> HostBreakdown:
    """The host memory per device of the fullest node, from each pipeline rank's (`hosts`, by pipe rank).

    A node's processes share its memory: the layout fits where each node's ranks together take no more
    than its devices' share (gpus_per_node x Hardware.host_memory_gb). Ranks are numbered pipe slowest
    (topology/grid.py's AXES), so global rank g is pipe rank g // (world / pipe), and a node of G devices
    holds ranks n G .. n G + G - 1: one pipe rank where the other axes fill the node, several where not.
    """
    per_stage, node = layout.world // layout.pipe, min(hw.gpus_per_node, layout.world)
    if per_stage % node == 0:  # each node holds ranks of one stage
        return max(hosts, key=lambda h: h.total)
    best = HostBreakdown()
    for first in range(0, layout.world, node):
        ranks = [hosts[g // per_stage] for g in range(first, min(first + node, layout.world))]
        n = len(ranks)
        mean = HostBreakdown(sum(h.optimizer for h in ranks) / n, sum(h.inputs for h in ranks) / n,
                             sum(h.reserved for h in ranks) / n)
        best = mean if mean.total > best.total else best
    return best


def _none_fits(preds: Sequence[Prediction], hw: Hardware, shape: ModelShape) -> str:
    """Why no layout fits: the leanest one on the device, and, where it fits the device, its host memory."""
    on_device = [p for p in preds if p.memory.total <= hw.memory_gb * 1e9]
    host = bool(on_device)
    least = (min(on_device, key=lambda p: p.memory.host.total) if host else
             min(preds, key=lambda p: p.memory.total, default=None))
    if least is None:
        need = ""
    elif host:
        need = (f"; those that fit the device need more host memory, the least {least.memory.host.total / 1e9:.1f} "
                f"GB ({least.layout.label}: {_host_words(least.memory.host)})")
    else:
        need = f"; the smallest needs {least.memory.total / 1e9:.1f} GB ({least.layout.label})"
    fix = ("more host memory per device (--host-memory-gb, if the machine has it), more devices (the "
           "optimizer's shards and the sequence split over them)" if host else
           "add devices (a sequence axis splits each sequence over them)")
    of_host = f" and {hw.host_memory_gb:g} GB of host memory" if hw.host_offload else ""
    return (f"no layout of {shape.label} fits {hw.memory_gb:g} GB{of_host} per device on {hw.name}{need}: {fix}, "
            "lower the micro-batch or the sequence length")


def _host_words(h: HostBreakdown) -> str:
    return (f"optimizer {h.optimizer / 1e9:.3g}, checkpointed inputs {h.inputs / 1e9:.3g}, "
            f"the process {h.reserved / 1e9:.3g}")


def _bounded(profile: Sequence[LayerProfile], layouts: Sequence[Layout], hw: Hardware, shape: ModelShape,
             precision: str, top: int, memo: dict) -> list[Prediction]:
    """Predictions of the layouts that can reach the `top` best (branch and bound on the floors)."""
    d, s = shape.d_model, shape.seq_len
    memory = [_memory_floor(profile, lay, hw, precision, shape) for lay in layouts]
    possible = [m.fits(hw) for m in memory]
    if layouts and not any(possible):  # nothing can fit; for the error message, what may fit the device
        device = sorted((i for i, m in enumerate(memory) if m.total <= hw.memory_gb * 1e9),
                        key=lambda i: memory[i].host.total)[:_MESSAGE_PREDICTIONS] or \
            [min(range(len(layouts)), key=lambda i: memory[i].total)]  # or the leanest
        return [predict_fitted(profile, layouts[i], hw, shape, precision, memo) for i in device]
    busy: dict = {}
    floors = sorted((step_time_floor(profile, lay, hw, precision, d, s, busy), i) for i, lay in enumerate(layouts)
                    if possible[i])
    best: list[float] = []  # step times of the fitting predictions so far, ascending, at most `top`
    preds, fitting = [], set()
    for floor, i in floors:
        if len(best) == top and floor > best[-1]:
            break
        if _needless(layouts[i], fitting):
            continue
        pred = predict_fitted(profile, layouts[i], hw, shape, precision, memo)
        preds.append(pred)
        if pred.fits:
            best = sorted(best + [pred.time.total])[:top]
            fitting.update((pred.layout, layouts[i]))  # what it was asked as, and the twin it came back as
    return preds


def _needless(layout: Layout, fitting: set) -> bool:
    """Is a lighter twin of this layout among those that fit (`fitting`: each as it was asked, and as
    predict_fitted() returned it)? Checkpointing and host inputs only add time, so the twin without them (its
    floor is no higher: it comes first) is as fast or faster: the kit is switched on only where what it
    saves is needed."""
    if not layout.checkpoint:
        return False
    plain = replace(layout, checkpoint=0, selective=False, host_inputs=False, host_layers=None, checkpoint_layers=None)
    return plain in fitting or (layout.host_inputs and replace(layout, host_inputs=False, host_layers=None) in fitting)


def _memory_floor(profile: Sequence[LayerProfile], layout: Layout, hw: Hardware, precision: str,
                  shape: ModelShape) -> MemoryBreakdown:
    """The fullest rank's memory with no micro-batch in flight, device and host: a lower bound of predict()'s."""
    held = chunk_layers(profile, layout, schedule_entry(layout.schedule).placement)
    return _fullest(profile, layout, hw, precision, shape, held, None)


def _gathered(profile: Sequence[LayerProfile], layout: Layout, held: dict, rank: int) -> float | None:
    """ZeRO-3: the parameters the rank's schedule holds whole at once (zero3.py); None below stage 3."""
    gathers = layout_gathers(profile, layout, held, rank)
    return gathers.peak if gathers is not None else None


def format_table(preds: Sequence[Prediction]) -> str:
    """The ranked table: layout, tokens/s, MFU, step, bubble, exposed comm, memory."""
    rows = [f"{'#':>3}  {'layout':<44} {'tokens/s':>11} {'MFU':>6} {'step s':>9} {'bubble':>6} "
            f"{'exp.comm':>8} {'mem GB':>8} {'host GB':>8}"]
    for i, p in enumerate(preds, 1):
        rows.append(f"{i:>3}  {p.layout.label:<44} {p.tokens_per_second:>11,.0f} {_mfu(p):>6} "
                    f"{p.time.total:>9.4g} {p.time.bubble:>6.1%} {p.time.exposed_comm / p.time.total:>8.1%} "
                    f"{p.memory.total / 1e9:>8.3g} {_host_gb(p):>8}")
    over = [p for p in preds if p.mfu > 1]
    if over:
        rows.append(_unreliable_mfu(over[0]))
    return "\n".join(rows)


def _host_gb(p: Prediction) -> str:
    """The host memory a rank needs in GB; "-" where the devices are the host (nothing is offloaded)."""
    return f"{p.memory.host.total / 1e9:.3g}" if p.hardware.host_offload else "-"


def _mfu(p: Prediction) -> str:
    """MFU as a percentage; '?' above 100%, which only a peak measured too low gives."""
    return f"{p.mfu:.1%}" if p.mfu <= 1 else "?"


def _unreliable_mfu(p: Prediction) -> str:
    return (f"MFU ?: the layers ran {p.mfu:.3g}x faster than the measured peak of {p.hardware.peak_tflops:.3g} "
            "TFLOP/s per device allows, so that measurement is unreliable (the machine was busy while it ran); "
            "the ranking does not use it")


def explain(p: Prediction) -> str:
    """Where the winner's time and memory go, in words and numbers."""
    t, m, gb = p.time, p.memory, 1e9
    return "\n".join([
        f"{p.layout.label} on {p.hardware.name}, {p.shape.label}, {p.precision}:",
        f"  step {t.total:.4g} s = pipeline makespan {t.pipeline:.4g} s (busiest rank computes {t.compute:.4g} s, "
        f"of it tensor-parallel all-reduce {t.tensor_comm:.3g} s"
        + (f", sequence all-to-all {t.sequence_comm:.3g} s" if p.layout.sequence > 1 else "")
        + (f", expert dispatch + combine {t.expert_comm:.3g} s" if p.layout.expert > 1 else "")
        + f"; bubble {t.bubble:.1%})",
        f"    + exposed data-parallel comm {t.exposed_comm:.3g} s (of {t.data_comm:.3g} s in all) "
        f"+ optimizer {t.optimizer:.3g} s",
        f"  {p.tokens_per_second:,.0f} tokens/s, MFU {_mfu(p)} of {p.hardware.peak_tflops:.3g} TFLOP/s per device",
        f"  memory {m.total / gb:.3g} GB of {p.hardware.memory_gb:g}: params {m.params / gb:.3g}, "
        f"grads {m.grads / gb:.3g}, optimizer {m.optimizer / gb:.3g}, the larger of activations "
        f"{m.activations / gb:.3g} and the optimizer step's transient {m.step / gb:.3g}, buffers {m.buffers / gb:.3g}"]
        + ([f"  host memory {m.host.total / gb:.3g} GB of {p.hardware.host_memory_gb:g}: {_host_words(m.host)}"]
           if p.hardware.host_offload else [])
        + [f"  activation checkpointing: {_kit_words(p.layout)}"]
        + ([f"  ZeRO-3: {_zero3_words(p.layout)}"] if p.layout.zero == 3 else [])
        + ([f"  expert axis {p.layout.expert}: ds_config's expert_parallel autoep_size {p.layout.expert} "
            "(pipezero finetune --expert-parallel; README, Mixture-of-experts)"] if p.layout.expert > 1 else []))


def _zero3_words(lay: Layout) -> str:
    how = ("freed whenever another chunk runs and gathered again for each run of its actions "
           "(pipeline reshard_after_forward on)" if lay.reshard else
           "whole from its first to its last action, one all-gather per layer a step (reshard_after_forward off)")
    return (f"each chunk's parameters {how}, the next chunk's gathers started early; the buffers hold the "
            "parameters whole at once (train/plan/zero3.py)")


def _kit_words(lay: Layout) -> str:
    if not lay.checkpoint:
        return "none"
    host = f", the first {lay.host_layers} layers' inputs" if lay.host_layers else ", its inputs"
    which = f" of the first {lay.checkpoint_layers}" if lay.checkpoint_layers else ""
    return (f"{lay.recompute}, every {lay.checkpoint} layer{'s' if lay.checkpoint > 1 else ''}{which}"
            + (f"{host} in pinned host memory" if lay.host_inputs else ""))


def kit_table(profile: Sequence[LayerProfile], winner: Prediction) -> str:
    """What each activation-checkpointing choice needs on the winner's grid and batch, and whether it fits."""
    hw, lay = winner.hardware, winner.layout
    of_host = f", host {hw.host_memory_gb:g} GB" if hw.host_offload else ""
    rows = [f"memory at {winner.shape.seq_len:,} tokens a sequence on {lay.label.split(' m')[0]}, "
            f"micro-batch {lay.microbatch_size} (of {hw.memory_gb:g} GB{of_host}):"]
    kits = [(0, False, False), (1, True, False), (1, False, False)]
    kits += [(1, True, True), (1, False, True)] if hw.host_offload else []
    for ck, selective, host in kits:
        option = replace(lay, checkpoint=ck, selective=selective, host_inputs=host, host_layers=None,
                         checkpoint_layers=None)
        pred = predict_fitted(profile, option, hw, winner.shape, winner.precision)
        misfit = pred.memory.misfit(hw)
        fits = f"does not fit ({misfit})" if misfit else "fits"
        on_host = f", host {pred.memory.host.total / 1e9:5.3g} GB" if hw.host_offload else ""
        rows.append(f"  {_kit_words(pred.layout):<76} {pred.memory.total / 1e9:8.3g} GB{on_host}  {fits}, "
                    f"{pred.tokens_per_second:,.0f} tokens/s")
    return "\n".join(rows)


def ds_config(p: Prediction) -> dict[str, Any]:
    """The winner as a ds_config.json dict (pipezero's "pipeline" section included)."""
    lay = p.layout
    zero: dict[str, Any] = {"stage": lay.zero, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": p.shape.d_model ** 2}  # what "auto" means (h*h)
    if lay.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    out = {
        "train_batch_size": lay.replicas * lay.microbatches * lay.microbatch_size,
        "train_micro_batch_size_per_gpu": lay.microbatch_size,
        "gradient_accumulation_steps": lay.microbatches,
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16"},
        "zero_optimization": zero,
        "pipeline": {"stages": lay.pipe, "schedule": lay.schedule, "chunks": lay.chunks,
                     "reshard_after_forward": lay.reshard,
                     "activation_checkpoint_interval": lay.checkpoint, "activation_checkpointing": lay.recompute,
                     "partition_method": list(p.partition_costs)},
        "sequence_parallel_size": lay.sequence,
        "gradient_clipping": 1.0,
    }
    if lay.host_inputs:
        out["activation_checkpointing"] = {"cpu_checkpointing": True}
    if lay.host_layers:
        out["pipeline"]["offload_activation_layers"] = lay.host_layers
    if lay.checkpoint_layers:
        out["pipeline"]["activation_checkpoint_layers"] = lay.checkpoint_layers
    if lay.expert > 1:  # DeepSpeed's AutoEP section, which build() reads as the grid's expert axis
        out["expert_parallel"] = {"enabled": True, "autoep_size": lay.expert}
    return out


def torchrun_command(p: Prediction, config_path: str = "plan_ds_config.json") -> str:
    """The launch line for the main job with the winner's config (one line per node).

    The job by module (pipezero.train.gpt.job, what examples/train_gpt.py runs): an installed wheel has no
    examples/ folder, and the line must run wherever `pipezero plan` does.
    """
    hw, s = p.hardware, p.shape
    if hw.nodes == 1:
        launch = f"torchrun --standalone --nproc-per-node {p.layout.world}"
    else:
        launch = (f"torchrun --nnodes {hw.nodes} --nproc-per-node {hw.gpus_per_node} --rdzv-backend c10d "
                  "--rdzv-endpoint node0:29500 --rdzv-id plan")
    return (f"{launch} -m pipezero.train.gpt.job --config {config_path} --tensor {p.layout.tensor} "
            f"--layers {s.layers} --d-model {s.d_model} --heads {s.heads} --seq-len {s.seq_len}")


def write_config(p: Prediction, path: str) -> None:
    """Write ds_config(p) as JSON."""
    with open(path, "w") as f:
        json.dump(ds_config(p), f, indent=1)
        f.write("\n")
