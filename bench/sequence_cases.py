"""What each rank of bench/sequence_scaling.py runs: one case (a layout of the world) built, trained and timed.

A `Case` is a layout of every process of the running group: pipe x data x sequence = the world, the
rows of a step spread over the data ranks (micro-batches of one row), pipezero's Llama layers
(hf_layer_specs with the fused head + loss, packed documents attended each on its own) under
PipelineRunner with ZeRO-3 over data x sequence, every layer checkpointed (`Kit`), or DeepSpeed ALST
at the same sequence degree (bench/long_context_alst.alst_sp_step). `run_cases` runs them one after
the other in the running process group and returns rank 0's measurements: tokens/s per GPU, peak
memory (CUDA: max allocated; CPU: the process's max RSS so far), the step's seconds (the median of
the timed steps, the slowest rank) and the bytes a rank sends to the other stage per micro-batch:
comm's TRAFFIC `p2p_send` payload (numel x element size of every tensor the runner hands to P2P: a
Llama's hidden states [1, T / sequence, hidden] and position ids [1, T / sequence] forward, the hidden
states' gradient backward) over the timed steps, divided by the steps and the micro-batches, the most
of any rank.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from long_context import SHAPES, packed_positions  # noqa: E402

from pipezero.comm import TRAFFIC  # noqa: E402
from pipezero.pipe.schedule.registry import make_schedule  # noqa: E402

__all__ = ["Case", "Kit", "Options", "hf_config", "run_cases"]


@dataclass(frozen=True)
class Case:
    """One layout of the whole world: `rows` sequences of the options' length a step."""

    name: str
    pipe: int = 1
    sequence: int = 1
    schedule: str = "1f1b"
    rows: int = 1
    alst: bool = False          # DeepSpeed ALST at this sequence degree instead of pipezero
    length: int = 0             # tokens per sequence; 0: the options' --length

    def data(self, world: int) -> int:
        """Data ranks: what pipe x sequence leaves of the world."""
        return world // (self.pipe * self.sequence)

    def microbatches(self, world: int) -> int:
        """Rows (one per micro-batch) each data rank trains a step."""
        return self.rows // self.data(world)

    def chunks(self) -> int:
        """Chunks per rank of the schedule (2 for the V schedules)."""
        return make_schedule(self.schedule, max(4, 2 * self.pipe)).num_chunks

    def check(self, world: int, heads: int) -> None:
        """Refuse a case the world or the heads cannot hold (on every rank, before any collective)."""
        if world % (self.pipe * self.sequence) or self.rows % self.data(world) or heads % self.sequence:
            raise ValueError(f"case {self.name}: pipe {self.pipe} x sequence {self.sequence} over {world} "
                             f"processes and {self.rows} rows of {heads} heads: pipe x sequence must divide the "
                             "world, the data ranks the rows and the degree the heads; give --nproc a multiple of "
                             "pipe x sequence")


@dataclass(frozen=True)
class Kit:
    """The memory kit of every pipezero case: layers checkpointed (their inputs on the host or not), the
    optimizer on the host or not."""

    checkpoint: bool = True
    host_inputs: bool = False
    offload_optimizer: bool = False

    @property
    def label(self) -> str:
        ck = ("ck, inputs on host" if self.host_inputs else "ck") if self.checkpoint else "no ck"
        return ck + (", optimizer on host" if self.offload_optimizer else "")


@dataclass(frozen=True)
class Options:
    """What every case of one invocation shares."""

    shape: str = "tiny"
    layers: int | None = None
    length: int = 512
    steps: int = 1              # timed steps after one warm-up (0: time the warm-up step)
    kit: Kit = Kit()


def hf_config(options: Options, length: int):
    """The Llama config of the options' shape (its depth cut to --layers), for sequences of `length`."""
    from transformers import LlamaConfig

    dims = dict(SHAPES[options.shape], **({"num_hidden_layers": options.layers} if options.layers else {}))
    return LlamaConfig(**dims, max_position_embeddings=length, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def _rows(case: Case, options: Options, world: int, data_rank: int, vocab: int, device: torch.device):
    """This data rank's rows [(ids [1, T], positions [1, T])]: packed documents, random ids."""
    length = case.length or options.length
    gen = torch.Generator().manual_seed(1000 + data_rank)
    rows = []
    for _ in range(case.microbatches(world)):
        positions = packed_positions(length, gen)
        ids = torch.randint(0, vocab, (1, length), generator=gen)
        rows.append((ids.to(device), positions.to(device)))
    return rows


def _pipezero(case: Case, options: Options, config, device: torch.device, dtype: torch.dtype):
    """(step(rows), the grid) of a pipezero case: ZeRO-3 over data x sequence, AdamW, fp32 masters."""
    from pipezero.pipe import PipelineModule, PipelineRunner
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.pipe.sequence import next_token_labels, shard_batch
    from pipezero.topology import Grid
    from pipezero.zero import ZeroConfig, ZeroOptimizer

    kit = options.kit
    grid = Grid(pipe=case.pipe, sequence=case.sequence)
    schedule = make_schedule(case.schedule, case.microbatches(grid.world_size))
    recompute = RecomputeConfig(mode="full" if kit.checkpoint else "none", offload=kit.host_inputs)
    with torch.device(device):  # built in fp32 and cast, as bench/long_context.py's runs (the 8B: 48 GB at most)
        module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=grid, loss_fn=causal_lm_loss,
                                num_chunks=schedule.num_chunks, placement=schedule.placement, recompute=recompute,
                                compile=False).to(dtype)
    adamw = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=kit.offload_optimizer or None)
    opt = ZeroOptimizer(adamw, group=grid.data_sequence_group, module=module,
                        config=ZeroConfig(stage=3, offload_optimizer=kit.offload_optimizer))
    runner = PipelineRunner(module, schedule, optimizer=opt)

    def step(rows):
        ids, positions = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        inputs, labels = shard_batch((ids, None, positions), next_token_labels(ids), grid)
        runner.train_step(inputs, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, grid.data_rank


def _alst(case: Case, options: Options, config, device: torch.device, world: int):
    from long_context_alst import alst_sp_step

    step = alst_sp_step(config, device, case.sequence, case.microbatches(world), options.kit.offload_optimizer)
    return step, dist.get_rank() // case.sequence  # DeepSpeed's mpu: sequence groups of consecutive ranks


def _timed(step, rows, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(rows)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _most(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks (one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(case: Case, options: Options) -> dict:
    """Build and train one case in the running process group: its numbers (the same on every rank)."""
    from pipezero.topology.device import process_device

    world, device = dist.get_world_size(), process_device()
    config = hf_config(options, case.length or options.length)
    case.check(world, config.num_attention_heads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    step, data_rank = (_alst(case, options, config, device, world) if case.alst
                       else _pipezero(case, options, config, device, dtype))
    rows = _rows(case, options, world, data_rank, config.vocab_size, device)
    if device.type == "cuda":  # the training's peak, not the build's (pipezero builds in fp32, then casts)
        torch.cuda.reset_peak_memory_stats(device)
    TRAFFIC.reset()
    warm = _timed(step, rows, device)
    if options.steps:  # the timed steps' traffic (--steps 0: the warm-up step's)
        TRAFFIC.reset()
    times = [_timed(step, rows, device) for _ in range(options.steps)] or [warm]
    sent = TRAFFIC.snapshot().get("p2p_send", {}).get("bytes", 0) / max(options.steps, 1)
    seconds, peak, sent = _most([statistics.median(times), _peak_bytes(device), sent], device)
    tokens = case.rows * (case.length or options.length)
    return {"case": case.name, "seconds": seconds, "tokens_per_s_gpu": tokens / seconds / world,
            "peak_gb": peak / 1e9, "stage_bytes_mb": sent / case.microbatches(world) if case.pipe > 1 else None}


def run_cases(cases: list[Case], options: Options, emit=None) -> list[dict]:
    """Every case in turn in the running process group; `emit(result)` on rank 0 as each ends. Out of
    memory raises on the rank it happens on while the others wait in a collective: the launcher ends them."""
    results = []
    for case in cases:
        results.append(measure(case, options))
        if emit and dist.get_rank() == 0:
            emit(results[-1])
        gc.collect()  # the case's model, optimizer and runner, before the next one's peak
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results

