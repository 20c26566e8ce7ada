"""DeepSpeed's PipelineModule (1F1B, its only schedule) as a peer in bench/pipe.py (issue #5).

setup_deepspeed(args, grid, device, bounds, specs) builds DeepSpeed's pipeline on the same GPT
layers cut at exactly pipezero's `bounds` and returns a one-step function (engine.train_batch
over bench/pipe.py's batch, split into args.microbatches micro-batches).

Precision policy: on CUDA, for either --precision (autocast or bf16), DeepSpeed's own bf16 mode:
bf16 weights and activations, fp32 gradient accumulation and fp32 master weights (BF16_Optimizer,
what DeepSpeed picks for bf16 + ZeRO-1 + grad_accum_dtype fp32; its anchor policy, not autocast).
On CPU: fp32 throughout. ZeRO stage 1 (the most DeepSpeed allows with a pipeline); optimizer:
torch SGD lr 1e-4 as the other peers (no DeepSpeed op is built or loaded).

    python bench/ds_pipe.py [cuda]   # smoke test: 2 processes (gloo, or nccl on 2 GPUs), small GPT, seconds, loss
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.gpt import gpt_loss  # noqa: E402


def _pipeline_module(bounds):
    """deepspeed.pipe.PipelineModule whose partition is `bounds`, not one of its own methods."""
    from deepspeed.pipe import PipelineModule

    class FixedCut(PipelineModule):
        def _partition_layers(self, method="uniform"):
            assert len(bounds) == self.num_stages + 1 and bounds[-1] == self._num_layers, (bounds, self.num_stages)
            self.parts = list(bounds)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
    return FixedCut


def setup_deepspeed(args, grid, device, bounds, specs):
    """DeepSpeed's 1F1B pipeline on `specs` (pipezero LayerSpecs) cut at `bounds`; returns step() -> loss.

    The default process group must exist and span exactly the pipeline (data parallel 1).
    """
    import deepspeed
    from deepspeed.pipe import LayerSpec

    p = grid.pipe_size
    if len(bounds) != p + 1:
        raise ValueError(f"DeepSpeed runs one chunk per stage: bounds {bounds} for {p} stages")
    if dist.get_world_size() != p:
        raise ValueError("setup_deepspeed: pipe only, data parallel 1")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    layers = [LayerSpec(s.cls, *s.args, **s.kwargs) for s in specs]
    with device:  # build this stage's layers directly on the device
        model = _pipeline_module(bounds)(layers=layers, num_stages=p, loss_fn=gpt_loss,
                                         partition_method="uniform")  # ignored: FixedCut
    assert model.parts == list(bounds), (model.parts, bounds)
    m = args.microbatches
    if args.batch % m:
        raise ValueError(f"batch {args.batch} does not divide into {m} microbatches")
    bf16 = device.type == "cuda"
    config = {"train_batch_size": args.batch, "train_micro_batch_size_per_gpu": args.batch // m,
              "gradient_accumulation_steps": m, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True,  # torch SGD
              "bf16": {"enabled": bf16}, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if bf16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    opt = torch.optim.SGD(model.parameters(), lr=getattr(args, "lr", 1e-4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if grid.rank == 0:
        print(f"deepspeed parts {model.parts} optimizer {type(engine.optimizer).__name__}", flush=True)
    g = torch.Generator().manual_seed(0)  # bench/pipe.py's _batch
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    targets = torch.roll(ids, -1, dims=1)
    micro = list(zip(ids.chunk(m), targets.chunk(m)))

    def step():
        return engine.train_batch(data_iter=iter(micro)).item()
    return step


def _worker(rank, world, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    from bench.pipe import _specs
    from examples.gpt import GPTConfig
    from pipezero.pipe import PipelineModule
    from pipezero.topology import Grid

    grid = Grid(pipe=world)
    cfg = GPTConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                    seq_len=args.seq)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    bounds = PipelineModule(_specs(cfg), grid=grid, loss_fn=gpt_loss, partition_method="type:Block",
                            device=device).bounds  # pipezero's cut, as bench/pipe.py's setup_ours
    step = setup_deepspeed(args, grid, device, bounds, _specs(cfg))
    rows = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = step()  # .item() of the loss DeepSpeed broadcasts from the last stage: synchronising
        rows.append((time.perf_counter() - start, loss))
    if rank == 0:
        queue.put((list(bounds), rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    args = SimpleNamespace(layers=4, d_model=128, heads=4, seq=64, vocab=512, batch=16, microbatches=8, steps=6,
                           precision="autocast", lr=1e-2, device=sys.argv[1] if len(sys.argv) > 1 else "cpu")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(2, args, 29400 + os.getpid() % 1000, queue), nprocs=2, join=True)
    bounds, rows = queue.get()
    print(f"torch {torch.__version__} GPT {args.layers}x{args.d_model} seq {args.seq} vocab {args.vocab} "
          f"batch {args.batch} m={args.microbatches} p=2 {args.device} bounds {bounds} SGD lr {args.lr} (ln vocab = "
          f"{torch.log(torch.tensor(float(args.vocab))).item():.3f})")
    for i, (sec, loss) in enumerate(rows):
        print(f"step {i}: {sec:.3f} s  loss {loss:.4f}")
    print(f"median step (after the first): {statistics.median(s for s, _ in rows[1:]):.3f} s")
