"""ZeroOptimizer stages 0-3 side by side with the optimizers a user would otherwise pick.

    python bench/zero.py                       # CPU, gloo, 2 processes, a small GPT, fp32
    python bench/zero.py --device cuda         # one process per GPU, nccl, a ~1.3B GPT, bf16
    python bench/zero.py --device cuda --nproc 1 --runs pipezero-1-offload deepspeed-1-offload
    python bench/zero.py --device cuda --nproc 1 --memory-cap-gib 16 --hidden 4096 ... \
        --runs pipezero-3-offload deepspeed-3-offload   # a model larger than the (capped) GPU

Same model, same data, same Adam for every run, one run after the other in the same processes:
  stage 0    vs DDP + Adam
  stage 1, 2 vs DDP + torch's ZeroRedundancyOptimizer(Adam)
  stage 3    vs FSDP2 (torch.distributed.fsdp.fully_shard on every block and the root)
  DeepSpeed ZeRO 1/2/3 too when `import deepspeed` works (never a dependency).
  CPU offload (asked for by name): pipezero-S-offload / deepspeed-S-offload offload the optimizer
  (stage S) and, at stage 3, the parameters; pipezero-S-offload-dpu adds the delayed parameter
  update. The offloaded Adam steps on the host (--adam fused: torch's fused CPU kernel); DeepSpeed
  steps with torch's Adam too: its `torch_adam` path by default, and with --adam fused the same
  fused Adam as pipezero's runs, given to deepspeed.initialize as the client optimizer.
Prints ms per step, the ratio to the peer (> 1: pipezero is faster) and per-rank memory:
on CPU the bytes of model state (live tensor storages after backward: parameters, gradients,
optimizer state), on CUDA the peak allocated memory (model state + activations) and the peak
resident host memory of the process during the timed steps (sampled every 20 ms).
--memory-cap-gib caps each process's GPU memory (torch.cuda.set_per_process_memory_fraction) and
builds the model on the host first, so a model larger than the cap can be offloaded.
pipezero-2 reduce-scatters every micro-batch's gradients (reduce_every_microbatch, as DeepSpeed's
ZeRO-2 does), so no whole gradient is held between micro-batches; the other runs are as configured.
Precision: CPU fp32 everywhere. CUDA: pipezero and DeepSpeed train a bf16 model with fp32
masters; DDP, ZeroRedundancyOptimizer and FSDP2 keep fp32 weights under bf16 autocast (FSDP2
with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profiling import profiled  # noqa: E402

from pipezero.zero import ZeroConfig, ZeroOptimizer  # noqa: E402


# -- the model: a GPT ---------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# -- the runs --------------------------------------------------------------------------------
class Run:
    """One way to train: a model, a step function and what to call its accumulation context."""

    def __init__(self, model, step, no_sync, zero_grad, precision, settle=lambda: None):
        self.model, self.step, self.no_sync, self.zero_grad, self.precision = \
            model, step, no_sync, zero_grad, precision
        self.settle = settle  # wait for gradient reductions still under way (for measuring memory)


ADAM = {"foreach": True}  # --adam fused: torch's fused Adam kernel for every run (CUDA)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-4, **ADAM)


def parse_run(name: str) -> tuple[str, int, bool, bool]:
    """"pipezero-3-offload-dpu" -> ("pipezero", 3, offload, delayed update); other names: stage -1."""
    bits = name.split("-")
    stage = int(bits[1]) if len(bits) > 1 and bits[1].isdigit() else -1
    return bits[0], stage, "offload" in bits, "dpu" in bits


def _model(args, device: torch.device, low: bool) -> GPT:
    """The GPT on the device; with a memory cap built on the host (and cast) first, as it may not fit twice."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    if args.memory_cap_gib and low:
        model = model.to(torch.bfloat16)
    return model.to(device)


def build(name: str, args, device: torch.device) -> Run:
    low = device.type == "cuda"
    model = _model(args, device, low)
    kind, stage, offload, delayed = parse_run(name)
    if kind == "pipezero":
        if low:
            model = model.to(torch.bfloat16)
        # stage 2 reduce-scatters every micro-batch (DeepSpeed ZeRO-2): no whole gradients between them
        cfg = ZeroConfig(stage=stage, reduce_bucket_size=args.bucket, overlap_comm=True,
                         stage3_param_persistence_threshold=10 * args.hidden, reduce_every_microbatch=stage == 2,
                         offload_optimizer=offload, offload_param=offload and stage == 3,
                         delayed_param_update=delayed)
        opt = ZeroOptimizer(_adam(model.parameters()), module=model, config=cfg)
        return Run(model, opt.step, opt.no_sync, opt.zero_grad,
                   "bf16 model, fp32 masters" if low else "fp32", settle=opt.wait_grad_sync)
    if kind == "deepspeed":
        return _deepspeed(model, stage, offload, args, low)
    policy = "fp32 weights, bf16 autocast" if low else "fp32"
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if low \
            else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        opt = _adam(model.parameters())

        def no_sync():
            return _FsdpNoSync(model)
        return Run(model, opt.step, no_sync, lambda: opt.zero_grad(set_to_none=True),
                   "fp32 weights, bf16 compute" if low else "fp32")
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, device_ids=[device.index] if low else None, bucket_cap_mb=args.bucket * 4 / 2**20)
    if name == "ddp":
        opt = _adam(ddp.parameters())
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4, **ADAM)
    return Run(ddp, opt.step, ddp.no_sync, lambda: opt.zero_grad(set_to_none=True), policy)


class _FsdpNoSync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False


def _deepspeed(model, stage, offload, args, low) -> Run:
    import deepspeed
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
              "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                    "reduce_bucket_size": args.bucket},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    if low:
        config["bf16"] = {"enabled": True}
    client = None
    if ADAM.get("fused"):  # the same fused torch Adam as pipezero's runs, as DeepSpeed's client optimizer
        del config["optimizer"]
        config["zero_force_ds_cpu_optimizer"] = False
        client = _adam(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=client,
                                      config=config)
    return Run(engine, engine.step, _NullContext, lambda: None, "bf16 model, fp32 masters" if low else "fp32")


class _NullContext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- measuring ----------------------------------------------------------------------------------
def _storages() -> dict[int, int]:
    gc.collect()
    found = {}
    with warnings.catch_warnings():  # isinstance() on some library objects warns about deprecations
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        for t in (obj, obj.grad):
            if t is not None and t.numel():
                local = t.to_local() if hasattr(t, "to_local") else t
                s = local.untyped_storage()
                found[s.data_ptr()] = s.nbytes()
    return found


def _train_step(run: Run, batches, device, low: bool) -> None:
    autocast = torch.autocast("cuda", torch.bfloat16) if low and run.precision.startswith("fp32 weights, bf16 a") \
        else _NullContext()
    engine = hasattr(run.model, "backward") and hasattr(run.model, "global_steps")
    if engine:  # DeepSpeed: backward and step every micro-batch; it divides by the accumulation itself
        for x, y in batches:
            run.model.backward(F.cross_entropy(run.model(x).float().flatten(0, 1), y.flatten()))
            run.model.step()
        return
    for i, (x, y) in enumerate(batches):
        with run.no_sync() if i < len(batches) - 1 else _NullContext(), autocast:
            logits = run.model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / len(batches)
            loss.backward()
    run.step()
    run.zero_grad()


def _batches(args, device) -> list:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device))
            for _ in range(args.accum)]


def _timed_step(run: Run, batches, device) -> float:
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    _train_step(run, batches, device, device.type == "cuda")
    _sync(device)
    return time.perf_counter() - start


def model_state_mib(name: str, args, device: torch.device) -> float:
    """CPU: bytes of the tensors a run adds (parameters, optimizer state, the grads of a backward)."""
    before = _storages()
    run, batches = build(name, args, device), _batches(args, device)
    for _ in range(2):
        _train_step(run, batches, device, False)
    loss = F.cross_entropy(run.model(batches[0][0]).flatten(0, 1), batches[0][1].flatten())
    run.model.backward(loss) if hasattr(run.model, "global_steps") else loss.backward()
    run.settle()
    after = _storages()
    del run
    gc.collect()
    return sum(n for p, n in after.items() if p not in before) / 2**20


def measure_cpu(names: list[str], args, device) -> dict:
    """Memory one run at a time; then time all runs round-robin so a busy machine slows all alike."""
    memory = {name: model_state_mib(name, args, device) for name in names}
    runs = {name: build(name, args, device) for name in names}
    batches = _batches(args, device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.steps + 2):
        for name, run in runs.items():
            t = _timed_step(run, batches, device)
            if repeat >= 2:
                times[name].append(t)
    return {name: (statistics.median(times[name]), memory[name], runs[name].precision, None) for name in names}


class HostPeak:
    """Peak resident memory of this process (VmRSS, pinned buffers included) inside the block."""

    def __enter__(self) -> "HostPeak":
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        return False


def _empty_host_cache() -> None:
    """torch keeps freed pinned host memory for reuse; give it back (a later run needs the RAM)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None)
    if empty is not None:
        empty()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_cuda(names: list[str], args, device) -> dict:
    """One run at a time (they do not fit together): median step time, peak GPU and host memory."""
    out = {}
    for name in names:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        run, batches = build(name, args, device), _batches(args, device)
        with HostPeak() as host:
            times = [_timed_step(run, batches, device) for _ in range(args.steps + 2)][2:]
        out[name] = (statistics.median(times), torch.cuda.max_memory_allocated(device) / 2**20, run.precision,
                     host.peak / 2**30)
        if args.profile:
            with profiled(args.profile, f"zero-{name}"):
                _timed_step(run, batches, device)
        del run, batches
        gc.collect()
        _empty_host_cache()  # pinned host buffers go back to the system before the next run
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- main ------------------------------------------------------------------------------------------
PEERS = {"pipezero-0": "ddp", "pipezero-1": "ddp+ZeroRedundancyOptimizer",
         "pipezero-2": "ddp+ZeroRedundancyOptimizer", "pipezero-3": "fsdp2"}


def _runs() -> list[str]:
    names = ["ddp", "pipezero-0", "ddp+ZeroRedundancyOptimizer", "pipezero-1", "pipezero-2", "fsdp2", "pipezero-3"]
    try:
        import deepspeed  # noqa: F401
        names += ["deepspeed-1", "deepspeed-2", "deepspeed-3"]
    except Exception:  # noqa: BLE001 - optional peer
        pass
    return names


OFFLOAD_RUNS = [f"{kind}-{stage}-offload{dpu}" for stage in (1, 2, 3) for kind, dpu in
                (("pipezero", ""), ("pipezero", "-dpu"), ("deepspeed", ""))]


def worker(rank: int, world: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args.memory_cap_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    measure = measure_cuda if device.type == "cuda" else measure_cpu
    ADAM.clear()
    ADAM[args.adam] = True
    results = measure(args.runs or _runs(), args, device)
    if rank == 0:
        _print(results, args, world)
    dist.destroy_process_group()


def _print(results: dict, args, world: int) -> None:
    tokens = args.batch * args.seq * args.accum * world
    mem = "peak MiB" if args.device == "cuda" else "model state MiB"
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq).parameters())
    cap = f", GPU memory capped at {args.memory_cap_gib} GiB" if args.memory_cap_gib else ""
    print(f"GPT {args.layers}x{args.hidden} ({params / 1e9:.2f}B parameters), vocab {args.vocab}, {tokens} "
          f"tokens/step, {world} ranks, {args.device}{cap}")
    print(f"| run | precision | ms/step | tokens/s | {mem} | host peak GiB | peer | speed vs peer | memory vs peer "
          f"| speed vs DeepSpeed same stage |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (sec, memory, precision, host) in results.items():
        peer = PEERS.get(name) or ("ddp+ZeroRedundancyOptimizer" if name in ("deepspeed-1", "deepspeed-2")
                                   else "fsdp2" if name == "deepspeed-3" else "")
        peer = peer if peer in results else ""
        ratio = f"{results[peer][0] / sec:.2f}" if peer else ""
        mem_ratio = f"{memory / results[peer][1]:.2f}" if peer else ""
        ds = results.get(name.replace("pipezero", "deepspeed").removesuffix("-dpu")) \
            if name.startswith("pipezero") else None
        vs_ds = f"{ds[0] / sec:.2f}" if ds else ""
        host_gib = f"{host:.1f}" if host is not None else ""
        print(f"| {name} | {precision} | {sec * 1e3:.0f} | {tokens / sec:,.0f} | {memory:,.0f} | {host_gib} | "
              f"{peer} | {ratio} | {mem_ratio} | {vs_ds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: 2, or all GPUs)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="sequences per micro-batch per rank")
    parser.add_argument("--accum", type=int, default=None, help="micro-batches per step")
    parser.add_argument("--bucket", type=int, default=None, help="elements per gradient bucket")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--adam", choices=["foreach", "fused"], default="foreach",
                        help="torch Adam implementation for every pipezero/DDP/FSDP run (fused: CUDA and CPU)")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="CUDA: cap each process's GPU memory (set_per_process_memory_fraction)")
    parser.add_argument("--runs", nargs="+", default=None, help="only these runs (names as in the table)")
    parser.add_argument("--profile", default=None, help="CUDA: folder for a profile of one more step of each run")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    known = _runs() + OFFLOAD_RUNS + ["deepspeed-1", "deepspeed-2", "deepspeed-3"]
    unknown = [n for n in args.runs or [] if n not in known]
    if unknown:
        parser.error(f"--runs {' '.join(unknown)}: unknown run; known: {' '.join(dict.fromkeys(known))}")
    # CPU: a small GPT; GPU: ~1.3B parameters, 65,536 tokens per step on 2 GPUs
    defaults = dict(layers=24, hidden=2048, heads=16, vocab=50304, seq=2048, batch=4, accum=4, bucket=50_000_000) \
        if gpu else dict(layers=4, hidden=256, heads=4, vocab=4096, seq=128, batch=4, accum=2, bucket=2_000_000)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    world = args.nproc or (torch.cuda.device_count() if gpu else 2)
    mp.spawn(worker, args=(world, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
