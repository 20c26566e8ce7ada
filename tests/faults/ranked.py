"""Bad inputs that only show across ranks: each function runs on every rank of a gloo world (through
tests/harness.py) and must raise a clear error on EVERY rank, before any collective can hang, or
within seconds of a peer that failed or closed its connection.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

WORDS: dict[str, tuple[str, ...]] = {}
CASES: dict[str, Callable[[], Any]] = {}
SOLO: dict[str, Callable[[], Any]] = {}  # break their pipe groups: run on pipe 2 x data 2, in this order, last


def case(words: tuple[str, ...], solo: bool = False):
    def register(fn):
        (SOLO if solo else CASES)[fn.__name__] = fn
        WORDS[fn.__name__] = words
        return fn
    return register


def _mlp(pipe: int = 2, m: int = 2, layers: int = 4, width: int = 4, schedule=None, timeout_s: float = 300.0,
         vocab: int | None = None):
    from pipezero.pipe import LayerSpec, OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid

    grid = Grid(pipe=pipe)
    specs = [LayerSpec(nn.Embedding, vocab, width)] if vocab else []
    specs += [LayerSpec(nn.Linear, width, width) for _ in range(layers)]
    model = PipelineModule(specs, grid, loss_fn=F.mse_loss, partition_method="uniform")
    return PipelineRunner(model, schedule or OneFOneB(num_microbatches=m), timeout_s=timeout_s)


def _x(n: int = 8, width: int = 4) -> torch.Tensor:
    return torch.ones(n, width)


@case(("inputs=None",))
def first_stage_without_inputs():
    _mlp().train_step(None, _x())


@case(("targets=None",))
def last_stage_without_targets():
    _mlp().train_step(_x(), None)


@case(("batch dimension (9)", "num_microbatches=2"))
def batch_not_divisible():
    _mlp().train_step(_x(9), _x(9))


@case(("different microbatch counts", "2 to 4"))
def microbatch_count_differs_between_stages():
    import torch.distributed as dist
    _mlp(m=2 if dist.get_rank() == 0 else 4).train_step(_x(), _x())


@case(("inputs hold 8 samples but the targets 6",))
def inputs_and_targets_differ():
    _mlp().train_step(_x(8), _x(6))


@case(("batch sizes differ between ranks", "4 to 8"))
def data_ranks_batch_sizes_differ():
    import torch.distributed as dist
    n = 8 if dist.get_rank() == 0 else 4
    _mlp(pipe=1).train_step(_x(n), _x(n))


@case(("called train_step / eval_step a different number of times", "rank 0 at training step 2",
       "rank 1 at an evaluation after training step 1"))
def data_ranks_uneven_step_counts():
    """Data rank 0 runs one training step more (a shard with one batch more), then both evaluate:
    without a step count in the step-start check, rank 0's train step met rank 1's evaluation."""
    import torch.distributed as dist
    runner = _mlp(pipe=1)
    for _ in range(2 if dist.get_rank() == 0 else 1):
        runner.train_step(_x(), _x())
    runner.eval_step(_x(), _x())


@case(("tensors differ in their batch dimension",))
def ragged_input_tuple():
    from pipezero.pipe import LayerSpec, OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    model = PipelineModule([LayerSpec(nn.Identity)] * 2, Grid(pipe=2), loss_fn=lambda o, t: o[0].sum())
    PipelineRunner(model, OneFOneB(num_microbatches=2)).train_step((torch.ones(4, 2), torch.ones(2, 2)), _x())


@case(("0B0",))
def custom_schedule_backward_before_forward():
    from pipezero.pipe import Custom
    _mlp(schedule=Custom({0: ["0B0", "0F0"], 1: ["0F0", "0B0"]}))


@case(("OneFOneB runs 1 chunks", "num_chunks=2"))
def schedule_chunks_differ_from_module():
    from pipezero.pipe import LayerSpec, OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    model = PipelineModule([LayerSpec(nn.Linear, 4, 4)] * 4, Grid(pipe=2), loss_fn=F.mse_loss, num_chunks=2)
    PipelineRunner(model, OneFOneB(num_microbatches=2))


@case(("actions uses chunks 0..0", "num_chunks=2"))
def schedule_actions_skip_a_chunk():
    """A schedule that says it runs 2 chunks but whose actions run only chunk 0."""
    from types import SimpleNamespace

    from pipezero.pipe import LayerSpec, OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    model = PipelineModule([LayerSpec(nn.Linear, 4, 4)] * 4, Grid(pipe=2), loss_fn=F.mse_loss, num_chunks=2)
    sched = SimpleNamespace(num_microbatches=2, num_chunks=2, placement="looped",
                            actions=OneFOneB(num_microbatches=2).actions)
    PipelineRunner(model, sched)


@case(("3 layers cannot fill 2 pipeline stages x 2 chunks",))
def more_stages_than_layers():
    from pipezero.train.build import build
    build({"train_batch_size": 4, "pipeline": {"stages": 2, "chunks": 2, "schedule": "interleaved_1f1b"}},
          specs=[nn.Linear(2, 2)] * 3, loss_fn=F.mse_loss)


@case(("ZeroOptimizer", "different parameters"))
def zero_ranks_hold_different_parameters():
    import torch.distributed as dist

    from pipezero.zero import ZeroOptimizer
    n = 3 if dist.get_rank() == 0 else 5
    ZeroOptimizer(torch.optim.Adam([nn.Parameter(torch.zeros(n))]), stage=2, group=dist.group.WORLD)


@case(("layers[0] (Linear) and layers[3] (Linear)", "the same module object", "pipeline ranks 0 and 1",
        "TiedLayerSpec"))
def same_module_object_on_two_stages():
    """Issue 28 item 13: one nn.Linear at both ends of a 2-stage pipeline would train as two copies."""
    from pipezero.pipe import PipelineModule
    from pipezero.topology import Grid
    shared = nn.Linear(4, 4)
    PipelineModule([shared, nn.Linear(4, 4), nn.Linear(4, 4), shared], Grid(pipe=2), partition_method="uniform")


@case(("and layers[3] (Linear) share parameter 'weight'", "pipeline ranks 0 and 1", "TiedLayerSpec"))
def parameter_shared_by_layers_on_two_stages():
    """A head whose weight is the embedding's, both passed as modules on different stages."""
    from pipezero.pipe import PipelineModule
    from pipezero.topology import Grid
    embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    PipelineModule([embed, nn.Linear(4, 4), nn.Linear(4, 4), head], Grid(pipe=2), partition_method="uniform")


def _build(layers: int, ckpt: str | None = None):
    from pipezero.pipe import LayerSpec
    from pipezero.train.build import build
    from pipezero.train.checkpoint.state import load_state, save_state
    parts = build({"train_batch_size": 4, "pipeline": {"stages": 2, "partition_method": "uniform"},
                   "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
                  specs=[LayerSpec(nn.Linear, 4, 4) for _ in range(layers)], loss_fn=F.mse_loss)
    if ckpt is not None:
        return load_state(parts, ckpt)
    return parts, save_state


@case(("does not fit the model",))
def checkpoint_of_another_model():
    import tempfile

    import torch.distributed as dist
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    parts, save = _build(4)
    save(parts, box[0], 1)
    _build(5, box[0])  # one layer more: only the last stage's names differ


@case(("loss-scaler state", "scale=nan"))
def checkpoint_with_nan_loss_scale():
    import json
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    from pipezero.train.checkpoint.files import _manifest_digest
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    parts, save = _build(4)
    save(parts, box[0], 1)
    if dist.get_rank() == 0:  # an edit with a fresh manifest checksum: the scaler itself must refuse it
        path = Path(box[0]) / "step_00000001" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["meta"]["chain"][0]["loss_scaler"]["scale"] = float("nan")
        manifest["sha256"] = _manifest_digest(manifest)
        path.write_text(json.dumps(manifest))
    dist.barrier()
    _build(4, box[0])


def _timed(fn: Callable[[], Any]) -> Any:
    start = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads type, message and time
        raise type(err)(f"[{time.monotonic() - start:.1f}s] {err}") from err


@case(("layer 0 (Embedding)", "values in [0, 33]", "vocabulary"), solo=True)
def token_id_past_vocabulary():
    """Stage 0 fails inside its first layer; stage 1 learns it within its (short) pipeline timeout."""
    import torch.distributed as dist
    runner = _mlp(vocab=10, timeout_s=3.0)
    ids = torch.arange(8).remainder(10) * (11 if dist.get_rank() in (0, 1) else 1)
    _timed(lambda: runner.train_step(ids[:, None].expand(8, 3) % 100, torch.ones(8, 3, 4)))


@case(("layer 2 (Linear)", "previous stage's output"), solo=True)
def stage_output_does_not_fit_next_stage():
    from pipezero.pipe import LayerSpec, OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    specs = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 6), LayerSpec(nn.Linear, 4, 4),
             LayerSpec(nn.Linear, 4, 4)]
    model = PipelineModule(specs, Grid(pipe=2), loss_fn=F.mse_loss, partition_method="uniform")
    runner = PipelineRunner(model, OneFOneB(num_microbatches=2), timeout_s=3.0)  # stage 1 fails, stage 0 waits
    _timed(lambda: runner.train_step(_x(), _x()))


@case(("loss_fn returned (4, 4) float32", "expected a scalar tensor", ".mean()"), solo=True)
def loss_fn_returns_a_tensor_per_sample():
    """Issue 28 item 18: the last stage names the loss; stage 0 learns within its 3 s pipeline timeout."""
    from pipezero.pipe import LayerSpec, OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    model = PipelineModule([LayerSpec(nn.Linear, 4, 4) for _ in range(4)], Grid(pipe=2),
                           loss_fn=lambda out, target: (out - target) ** 2, partition_method="uniform")
    runner = PipelineRunner(model, OneFOneB(num_microbatches=2), timeout_s=3.0)
    _timed(lambda: runner.train_step(_x(), _x()))


@case(("loss_fn returned () int64", "floating-point scalar"), solo=True)
def loss_fn_returns_an_integer():
    """Issue 28 round 3: a loss cast to an integer got torch's "does not require grad" on the last stage."""
    from pipezero.pipe import LayerSpec, OneFOneB, PipelineModule, PipelineRunner
    from pipezero.topology import Grid
    model = PipelineModule([LayerSpec(nn.Linear, 4, 4) for _ in range(4)], Grid(pipe=2),
                           loss_fn=lambda out, target: (out - target).square().sum().long(), partition_method="uniform")
    runner = PipelineRunner(model, OneFOneB(num_microbatches=2), timeout_s=3.0)
    _timed(lambda: runner.train_step(_x(), _x()))


@case(("closed its connection",), solo=True)
def peer_exits_mid_step():
    """The last rank exits mid-run (its process closes its connections); the others must say so at
    once, not after their 60 s timeout. Each rank that fails exits too, as the main job's ranks do,
    so a rank that only waits on a survivor learns of it as well."""
    import torch.distributed as dist
    runner = _mlp(timeout_s=60.0)
    runner.train_step(_x(), _x())
    try:
        if dist.get_rank() == dist.get_world_size() - 1:
            raise ConnectionError("this rank exits on purpose (the fault under test): closed its connection")
        _timed(lambda: runner.train_step(_x(), _x()))
    finally:  # answer the harness first, then exit as a crashed process would
        threading.Thread(target=lambda: (time.sleep(0.3), os._exit(0)), daemon=True).start()
