"""PipelineRunner: run one rank's share of a schedule (the only part of pipe/ that talks to the network).

The schedule is data: for this rank an ordered list of actions F / B / I / W on (chunk,
microbatch). Before each action the runner posts, in one batch, the sends the previous
action produced and the receives the next action needs (Megatron's send-forward-recv-backward
pairing, Narayanan et al. 2021). Sends are asynchronous and waited for at the end of the
step (as torch.distributed.pipelining does), and messages between two ranks are received in
the order they were sent (a rank may receive an activation early and keep it): so any schedule
that is valid with buffered sends runs without deadlock, including ZeroBubbleV and DualPipeV.
Activations of adjacent virtual stages on the same rank (the tip of a V) pass locally.
An output sent to another rank keeps only its graph once sent, when no backward node saved
its values (Megatron's output deallocation; `freed_bytes` counts them per step).

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split B into I
(input gradient) and W (weight gradient). I uses torch's pipelining helper
stage_backward_input, which keeps the gradients at the weight-using nodes; W then computes
only the weight gradients from them (stage_backward_weight). On the first stage (its inputs
need no gradient) I is empty and W is the whole backward. Without those helpers (a private
torch module) W re-runs the retained graph's backward: exact, at one more backward-input.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

from pipezero.comm import P2P, CommTimeout, PeerLost, is_peer_lost, nvtx_range, peer_lost
from pipezero.pipe.actions import Action, Op
from pipezero.pipe.batch_check import ABSENT, NO_TARGETS, SIGNATURE, batch_words, raise_batch_errors
from pipezero.pipe.dealloc import free, freeable, saved_storages
from pipezero.pipe.groups import cpu_world_group, side_group
from pipezero.pipe.module import PipelineModule
from pipezero.pipe.placement import owner, virtual_stage
from pipezero.pipe.stage_errors import LayerError
from pipezero.pipe.timeline import Timeline, bubble_fraction, gather_events
from pipezero.pipe.validate import validate

__all__ = ["PipelineRunner", "PipelineTimeout"]

try:  # torch's split backward (private, present in torch 2.11-2.13); else W re-runs the backward
    from torch.distributed.pipelining._backward import stage_backward_input as _stage_backward_input
    from torch.distributed.pipelining._backward import stage_backward_weight as _stage_backward_weight
except ImportError:  # pragma: no cover
    _stage_backward_input = _stage_backward_weight = None

class PipelineTimeout(TimeoutError):
    """A peer never answered; the message names rank, stage, action and microbatch."""


class _Step(NamedTuple):
    action: Action
    stage: int                      # virtual stage of the action's chunk
    need: tuple[int, str] | None    # (pipe rank, stream key) the action's input comes from
    send: tuple[int, str] | None    # (pipe rank, stream key) to send after it
    recvs: tuple = ()               # (pipe rank, key, microbatch) to receive first, in the sender's order


class PipelineRunner:
    """Executes a schedule on a PipelineModule: train_step (forward + backward), eval_step (forward).

    Does not call optimizer.step(): the user does, after train_step returns (tied-weight
    gradients are already summed then). With a data degree > 1 pass an optimizer that
    reduces gradients over grid.data_group (ZeroOptimizer; stage 0 behaves like DDP); the
    runner drives its readiness hooks (hold / release / flush) so reductions overlap the
    pipeline's cool-down.
    """

    def __init__(self, model: PipelineModule, schedule: Any, optimizer: Any = None,
                 timeout_s: float = 300.0, variable_shapes: bool = False):
        _check_schedule(model, schedule, optimizer)
        self.model, self.schedule, self.optimizer = model, schedule, optimizer
        self.grid = model.grid
        self.num_microbatches = schedule.num_microbatches
        self.timeout_s, self.variable_shapes = timeout_s, variable_shapes
        actions = schedule.actions(model.num_stages)
        self.steps = _plan_all(actions, model)[self.grid.pipe_rank]
        forward_only = {r: [a for a in acts if a.op is Op.FORWARD] for r, acts in actions.items()}
        self.forward_steps = _plan_all(forward_only, model)[self.grid.pipe_rank]
        self.last_pipe_rank = owner(model.num_virtual_stages - 1, model.num_stages, model.placement)[0]
        self.timeline = Timeline(self.grid.rank, model.device)
        self._release_plan = _last_weight_use(self.steps, model)
        self._p2p: P2P | None = None
        self._p2ps: dict[bool, P2P] = {}  # train / eval: streams differ in requires_grad
        self._side_group = side_group(self.grid)
        self._check_group = cpu_world_group()
        self._signature: int | None = None

    # -- public --------------------------------------------------------------------------
    def train_step(self, inputs: Any = None, targets: Any = None) -> torch.Tensor:
        """Forward and backward of every microbatch; returns the mean loss on every rank."""
        if self.model.loss_fn is None:
            raise ValueError("train_step needs PipelineModule(loss_fn=...) to compute the loss")
        self._start(inputs, targets, need_targets=True)
        self._hold()
        self.model.detach_tied()
        try:
            self._run(self.steps, train=True)
        except BaseException:
            self.model.reduce_tied_grads(reduce=False)  # put the weights back; no collective on failure
            raise
        tied = self.model.reduce_tied_grads()
        self._release(tied)
        return self._mean_loss()

    @torch.no_grad()
    def eval_step(self, inputs: Any = None, targets: Any = None) -> Any:
        """Forward only. With targets: the mean loss on every rank; without: the last stage's
        outputs (concatenated along dim 0) on the last-stage rank, None elsewhere."""
        with_loss = self._start(inputs, targets, need_targets=False)
        self._run(self.forward_steps, train=False, with_loss=with_loss)
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
        holds_first = any(model.is_first(c) for c in range(model.num_chunks))
        holds_last = any(model.is_last(c) for c in range(model.num_chunks))
        wants_targets = holds_last and (need_targets or targets is not None)
        words = batch_words(inputs if holds_first else ABSENT, targets if wants_targets else ABSENT, m)
        words[NO_TARGETS] = int(holds_last and targets is None)
        flags = torch.tensor(words, dtype=torch.int64)
        # on the CPU (no wait for the GPU's queued work); MAX: a flag set anywhere, and [max, -min] pairs
        start = time.monotonic()
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._check_group)
        except RuntimeError as e:
            if is_peer_lost(e):
                raise peer_lost(e, "the step-start batch check", start) from e
            raise
        flags = flags.tolist()
        raise_batch_errors(flags, words, m, need_targets)
        self._new_p2p_if_shapes_changed(flags[SIGNATURE], need_targets)
        self._inputs = _split(inputs, m, model.device) if holds_first else None
        self._targets = _split(targets, m, model.device) if holds_last and targets is not None else None
        self._received: dict[tuple[str, int], Any] = {}
        self._stash: dict[tuple[int, int], Any] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, Any] = {}
        self._sent_outputs: list[torch.Tensor] = []
        self.freed_bytes = 0  # activation bytes freed right after sending, this step
        self.timeline.begin()
        return flags[NO_TARGETS] == 0

    def _new_p2p_if_shapes_changed(self, signature: int, train: bool) -> None:
        """Stream metadata is cached per shape signature and mode; new shapes start new streams."""
        if signature != self._signature or self.variable_shapes:
            self._p2ps, self._signature = {}, signature
        if train not in self._p2ps:
            self._p2ps[train] = P2P(self.grid.pipe_group, side_group=self._side_group, timeout_s=self.timeout_s,
                                     device=self.model.device)
        self._p2p = self._p2ps[train]

    # -- the loop ---------------------------------------------------------------------------
    def _run(self, steps: Sequence[_Step], train: bool, with_loss: bool = True) -> None:
        sends: list = []
        last_use = self._release_plan if train else {}
        for i, step in enumerate(steps):
            if sends or step.recvs:
                self._exchange(sends, step.recvs, step)
            if i + 1 < len(steps) and steps[i + 1].recvs:  # gloo: the next inputs arrive while this computes
                self._p2p.post_early([(self.grid.rank_of(pipe=p), key) for p, key, _ in steps[i + 1].recvs])
            release = last_use.get(i)
            if release:
                self._release(release, flush=False)
            with self.timeline.span(str(step.action), "compute"), nvtx_range(step.action):
                sends = self._do(step, train, with_loss)
            if release:
                self._flush(release)
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

    def _exchange(self, sends: list, recvs: Sequence[tuple[int, str, int]], step: _Step) -> None:
        peer = self.grid.rank_of
        out = [(peer(pipe=p), key, tensors) for p, key, tensors in sends]
        ins = [(peer(pipe=p), key) for p, key, _ in recvs]
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
        for (_, key, mb), tensors in zip(recvs, got):
            self._received[(key, mb)] = tensors[0] if len(tensors) == 1 else tensors
        self.freed_bytes += free(self._sent_outputs)  # posted: their values may go (pipe/dealloc.py)
        self._sent_outputs = []

    def _do(self, step: _Step, train: bool, with_loss: bool) -> list:
        op = step.action.op
        if op is Op.FORWARD:
            return self._forward(step, train, with_loss)
        if op is Op.BACKWARD_WEIGHT:
            kind, *saved = self._stash.pop(("w", *step.action[1:]))
            if kind == "split":
                _stage_backward_weight(*saved)  # assigns .grad without autograd hooks: tell the optimizer
                collect = getattr(self.optimizer, "collect_grad_sync", None)
                if collect is not None:
                    collect(self.model.chunk_parameters(step.action.chunk))
            else:
                torch.autograd.backward(*saved)
            return []
        return self._backward(step, keep_graph=op is Op.BACKWARD_INPUT)

    def _forward(self, step: _Step, train: bool, with_loss: bool) -> list:
        _, chunk, mb = step.action
        model, s = self.model, step.stage
        if model.is_first(chunk):
            x = self._inputs[mb]
        else:
            x = self._take(f"a{s - 1}", mb, step)
        with saved_storages(train and step.send is not None) as saved, self._where(step):
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
            self._stash[(chunk, mb)] = (x, out)
        if step.send:
            self._sent_outputs += [t for t in _tensors(out) if freeable(t, saved)]
            return [(step.send[0], step.send[1], out)]
        if not model.is_last(chunk):  # the next virtual stage is on this rank
            self._received[(f"a{s}", mb)] = _detached(out)
        return []

    @contextmanager
    def _where(self, step: _Step) -> Iterator[None]:
        """Prefix a layer's error with this rank, stage and microbatch."""
        try:
            yield
        except LayerError as err:
            a = step.action
            raise LayerError(f"rank {self.grid.rank} (pipe stage {self.grid.pipe_rank}, virtual stage {step.stage}, "
                             f"microbatch {a.microbatch}): {err}") from err.__cause__

    def _backward(self, step: _Step, keep_graph: bool) -> list:
        _, chunk, mb = step.action
        model, s = self.model, step.stage
        x, out = self._stash.pop((chunk, mb))
        if model.is_last(chunk):
            loss = out / self.num_microbatches
            scale = getattr(self.optimizer, "scale", None)
            outs, grads = [scale(loss) if scale is not None else loss], [None]
        else:
            got = self._take(f"g{s + 1}", mb, step)
            got = (got,) if isinstance(got, torch.Tensor) else tuple(got)
            outs = [t for t in _tensors(out) if t.requires_grad]
            grads = list(got)
            if len(grads) != len(outs):
                raise RuntimeError(f"{step.action}: {len(outs)} outputs need gradients but {len(grads)} arrived")
        leaves = [t for t in _tensors(x) if t.requires_grad]
        if keep_graph:
            in_grads = self._backward_input(chunk, mb, outs, grads, leaves)
        else:
            torch.autograd.backward(outs, grads)
            in_grads = [t.grad for t in leaves]
        in_grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, in_grads))
        if model.is_first(chunk):
            return []
        if step.send:
            return [(step.send[0], step.send[1], in_grads)]
        self._received[(f"g{s}", mb)] = in_grads[0] if len(in_grads) == 1 else in_grads
        return []

    def _backward_input(self, chunk: int, mb: int, outs: list, grads: list, leaves: list) -> Sequence:
        """I: the input gradient now; what W needs is kept.

        With torch's pipelining helpers (stage_backward_input / stage_backward_weight) W later
        computes only the weight gradients from the intermediate gradients I saved; on the
        first stage (no input gradient) W is the whole backward; without the helpers W re-runs it.
        """
        if not leaves:
            self._stash[("w", chunk, mb)] = ("full", outs, grads)
            return ()
        if _stage_backward_input is not None:
            weights = [p for p in self.model.chunk_parameters(chunk) if p.requires_grad]
            in_grads, groups = _stage_backward_input(outs, None if grads == [None] else grads, leaves, iter(weights))
            self._stash[("w", chunk, mb)] = ("split", iter(weights), groups)
            return in_grads
        self._stash[("w", chunk, mb)] = ("full", outs, grads)
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

    def _take(self, key: str, mb: int, step: _Step) -> Any:
        try:
            return self._received.pop((key, mb))
        except KeyError:
            raise ValueError(f"schedule error on pipe rank {self.grid.pipe_rank}: action {step.action} runs "
                             f"before its input {key!r} of microbatch {mb} exists; check the action order "
                             "(validate the schedule)") from None

    # -- gradient readiness (protocol 3) and loss ------------------------------------------
    def _hold(self) -> None:
        hold = getattr(self.optimizer, "hold_grad_sync", None)
        if hold is not None:
            hold(list(self.model.parameters()))

    def _release(self, params: list, flush: bool = True) -> None:
        release = getattr(self.optimizer, "release_grad_sync", None)
        if release is not None and params:
            release(params)
            if flush:
                self._flush(params)

    def _flush(self, params: list) -> None:
        flush = getattr(self.optimizer, "flush_grad_sync", None)
        if flush is not None:
            flush(params)

    def _mean_loss(self) -> torch.Tensor:
        """Mean over microbatches (and data replicas), broadcast from the last stage over the pipe."""
        loss = torch.zeros((), dtype=torch.float32, device=self.model.device)
        if self.grid.pipe_rank == self.last_pipe_rank:
            loss = torch.stack([self._losses[mb].float() for mb in range(self.num_microbatches)]).mean()
            if self.grid.data_size > 1:
                dist.all_reduce(loss, group=self.grid.data_group)
                loss /= self.grid.data_size
        if self.grid.pipe_size > 1:
            dist.broadcast(loss, src=self.grid.rank_of(pipe=self.last_pipe_rank), group=self.grid.pipe_group)
        return loss


# -- static plan of the schedule ----------------------------------------------------------------
def _plan_all(actions: dict[int, list[Action]], model: PipelineModule) -> dict[int, list[_Step]]:
    """Every rank's steps with their transfers.

    Transfers between two ranks must be received in the order they were sent (nccl matches
    point-to-point operations by order), so a rank that needs a message receives first every
    earlier message of that sender it has not received yet (ZeroBubbleV needs this).
    """
    p, chunks = model.num_stages, model.num_chunks
    if sorted(actions) != list(range(p)):
        raise ValueError(f"schedule.actions({p}) returned ranks {sorted(actions)}; expected 0..{p - 1}")
    plans, sent = {}, {}
    for rank in range(p):
        plans[rank] = []
        for action in actions[rank]:
            if not isinstance(action, Action) or not 0 <= action.chunk < chunks:
                raise ValueError(f"rank {rank}: {action!r} is not an Action on a chunk in 0..{chunks - 1}")
            step = _step(action, rank, model)
            plans[rank].append(step)
            if step.send:
                sent.setdefault((rank, step.send[0]), []).append((step.send[1], action.microbatch))
    for rank in range(p):
        taken = {src: 0 for src, dst in sent if dst == rank}
        for i, step in enumerate(plans[rank]):
            if step.need:
                plans[rank][i] = step._replace(recvs=_take_until(sent, taken, step, rank))
        for src, count in taken.items():
            if count != len(sent[(src, rank)]):
                raise ValueError(f"schedule: rank {src} sends {_seq(sent[(src, rank)][count:])} to rank {rank}, "
                                 "which never uses them")
    return plans


def _take_until(sent: dict, taken: dict, step: _Step, rank: int) -> tuple:
    src, key = step.need
    seq, start = sent.get((src, rank), []), taken.get(src, 0)
    want = (key, step.action.microbatch)
    if want in seq[:start]:
        return ()
    if want not in seq[start:]:
        raise ValueError(f"schedule: rank {rank} runs {step.action}, which needs {key}/mb{want[1]} from rank "
                         f"{src}, but rank {src} never sends it; every forward needs its predecessor's forward "
                         "and every backward its successor's backward")
    end = seq.index(want, start) + 1
    taken[src] = end
    return tuple((src, k, mb) for k, mb in seq[start:end])


def _step(action: Action, rank: int, model: PipelineModule) -> _Step:
    p, v, placement = model.num_stages, model.num_virtual_stages, model.placement
    s = virtual_stage(rank, action.chunk, p, placement)
    prev_rank = owner(s - 1, p, placement)[0] if s > 0 else None
    next_rank = owner(s + 1, p, placement)[0] if s < v - 1 else None
    remote = lambda r: r is not None and r != rank  # noqa: E731
    if action.op is Op.FORWARD:
        return _Step(action, s, (prev_rank, f"a{s - 1}") if remote(prev_rank) else None,
                     (next_rank, f"a{s}") if remote(next_rank) else None)
    if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        return _Step(action, s, (next_rank, f"g{s + 1}") if remote(next_rank) else None,
                     (prev_rank, f"g{s}") if remote(prev_rank) else None)
    return _Step(action, s, None, None)


def _seq(items: list) -> str:
    text = ", ".join(f"{k}/mb{mb}" for k, mb in items[:8])
    return f"[{text}{', ...' if len(items) > 8 else ''}]"


def _last_weight_use(steps: Sequence[_Step], model: PipelineModule) -> dict[int, list]:
    """Step index -> the (untied) parameters whose last gradient contribution that step makes.

    A parameter's gradient is final after the last B (or W, when backward is split) of the
    last chunk using it; that is when the optimizer may start reducing it.
    """
    weight_ops = (Op.BACKWARD, Op.BACKWARD_WEIGHT)
    last_of_chunk = {s.action.chunk: i for i, s in enumerate(steps) if s.action.op in weight_ops}
    tied = {id(t) for t in model.tied_parameters()}
    final: dict[int, tuple[int, Any]] = {}
    for chunk, index in last_of_chunk.items():
        for param in model.chunk_parameters(chunk):
            if id(param) not in tied and index >= final.get(id(param), (-1, None))[0]:
                final[id(param)] = (index, param)
    out: dict[int, list] = {}
    for index, param in final.values():
        out.setdefault(index, []).append(param)
    return out


# -- checks and batch helpers ------------------------------------------------------------
def _check_schedule(model: PipelineModule, schedule: Any, optimizer: Any) -> None:
    if not isinstance(model, PipelineModule):
        raise TypeError(f"PipelineRunner(model={type(model).__name__}): expected a PipelineModule")
    for attr in ("num_microbatches", "actions"):
        if not hasattr(schedule, attr):
            raise TypeError(f"PipelineRunner: schedule {schedule!r} has no {attr!r}; expected an object with "
                            "num_microbatches, num_chunks, placement and actions(num_stages)")
    m = schedule.num_microbatches
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"schedule.num_microbatches={m!r}: expected a positive integer")
    chunks = getattr(schedule, "num_chunks", 1)
    if chunks != model.num_chunks:
        raise ValueError(f"{type(schedule).__name__} runs {chunks} chunks per rank but "
                         f"PipelineModule(num_chunks={model.num_chunks}); make them equal")
    placement = getattr(schedule, "placement", "looped")
    if placement != model.placement:
        raise ValueError(f"{type(schedule).__name__} places chunks {placement!r} but "
                         f"PipelineModule(placement={model.placement!r}); make them equal")
    validate(schedule, model.num_stages, num_microbatches=m)  # a ScheduleError (bad cells marked) on every rank
    if getattr(optimizer, "stage", None) == 3:
        raise ValueError("PipelineRunner does not run ZeRO stage 3 (it would gather every chunk's parameters "
                         "once per microbatch); use ZeroOptimizer(stage=2), which keeps full weights per stage")


def _tensors(x: Any) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(t for t in x if isinstance(t, torch.Tensor))


def _detached(x: Any) -> Any:
    """A same-rank hand-off: a new graph leaf per tensor, as if it had come over the network."""
    cut = lambda t: t.detach().requires_grad_(t.requires_grad)  # noqa: E731
    return cut(x) if isinstance(x, torch.Tensor) else tuple(cut(t) for t in x)


def _split(batch: Any, m: int, device: torch.device) -> list:
    if isinstance(batch, torch.Tensor):
        return list(batch.to(device).chunk(m))
    parts = [t.to(device).chunk(m) if isinstance(t, torch.Tensor) else [t] * m for t in batch]
    return [tuple(p[i] for p in parts) for i in range(m)]
