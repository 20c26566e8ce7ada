"""PipelineRunner: run one rank's share of a schedule (the only part of pipe/ that talks to the network).

The schedule is data: for this rank an ordered list of actions F / B / I / W on (chunk,
microbatch), planned once with their transfers (pipe/step_plan.py). Before each action the
runner posts, in one batch, the sends the previous action produced and the receives the next
action needs (Megatron's send-forward-recv-backward pairing, Narayanan et al. 2021). Sends are
asynchronous and waited for at the end of the step (as torch.distributed.pipelining does), and
messages between two ranks are received in the order they were sent (a rank may receive an
activation early and keep it): so any schedule that is valid with buffered sends runs without
deadlock, including ZeroBubbleV and DualPipeV. Activations of adjacent virtual stages on the
same rank (the tip of a V) pass locally. An output sent to another rank keeps only its graph
once sent, when no backward node saved its values (Megatron's output deallocation;
`freed_bytes` counts them per step). Zero-bubble's I and W: pipe/split_backward.py; under a
schedule that splits backward the model's DeferringLinear layers (PipelineModule(
deferred_linear=True), the default) defer their weight GEMMs to W (pipe/deferred_linear.py).
What the runner tells the optimizer during a step is one protocol, pipe/readiness.py.
`overlap_pairs=True` (off by default) runs each pair pipe/pairs.py plans, an F beside another
microbatch's B or I (DualPipeV's steady state; 1F1B's, ZB-V's) on a rank holding expert layers, as
one step: both receives first, the two in turns through pipe/expert/relay.py (one microbatch's expert
all-to-all travels while the other computes), both sends after; the timeline names it "0F3|1B1".
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from pipezero.comm import P2P, CommTimeout, PeerLost, nvtx_range, partial_grad_group
from pipezero.pipe.schedule.actions import Op
from pipezero.pipe.batch_check import check_batch, split_batch, step_word
from pipezero.pipe.dealloc import free, freeable, saved_storages
from pipezero.pipe.deferred_linear import WeightSink, collecting, collecting_into, current_sink, has_deferring_linear
from pipezero.pipe.expert.relay import Relay
from pipezero.pipe.gathering import chunk_gatherings
from pipezero.pipe.groups import cpu_world_group, side_group
from pipezero.pipe.module import PipelineModule
from pipezero.pipe.pairs import expert_chunks, schedule_pairs
from pipezero.pipe.schedule.placement import owner
from pipezero.pipe.readiness import StepListener, loss_scaling, step_listener
from pipezero.pipe.split_backward import WeightGrad, backward_input
from pipezero.pipe.stage_errors import LayerError
from pipezero.pipe.step_plan import Message, PipelineSchedule, Step, plan_steps
from pipezero.pipe.schedule.timeline import Timeline, bubble_fraction, gather_events
from pipezero.pipe.schedule.validate import Transfer

__all__ = ["PipelineRunner", "PipelineTimeout"]


class PipelineTimeout(TimeoutError):
    """A peer never answered; the message names rank, stage, action and microbatch."""


def _check_reduces_over_data(optimizer: Any, grid: Any) -> None:
    """Refuse an optimizer that would let data replicas (or sequence shards) train apart, each on its own
    gradients: one that reduces nothing, or (with a sequence or expert axis) a listener over other ranks
    than the grid's data x expert x sequence group. Pure (the listener's ranks are its group's, known
    without a collective), so every rank raises before any collective."""
    if optimizer is None or grid.data_sequence_size == 1:
        return
    if not isinstance(optimizer, StepListener):
        axes, what = (("data axis", "data replicas") if grid.sequence_size == grid.expert_size == 1
                      else (f"{_joined(grid)} axes", "ranks"))
        raise ValueError(f"PipelineRunner(optimizer={type(optimizer).__name__}) on {grid!r}: it does not "
                         f"reduce gradients over the {axes}, so the {grid.data_sequence_size} {what} would each "
                         "step on their own gradients and drift apart; wrap it, ZeroOptimizer(optimizer, stage=0, "
                         "group=grid.data_sequence_group) averages them as DDP does (stages 1-3 shard too), or "
                         "pass optimizer=None and reduce the gradients yourself before stepping")
    if grid.sequence_size == grid.expert_size == 1:
        return
    want, got = grid.group_ranks("data_sequence"), list(optimizer.reduction_ranks())
    if got != want:
        raise ValueError(f"PipelineRunner(optimizer={type(optimizer).__name__}) on {grid!r}: it reduces "
                         f"gradients over ranks {got}, but rank {grid.rank}'s {_joined(grid)} group is {want} "
                         f"(its data group alone {grid.group_ranks('data')}): the sequence ranks hold gradients "
                         "of different slices of the same rows, the expert ranks of other rows, and the dense "
                         "parameters would step apart; build it with "
                         "group=grid.data_sequence_group, e.g. ZeroOptimizer(optimizer, stage=..., "
                         "group=grid.data_sequence_group)")


def _check_sums_partial_grads(optimizer: Any, model: PipelineModule) -> None:
    """Refuse an optimizer that reduces nothing beside parameters whose gradient on each rank is its share of a
    sum (a MoE block on each tensor rank's share of the tokens, pipe/tensor_tokens.py): they would step on
    partial gradients, as data replicas would on their own. Pure, alike on every rank of the stage."""
    if optimizer is None or isinstance(optimizer, StepListener):
        return
    partial = [p for p in model.parameters() if p.requires_grad and partial_grad_group(p) is not None]
    if partial:
        raise ValueError(f"PipelineRunner(optimizer={type(optimizer).__name__}) on {model.grid!r}: {len(partial)} "
                         "parameters of MoE blocks run on each tensor rank's share of the tokens hold that share "
                         "of their gradients, which the optimizer's reduction sums over the tensor ranks once a "
                         "step, and it reduces nothing; wrap it, ZeroOptimizer(torch.optim.SGD(expert_param_groups("
                         "module, grid)), stage=0, group=grid.data_sequence_group), or pass optimizer=None and sum "
                         "them over comm.partial_grad_group(p) yourself before stepping")


def _check_overlap_pairs(overlap_pairs: Any, model: PipelineModule) -> None:
    """overlap_pairs is a bool; not beside compiled layers. Pure, alike on every rank."""
    if not isinstance(overlap_pairs, bool):
        raise TypeError(f"PipelineRunner(overlap_pairs={overlap_pairs!r}): expected True or False")
    if overlap_pairs and model.compile_config is not None:
        raise ValueError(f"PipelineRunner(overlap_pairs=True) beside compiled layers (PipelineModule(compile="
                         f"{model.compile_config!r})): a recompile inside a pair would trace autograd while the "
                         "pair's backward holds autograd's device thread (pipe/expert/relay.py); build the "
                         'module with compile=False (ds_config "compile": {"enabled": false}), or leave '
                         "overlap_pairs off")


def _paired_steps(schedule: PipelineSchedule, model: PipelineModule, steps: Sequence[Step]) -> frozenset[int]:
    """The steps i this rank runs as a pair with i + 1 (pipe/pairs.py): those of the plan where either chunk
    holds expert layers over more than one rank (nothing to hide elsewhere; the forward's launch lets a
    backward without experts run whole while its rows travel)."""
    experts = expert_chunks(model)
    planned = schedule_pairs(schedule, model.num_stages)[model.grid.pipe_rank]
    return frozenset(i for i in planned if {steps[i].action.chunk, steps[i + 1].action.chunk} & experts)


def _units(count: int, pairs: frozenset[int]) -> list[tuple[int, ...]]:
    """Step indices as the loop runs them: one step, or a pair (i, i + 1) for i in `pairs`."""
    units, i = [], 0
    while i < count:
        units.append((i, i + 1) if i in pairs else (i,))
        i += len(units[-1])
    return units


def _joined(grid: Any) -> str:
    """"data x expert x sequence" with the axes above 1 of those after data."""
    return " x ".join(["data"] + ["expert"] * (grid.expert_size > 1) + ["sequence"] * (grid.sequence_size > 1))


class PipelineRunner:
    """Executes a schedule on a PipelineModule: train_step (forward + backward), eval_step (forward).

    Does not call optimizer.step(): the user does, after train_step returns (tied-weight
    gradients are already summed then). With a data or sequence degree > 1 pass an optimizer that
    reduces gradients over grid.data_sequence_group (ZeroOptimizer; stage 0 behaves like DDP; any other
    is refused, its replicas would drift apart) or None (you reduce them): the
    link of its chain that is a StepListener (pipe/readiness.py) hears when gradients are
    final, so reductions overlap the pipeline's cool-down, and when each chunk's parameters
    are needed (ZeRO-3, pipe/gathering.py); `reshard_after_forward` says whether a chunk is
    needed through the step (False) or done with whenever another chunk runs.
    Transfer metadata (shapes, dtypes) is sent again when the inputs' shapes change;
    `variable_shapes=True` sends it every step (inner shapes that change on their own).
    `overlap_pairs=True`: neighbouring F / B pairs (DualPipeV's steady state, and 1F1B's, ZB-V's) in
    turns, each one's expert all-to-all behind the other's compute (pipe/pairs.py; a no-op without
    expert layers over more than one rank; `pairs` lists the paired step indices); refused beside
    compiled layers.
    """

    def __init__(self, model: PipelineModule, schedule: PipelineSchedule, optimizer: torch.optim.Optimizer | None = None,
                 timeout_s: float = 300.0, variable_shapes: bool = False, reshard_after_forward: bool = False,
                 overlap_pairs: bool = False):
        plan = plan_steps(schedule, model)  # checks and validates it: the same error on every rank
        _check_overlap_pairs(overlap_pairs, model)
        _check_reduces_over_data(optimizer, model.grid)
        _check_sums_partial_grads(optimizer, model)
        self.model, self.schedule, self.optimizer = model, schedule, optimizer
        self._listener = step_listener(optimizer)
        self._scale = loss_scaling(optimizer)
        self.grid = model.grid
        self.num_microbatches = schedule.num_microbatches
        self.timeout_s, self.variable_shapes = timeout_s, variable_shapes
        self.steps, self.forward_steps, self._release_plan = plan
        self.last_pipe_rank = owner(model.num_virtual_stages - 1, model.num_stages, model.placement)[0]
        self.timeline = Timeline(self.grid.rank, model.device)
        self._p2p: P2P | None = None
        self._p2ps: dict[bool, P2P] = {}  # train / eval: streams differ in requires_grad
        self._side_group = side_group(self.grid)
        self._check_group = cpu_world_group()
        self._train_steps = 0  # train_step calls so far: the step-start check compares them over the ranks
        self._signature: int | None = None
        self._gathering = chunk_gatherings(self._listener, model, {True: [s.action.chunk for s in self.steps],
                                           False: [s.action.chunk for s in self.forward_steps]}, reshard_after_forward)
        self._listener.attach_pipeline()
        # under a schedule that splits some backward, every forward defers its Linear weight GEMMs (W
        # runs them, or B right after its backward): a layer compiled both ways would have two graphs,
        # and torch's checkpoint recompute may pick the other one than its forward ran (CheckpointError)
        split = any(s.action.op is Op.BACKWARD_INPUT for s in self.steps)
        self._split = {s.action[1:] for s in self.steps if s.action.op is Op.FORWARD} \
            if split and has_deferring_linear(model) else set()
        self.pairs = _paired_steps(schedule, model, self.steps) if overlap_pairs else frozenset()
        self._relay = Relay(kept=[(current_sink, collecting_into)])  # each side its own collecting sink

    # -- public --------------------------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """Forward and backward of every microbatch; returns the mean loss on every rank."""
        if self.model.loss_fn is None:
            raise ValueError("train_step needs PipelineModule(loss_fn=...) to compute the loss")
        self._start(inputs, targets, need_targets=True)
        tied = self.model.tied_parameters()
        self._listener.hold_grad_sync(list(self.model.parameters()), tied)
        aside = self.model.set_aside_tied_grads()
        try:
            self._run(self.steps, train=True)
        except BaseException:
            self.model.sum_tied_grads(aside, reduce=False)  # what was set aside back; no collective on failure
            raise
        if self.model.sum_tied_grads(aside, sums=self._listener.tied_grad_sums(tied)):  # final only now
            self._listener.release_grad_sync(tied)
            self._listener.flush_grad_sync(tied)
        self._listener.step_done()
        return self._mean_loss()

    @torch.no_grad()
    def eval_step(self, inputs: Any = None, targets: Any = None) -> Any:
        """Forward only. With targets: the mean loss on every rank; without: the last stage's
        outputs (concatenated along dim 0) on the last-stage rank, None elsewhere."""
        with_loss = self._start(inputs, targets, need_targets=False)
        self._run(self.forward_steps, train=False, with_loss=with_loss)
        self._listener.step_done()
        if with_loss:
            return self._mean_loss()
        if self.grid.pipe_rank != self.last_pipe_rank:
            return None
        outs = [self._outputs[mb] for mb in range(self.num_microbatches)]
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs)
        return tuple(torch.cat(parts) for parts in zip(*outs))

    def measured_bubble(self) -> float:
        """Idle share of the last step over the pipeline ranks (a collective on grid.pipe_group)."""
        return bubble_fraction(gather_events(self.timeline.events, self.grid.pipe_group))

    # -- step setup ------------------------------------------------------------------------
    def _start(self, inputs: Any, targets: Any, need_targets: bool) -> bool:
        """Check the batch on every rank (one small all-reduce), split it, reset the step state."""
        m, model = self.num_microbatches, self.model
        first = any(model.is_first(c) for c in range(model.num_chunks))
        last = any(model.is_last(c) for c in range(model.num_chunks))
        self._train_steps += int(need_targets)  # train_step needs targets, eval_step does not
        view = check_batch(inputs, targets, m, need_targets, first=first, last=last, group=self._check_group,
                           step=step_word(self._train_steps, train=need_targets))
        self._new_p2p_if_shapes_changed(view.signature, need_targets, bool(view.listed))
        self._inputs = split_batch(inputs, m, model.device) if first else None
        self._targets = split_batch(targets, m, model.device) if last and targets is not None else None
        self._received: dict[Message, Any] = {}                   # arrived (or handed over locally)
        self._saved: dict[tuple[int, int], tuple] = {}            # (chunk, microbatch) -> F's input, output, sink
        self._deferred: dict[tuple[int, int], WeightGrad] = {}    # (chunk, microbatch) -> W's work, kept by I
        self._losses: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, Any] = {}
        self._sent_outputs: list[torch.Tensor] = []
        self.freed_bytes = 0  # activation bytes freed right after sending, this step
        self.timeline.begin()
        return view.no_targets == 0

    def _new_p2p_if_shapes_changed(self, signature: int, train: bool, listed: bool = False) -> None:
        """Stream metadata is cached per shape signature and mode; new shapes start new streams.
        Variable shapes (or a batch given as a list of microbatches): each transfer carries its dims."""
        variable = self.variable_shapes or listed
        if signature != self._signature or variable:
            self._p2ps, self._signature = {}, signature
        if train not in self._p2ps:
            self._p2ps[train] = P2P(self.grid.pipe_group, side_group=self._side_group, timeout_s=self.timeout_s,
                                     device=self.model.device, variable_shapes=variable)
        self._p2p = self._p2ps[train]

    # -- the loop ---------------------------------------------------------------------------
    def _run(self, steps: Sequence[Step], train: bool, with_loss: bool = True) -> None:
        sends: list = []
        last_use = self._release_plan if train else {}
        gathering = self._gathering[train]
        units = _units(len(steps), self.pairs if train else frozenset())  # (i,), or (i, i + 1): a pair
        for n, unit in enumerate(units):
            step, recvs = steps[unit[0]], tuple(t for i in unit for t in steps[i].recvs)
            if sends or recvs:
                self._exchange(sends, recvs, step)
            following = [t for i in units[n + 1] for t in steps[i].recvs] if n + 1 < len(units) else []
            if following:  # gloo: the next inputs arrive while this computes
                self._p2p.post_early([(self.grid.rank_of(pipe=t.src), Message.of(t).stream) for t in following])
            releases = [last_use[i] for i in unit if last_use.get(i)]
            for release in releases:  # gradients final after this step (pipe/readiness.py)
                self._listener.release_grad_sync(release)
            for i in unit:
                gathering.before(i)
            name = "|".join(str(steps[i].action) for i in unit)
            with self.timeline.span(name, "compute"), nvtx_range(name):
                sends = self._do(step, train, with_loss) if len(unit) == 1 else self._pair(step, steps[unit[1]])
            for release in releases:
                self._listener.flush_grad_sync(release)
            for i in unit:
                gathering.after(i)
        if sends:
            self._exchange(sends, (), steps[-1])
        try:
            with self.timeline.span("wait", "comm"):
                self._p2p.drain()
        except PeerLost as e:
            raise PeerLost(f"rank {self.grid.rank} (pipe stage {self.grid.pipe_rank}), after the last action "
                           f"{steps[-1].action}: {e}") from e
        except CommTimeout as e:
            raise PipelineTimeout(f"rank {self.grid.rank} (pipe stage {self.grid.pipe_rank}): sends of this step "
                                  f"never completed after the last action {steps[-1].action}: {e}") from e

    def _exchange(self, sends: list[tuple[Transfer, Any]], recvs: Sequence[Transfer], step: Step) -> None:
        peer = self.grid.rank_of
        out = [(peer(pipe=t.dst), Message.of(t).stream, tensors) for t, tensors in sends]
        ins = [(peer(pipe=t.src), Message.of(t).stream) for t in recvs]
        try:
            with self.timeline.span("wait", "comm"):
                got = self._p2p.exchange(out, ins)
        except PeerLost as e:
            a = step.action
            raise PeerLost(f"rank {self.grid.rank} (pipe stage {self.grid.pipe_rank}) at action {a} (microbatch "
                           f"{a.microbatch}): {e}") from e
        except CommTimeout as e:
            a = step.action
            raise PipelineTimeout(
                f"rank {self.grid.rank} (pipe stage {self.grid.pipe_rank}) timed out around action {a} "
                f"({a.op.name} of chunk {a.chunk}, virtual stage {step.stage}, microbatch {a.microbatch}); "
                f"a peer never answered (set the pipeline timeout with ds_config pipeline.timeout or "
                f"PipelineRunner(timeout_s=)): {e}") from e
        for t, tensors in zip(recvs, got):
            self._received[Message.of(t)] = tensors[0] if len(tensors) == 1 else tensors
        self.freed_bytes += free(self._sent_outputs)  # posted: their values may go (pipe/dealloc.py)
        self._sent_outputs = []

    def _do(self, step: Step, train: bool, with_loss: bool) -> list:
        op = step.action.op
        if op is Op.FORWARD:
            return self._forward(step, train, with_loss)
        if op is Op.BACKWARD_WEIGHT:
            if self._deferred.pop(step.action[1:]).run():  # assigned .grad without hooks: tell the optimizer
                self._listener.collect_grad_sync(self.model.chunk_parameters(step.action.chunk))
            return []
        return self._backward(step, keep_graph=op is Op.BACKWARD_INPUT)

    def _pair(self, forward: Step, backward: Step) -> list:
        """A forward and another microbatch's backward (B, or a split one's I) in turns, switching at each
        expert all-to-all launch (pipe/expert/relay.py): one's rows travel while the other's layers compute."""
        split = backward.action.op is Op.BACKWARD_INPUT
        sent = self._relay.run(lambda: self._forward(forward, True, True),
                               lambda: self._backward(backward, keep_graph=split))
        return sent[0] + sent[1]

    def _forward(self, step: Step, train: bool, with_loss: bool) -> list:
        _, chunk, mb = step.action
        model, s = self.model, step.stage
        x = self._inputs[mb] if model.is_first(chunk) else self._received.pop(Message("activation", s - 1, mb))
        sink = WeightSink() if train and (chunk, mb) in self._split else None
        with saved_storages(train and step.send is not None) as saved, self._where(step), collecting(sink):
            out = model(x, chunk=chunk)
        if model.is_last(chunk):
            if with_loss:
                with self._where(step):
                    loss = model.loss(out, self._targets[mb])
                self._losses[mb] = loss.detach()
                out = loss
            else:
                self._outputs[mb] = out
        if train:
            self._saved[(chunk, mb)] = (x, out, sink)
        if step.send:
            self._sent_outputs += [t for t in _tensors(out) if freeable(t, saved)]
            return [(step.send, out)]
        if not model.is_last(chunk):  # the next virtual stage is on this rank
            self._received[Message("activation", s, mb)] = _detached(out)
        return []

    @contextmanager
    def _where(self, step: Step) -> Iterator[None]:
        """Prefix a layer's error with this rank, stage and microbatch."""
        try:
            yield
        except LayerError as err:
            a = step.action
            raise LayerError(f"rank {self.grid.rank} (pipe stage {self.grid.pipe_rank}, virtual stage {step.stage}, "
                             f"microbatch {a.microbatch}): {err}") from err.__cause__

    def _backward(self, step: Step, keep_graph: bool) -> list:
        _, chunk, mb = step.action
        model, s = self.model, step.stage
        x, out, sink = self._saved.pop((chunk, mb))
        if model.is_last(chunk):
            outs, grads = [self._scale(out / self.num_microbatches)], [None]
        else:
            got = self._received.pop(Message("gradient", s + 1, mb))
            outs, grads = [t for t in _tensors(out) if t.requires_grad], list(_tensors(got))
            if len(grads) != len(outs):
                raise RuntimeError(f"{step.action}: {len(outs)} outputs need gradients but {len(grads)} arrived")
        leaves = [t for t in _tensors(x) if t.requires_grad]
        if keep_graph:
            weights = [p for p in model.chunk_parameters(chunk) if p.requires_grad]
            whole = model.recompute.enabled  # a graph split would recompute the chunk once per backward call
            in_grads, self._deferred[(chunk, mb)] = backward_input(outs, grads, leaves, weights, sink, whole)
        else:
            with collecting(sink):  # a checkpointed layer's forward re-runs as it first ran
                torch.autograd.backward(outs, grads)
            in_grads = [t.grad for t in leaves]
            if sink is not None and sink.apply():  # the deferred GEMMs, now: assigned .grad without hooks
                self._listener.collect_grad_sync(self.model.chunk_parameters(chunk))
        in_grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, in_grads))
        if model.is_first(chunk):
            return []
        if step.send:
            return [(step.send, in_grads)]
        self._received[Message("gradient", s, mb)] = in_grads[0] if len(in_grads) == 1 else in_grads
        return []

    # -- the loss ---------------------------------------------------------------------------
    def _mean_loss(self) -> torch.Tensor:
        """Mean over microbatches and data x sequence ranks (a sequence shard's loss is its share times
        the degree: pipe/sequence/loss.py), broadcast from the last stage over the pipe."""
        loss = torch.zeros((), dtype=torch.float32, device=self.model.device)
        if self.grid.pipe_rank == self.last_pipe_rank:
            loss = torch.stack([self._losses[mb].float() for mb in range(self.num_microbatches)]).mean()
            if self.grid.data_sequence_size > 1:
                dist.all_reduce(loss, group=self.grid.data_sequence_group)
                loss /= self.grid.data_sequence_size
        if self.grid.pipe_size > 1:
            dist.broadcast(loss, src=self.grid.rank_of(pipe=self.last_pipe_rank), group=self.grid.pipe_group)
        return loss


# -- helpers ---------------------------------------------------------------------------
def _tensors(x: Any) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(t for t in x if isinstance(t, torch.Tensor))


def _detached(x: Any) -> Any:
    """A same-rank hand-off: a new graph leaf per tensor, as if it had come over the network."""
    cut = lambda t: t.detach().requires_grad_(t.requires_grad)  # noqa: E731
    return cut(x) if isinstance(x, torch.Tensor) else tuple(cut(t) for t in x)

