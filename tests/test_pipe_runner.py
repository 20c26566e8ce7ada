"""A tiny tied-embedding language model, as layer specs and as its plain single-process truth.

The pipeline tests build the first through PipelineModule and compare against the second,
which is written with plain PyTorch only (the same per-layer seeds: layer i under seed + i).
Stages pass a tuple (hidden, mask) where mask is an int64 tensor that needs no gradient.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.pipe.spec import LayerSpec, TiedLayerSpec

VOCAB, WIDTH, SEQ = 16, 8, 4


class Block(nn.Module):
    """A residual tanh MLP on (hidden, mask)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        h, mask = x
        return h + torch.tanh(self.lin(h)) * mask.unsqueeze(-1).to(h.dtype), mask


def embed(module, ids):
    return module(ids), (ids % 3 != 0).long()


def head(module, x):
    return x[0] @ module.weight.t()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def specs(num_blocks: int) -> list:
    return ([TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=embed)]
            + [LayerSpec(Block, WIDTH) for _ in range(num_blocks)]
            + [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=head)])


class Reference(nn.Module):
    """The same model in one process, parameter names as PipelineModule gives them."""

    def __init__(self, num_blocks: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed + 0)
        self.tied = nn.ModuleDict({"embed": nn.Embedding(VOCAB, WIDTH)})
        blocks = {}
        for i in range(1, num_blocks + 1):
            torch.manual_seed(seed + i)
            blocks[str(i)] = Block(WIDTH)
        self.layers = nn.ModuleDict(blocks)

    def forward(self, ids):
        emb = self.tied["embed"]
        x = (emb(ids), (ids % 3 != 0).long())
        for block in self.layers.values():
            x = block(x)
        return x[0] @ emb.weight.t()


def batch(step: int, size: int, seq: int = SEQ):
    """Deterministic token ids and targets for one step."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (size, seq), generator=g)
    targets = torch.randint(0, VOCAB, (size, seq), generator=g)
    return ids, targets


def reference_run(num_blocks: int, steps: int, size: int, lr: float, optim: str = "sgd", seqs=None):
    """Losses per step and final parameters of the single-process truth."""
    model = Reference(num_blocks)
    opt = (torch.optim.SGD if optim == "sgd" else torch.optim.Adam)(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids, targets = batch(step, size, seqs[step] if seqs else SEQ)
        loss = loss_fn(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


# -- the distributed side -------------------------------------------------------------------
import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import run  # noqa: E402
from pipezero.pipe.schedule.actions import Action, Op  # noqa: E402
from pipezero.pipe.module import PipelineModule  # noqa: E402
from pipezero.pipe.runner import PipelineRunner  # noqa: E402
from pipezero.topology import Grid  # noqa: E402


class HandGPipe:
    """A user's hand-written schedule: any object with these attributes is accepted."""

    num_chunks, placement, split_backward = 1, "looped", False

    def __init__(self, num_microbatches):
        self.num_microbatches = num_microbatches

    def actions(self, num_stages):
        m = self.num_microbatches
        return {r: [Action(Op.FORWARD, 0, i) for i in range(m)] + [Action(Op.BACKWARD, 0, i) for i in range(m)]
                for r in range(num_stages)}


def make_schedule(name, m):
    from pipezero.pipe.schedule import schedules

    if name == "HandGPipe":
        return HandGPipe(m)
    return getattr(schedules, name)(num_microbatches=m)


def train_pipeline(pipe, name, m, num_blocks, steps, size, lr, optim="sgd", ckpt=0, seqs=None):
    """Train on every rank; return (losses, {global name: param}) of this rank."""
    grid = Grid(pipe=pipe)
    sched = make_schedule(name, m)
    model = PipelineModule(specs(num_blocks), grid=grid, loss_fn=loss_fn, num_chunks=sched.num_chunks,
                           placement=sched.placement, activation_checkpoint_interval=ckpt)
    opt = (torch.optim.SGD if optim == "sgd" else torch.optim.Adam)(model.parameters(), lr=lr)
    replica, replicas = grid.data_rank, grid.data_size
    runner = PipelineRunner(model, sched, optimizer=opt if replicas == 1 else None)  # data 2: reduced by hand
    losses = []
    for step in range(steps):
        ids, targets = batch(step, size, seqs[step] if seqs else SEQ)
        share = size // replicas
        ids, targets = ids[replica * share:(replica + 1) * share], targets[replica * share:(replica + 1) * share]
        loss = runner.train_step(ids if grid.is_first_stage else None, targets)
        if replicas > 1:  # plain data parallelism by hand (no reducing optimizer in this test)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=grid.data_group)
                p.grad /= replicas
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_parity(results, num_blocks, steps, size, lr, optim="sgd", seqs=None):
    ref_losses, ref_params = reference_run(num_blocks, steps, size, lr, optim, seqs)
    seen = set()
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-5, atol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(ref_params), set(ref_params) ^ seen


@pytest.mark.parametrize("world, pipe, name, m, blocks", [
    (2, 2, "HandGPipe", 2, 2),
    (2, 2, "GPipe", 4, 2),
    (2, 2, "OneFOneB", 4, 3),
    (4, 4, "OneFOneB", 8, 4),
    (4, 2, "OneFOneB", 4, 2),          # pipe 2 x data 2
    (2, 2, "Interleaved1F1B", 4, 4),
    (4, 4, "Interleaved1F1B", 4, 8),
    (2, 2, "ZeroBubbleH1", 4, 2),
    (4, 4, "ZeroBubbleH1", 4, 4),
    (2, 2, "ZeroBubbleV", 4, 2),
    (4, 2, "ZeroBubbleV", 4, 4),       # pipe 2 x data 2, V placement (embedding and head on rank 0)
    (4, 4, "ZeroBubbleV", 8, 8),
    (2, 2, "DualPipeV", 4, 4),
    (4, 4, "DualPipeV", 8, 8),
    (8, 4, "OneFOneB", 4, 4),          # pipe 4 x data 2, once
])
def test_parity_with_single_process(world, pipe, name, m, blocks):
    steps, size, lr = 3, 8, 0.5
    results = run(train_pipeline, world, pipe, name, m, blocks, steps, size, lr, timeout=120)
    assert_parity(results, blocks, steps, size, lr)


# -- features on top of the schedules -----------------------------------------------------------
class Scaled:
    """A minimal loss-scaling wrapper (pipe/readiness.py's LossScaling): the runner must backpropagate scale(loss)."""

    def __init__(self, inner, factor):
        self.inner, self.factor, self.scaled = inner, factor, 0

    def scale(self, loss):
        self.scaled += 1
        return loss * self.factor

    def step(self):
        for group in self.inner.param_groups:
            for p in group["params"]:
                p.grad /= self.factor
        self.inner.step()

    def zero_grad(self):
        self.inner.zero_grad()


def train_features(pipe, name, m, blocks, steps, size, lr, optim, ckpt, seqs, wrap):
    """Activation checkpointing, Adam, a loss-scaling wrapper or ZeroOptimizer, variable lengths."""
    grid = Grid(pipe=pipe)
    sched = make_schedule(name, m)
    model = PipelineModule(specs(blocks), grid=grid, loss_fn=loss_fn, num_chunks=sched.num_chunks,
                           placement=sched.placement, activation_checkpoint_interval=ckpt)
    inner = (torch.optim.SGD if optim == "sgd" else torch.optim.Adam)(model.parameters(), lr=lr)
    if wrap == "scaled":
        opt = Scaled(inner, 8.0)
    elif wrap.startswith("zero"):
        from pipezero.zero import ZeroOptimizer
        opt = ZeroOptimizer(inner, stage=int(wrap[-1]), group=grid.data_group)
    else:
        opt = inner
    runner = PipelineRunner(model, sched, optimizer=opt)
    losses, share = [], size // grid.data_size
    for step in range(steps):
        ids, targets = batch(step, size, seqs[step])
        mine = slice(grid.data_rank * share, (grid.data_rank + 1) * share)
        losses.append(runner.train_step(ids[mine], targets[mine]).item())
        opt.step()
        opt.zero_grad()
    if wrap == "scaled":
        last = any(model.is_last(c) for c in range(model.num_chunks))
        assert opt.scaled == (steps * m if last else 0), opt.scaled
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world, pipe, name, m, optim, ckpt, wrap", [
    (2, 2, "OneFOneB", 4, "adam", 1, "scaled"),       # Adam, checkpoint every layer, loss scaling
    (2, 2, "ZeroBubbleV", 4, "sgd", 2, "none"),       # checkpointing under the I/W split
    (4, 2, "Interleaved1F1B", 4, "sgd", 0, "zero1"),  # ZeroOptimizer stage 1 reduces over data
    (4, 2, "ZeroBubbleH1", 4, "adam", 0, "zero2"),    # stage 2: reduce-scatter overlapping the pipeline
])
def test_parity_features(world, pipe, name, m, optim, ckpt, wrap):
    steps, size, blocks = 3, 8, 4
    lr = 0.5 if optim == "sgd" else 0.01
    seqs = [4, 6, 3]  # variable sequence length between steps
    results = run(train_features, world, pipe, name, m, blocks, steps, size, lr, optim, ckpt, seqs, wrap,
                  timeout=120)
    assert_parity(results, blocks, steps, size, lr, optim, seqs)


# -- eval, timeline, errors ----------------------------------------------------------------------
def eval_and_trace(pipe, name, m, blocks, size, path):
    from pipezero.pipe.schedule.timeline import chrome_trace, gather_events

    grid = Grid(pipe=pipe)
    sched = make_schedule(name, m)
    model = PipelineModule(specs(blocks), grid=grid, loss_fn=loss_fn, num_chunks=sched.num_chunks,
                           placement=sched.placement)
    runner = PipelineRunner(model, sched)
    ids, targets = batch(0, size)
    loss = runner.eval_step(ids, targets).item()
    logits = runner.eval_step(ids)
    grads = [p.grad for p in model.parameters()]
    train_loss = runner.train_step(ids, targets).item()
    events = gather_events(runner.timeline.events, grid.pipe_group)
    chrome_trace(events, path)
    names = sorted(e.name for e in runner.timeline.events if e.kind == "compute")
    return dict(loss=loss, logits=logits, no_grads=all(g is None for g in grads), train_loss=train_loss,
                bubble=runner.measured_bubble(), names=names,
                expected=sorted(str(a) for a in sched.actions(pipe)[grid.pipe_rank]))


def test_eval_step_and_timeline(tmp_path):
    import json

    path = str(tmp_path / "trace.json")
    out = run(eval_and_trace, 2, 2, "ZeroBubbleV", 4, 2, 8, path)
    ids, targets = batch(0, 8)
    with torch.no_grad():
        ref = Reference(2)(ids)
    for o in out:
        torch.testing.assert_close(torch.tensor(o["loss"]), loss_fn(ref, targets), rtol=1e-5, atol=1e-5)
        assert o["no_grads"] and o["train_loss"] == pytest.approx(o["loss"], rel=1e-6)
        assert o["names"] == o["expected"]  # one compute event per action of the schedule
        assert 0.0 < o["bubble"] < 1.0
    assert out[1]["logits"] is None  # V placement: the last virtual stage is on rank 0
    torch.testing.assert_close(out[0]["logits"], ref, rtol=1e-5, atol=1e-5)
    trace = json.load(open(path))["traceEvents"]
    assert {e["tid"] for e in trace} == {0, 1} and sum(e.get("cat") == "compute" for e in trace) == 2 * 24


def test_chrome_trace_has_a_memory_counter_where_events_carry_memory():
    from pipezero.pipe.schedule.timeline import Event, chrome_trace

    events = [Event("0F0", "compute", 0, 1.0, 1.002, memory=3 * 2**29), Event("wait", "comm", 1, 1.0, 1.001)]
    counters = [e for e in chrome_trace(events)["traceEvents"] if e["ph"] == "C"]
    assert counters == [{"name": "memory rank 0", "ph": "C", "pid": 0, "ts": pytest.approx(2000.0),
                         "args": {"GiB": 1.5}}]  # none for rank 1: CPU events carry no memory


def silent_peer(timeout_s):
    from pipezero.pipe.runner import PipelineTimeout

    grid = Grid(pipe=2)
    model = PipelineModule(specs(2), grid=grid, loss_fn=loss_fn)
    runner = PipelineRunner(model, make_schedule("OneFOneB", 2), timeout_s=timeout_s)
    ids, targets = batch(0, 4)
    if grid.pipe_rank == 1:  # joins the batch check, then never answers
        runner._start(None, targets, need_targets=True)
        return None
    try:
        runner.train_step(ids, None)
    except PipelineTimeout as e:
        return str(e)
    return "no timeout"


def test_silent_peer_times_out_with_a_clear_message():
    message = run(silent_peer, 2, 1.0, discard=True)[0]  # a gloo timeout closes the connection
    assert "rank 0 (pipe stage 0) timed out around action 0B0" in message, message
    assert "virtual stage 0, microbatch 0" in message and "from rank 1" in message, message


def bad_runner(case):
    grid = {"replicas": Grid(pipe=1), "experts": Grid(pipe=1, expert=2)}.get(case) or Grid(pipe=2)
    chunks = 2 if case == "chunks" else 1
    model = PipelineModule(specs(2), grid=grid, loss_fn=loss_fn, num_chunks=chunks)
    ids, targets = batch(0, 8)
    try:
        if case == "chunks":
            PipelineRunner(model, make_schedule("OneFOneB", 4))
        elif case == "batch":
            PipelineRunner(model, make_schedule("GPipe", 3)).train_step(ids, targets)
        elif case == "targets":
            PipelineRunner(model, make_schedule("GPipe", 2)).train_step(ids, None)
        elif case == "order":
            sched = HandGPipe(2)
            sched.actions = lambda p: {0: [Action(Op.FORWARD, 0, 0), Action(Op.BACKWARD, 0, 0)],
                                       1: HandGPipe(2).actions(2)[1]}  # rank 0 forgets microbatch 1
            PipelineRunner(model, sched)
        elif case == "replicas":  # data 2 with an optimizer that reduces nothing: the replicas would drift
            PipelineRunner(model, make_schedule("OneFOneB", 2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        elif case == "experts":  # dense ZeRO over the data axis alone: the expert ranks' rows would drift apart
            from pipezero.zero import ZeroOptimizer
            opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=0, group=grid.data_group)
            PipelineRunner(model, make_schedule("OneFOneB", 2), optimizer=opt)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("case, message", [
    ("chunks", "OneFOneB runs 1 chunks per rank but PipelineModule(num_chunks=2)"),
    ("batch", "batch dimension (8) does not split into num_microbatches=3"),
    ("targets", "the last pipeline stage got targets=None"),
    ("order", "rank 0 never runs 0F1 (chunk 0, microbatch 1)"),
    ("replicas", "PipelineRunner(optimizer=SGD) on Grid(pipe=1, data=2, tensor=1): it does not reduce gradients "
                 "over the data axis, so the 2 data replicas would each step on their own gradients"),
    ("experts", "on Grid(pipe=1, data=1, expert=2, tensor=1): it reduces gradients over ranks"),
    ("experts", "'s data x expert group is [0, 1]"),
])
def test_bad_runner_input_raises_on_every_rank(case, message):
    messages = run(bad_runner, 2, case)
    assert all(m is not None and message in m for m in messages), messages


class Recorder:
    """Records the readiness protocol (pipe/readiness.py) the runner drives, around a plain SGD."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def reduction_ranks(self):
        return ()

    def attach_pipeline(self):
        pass

    def need_params(self, params, upcoming=()):
        pass

    def done_with_params(self, params):
        pass

    def step_done(self):
        pass

    def collect_grad_sync(self, params):
        pass

    def hold_grad_sync(self, params, tied=()):
        self.calls.append(("hold", {id(p) for p in params}))

    def release_grad_sync(self, params):
        self.calls.append(("release", {id(p) for p in params}, [_snapshot(p) for p in params]))

    def flush_grad_sync(self, params):
        self.calls.append(("flush", {id(p) for p in params}, [_snapshot(p) for p in params]))

    def tied_grad_sums(self, tied):
        return {}


def _snapshot(p):
    return None if p.grad is None else p.grad.clone()


def readiness(name, m):
    grid = Grid(pipe=2)
    sched = make_schedule(name, m)
    model = PipelineModule(specs(4), grid=grid, loss_fn=loss_fn, num_chunks=sched.num_chunks,
                           placement=sched.placement)
    opt = Recorder(torch.optim.SGD(model.parameters(), lr=0.1))
    runner = PipelineRunner(model, sched, optimizer=opt)
    ids, targets = batch(0, 8)
    runner.train_step(ids, targets)
    every = {id(p) for p in model.parameters()}
    tied = {id(p) for p in model.tied_parameters()}
    kinds = [c[0] for c in opt.calls]
    assert kinds[0] == "hold" and opt.calls[0][1] == every
    released = [c[1] for c in opt.calls if c[0] == "release"]
    flushed = [c[1] for c in opt.calls if c[0] == "flush"]
    assert released == flushed and kinds[1:] == ["release", "flush"] * len(released), kinds
    assert set().union(*released) == every and sum(len(r) for r in released) == len(every)  # each once
    if tied:  # tied weights come last, after their gradients were summed over the owners
        assert released[-1] == tied and all(g is not None for g in opt.calls[-1][2])
    # untied parameters are released just before the backward that completes their gradient:
    # between release and flush their gradients change (the last microbatch's share arrives)
    pairs = [(a, b) for a, b in zip(opt.calls[1::2], opt.calls[2::2]) if a[1] != tied]
    assert pairs
    for (_, _, before), (_, _, after) in pairs:
        assert all(g is not None for g in after)
        assert any(b is None or not torch.equal(b, a) for b, a in zip(before, after))
    return len(released)


@pytest.mark.parametrize("name", ["OneFOneB", "ZeroBubbleV"])
def test_readiness_protocol(name):
    counts = run(readiness, 2, name, 4)
    assert all(c >= 1 for c in counts)


def _freeing(ends_with_tanh: bool):
    """pipe 2, stage 0 ends with tanh (its output saved for backward) or with a Linear (not
    saved): gradients equal one process's, and the bytes freed after sending on rank 0."""
    torch.manual_seed(0)
    middle = torch.tanh if ends_with_tanh else nn.Linear(WIDTH, WIDTH)
    layers = [nn.Linear(WIDTH, WIDTH), middle, nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)]
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    h = x
    for layer in layers:
        h = layer(h)
    F.mse_loss(h, y).backward()
    params = [p for layer in layers if isinstance(layer, nn.Module) for p in layer.parameters()]
    truth = {id(p): p.grad.clone() for p in params}
    for p in params:
        p.grad = None
    grid = Grid(pipe=2)
    model = PipelineModule(layers, grid=grid, loss_fn=F.mse_loss, partition_method="uniform")
    runner = PipelineRunner(model, make_schedule("OneFOneB", 4))
    runner.train_step(x if grid.is_first_stage else None, y)
    for p in model.parameters():
        torch.testing.assert_close(p.grad, truth[id(p)], rtol=1e-5, atol=1e-6)
    return runner.freed_bytes


def test_sent_outputs_are_freed_unless_backward_saved_them():
    """Megatron's output deallocation: a sent activation no backward node reads is dropped
    (8 x WIDTH fp32 over 4 microbatches); tanh's output, which its backward reads, is kept."""
    assert run(_freeing, 2, False)[0] == 8 * WIDTH * 4
    assert run(_freeing, 2, True)[0] == 0


def _outputs_alive_after_step(name):
    """Weak references to every layer output of this rank's chunks; how many outlive a step.
    Each stage has a tanh inside, whose backward saves its output."""
    import gc
    import weakref

    torch.manual_seed(0)
    layers = [layer for _ in range(4) for layer in (nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))]
    grid = Grid(pipe=2)
    sched = make_schedule(name, 4)
    model = PipelineModule(layers, grid=grid, loss_fn=F.mse_loss, partition_method="uniform",
                           num_chunks=sched.num_chunks, placement=sched.placement)
    runner = PipelineRunner(model, sched)
    refs = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Tanh)):
            module.register_forward_hook(lambda mod, args, out: refs.append(weakref.ref(out)))
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    runner.train_step(x if grid.is_first_stage else None, torch.zeros(8, WIDTH))
    gc.collect()
    return len(refs), sum(r() is not None for r in refs)


@pytest.mark.parametrize("name", ["ZeroBubbleV", "OneFOneB"])
def test_no_activation_outlives_its_step(name):
    """Watching sends for output deallocation must not keep graphs alive: a saved-tensor hook
    that returns the tensor itself ties a saved output (tanh's) to its own grad_fn, a cycle
    through C++ that nothing frees once a split backward (I, then W) retained the graph."""
    for seen, alive in run(_outputs_alive_after_step, 2, name):
        assert seen > 0 and alive == 0
