"""Expert parallelism (pipe/expert/) equals one process: tiny MoEs, their experts split over an expert group.

Four gloo ranks, each a data replica of the dense layers with its own rows of the batch:
Qwen3-MoE at pipe 1 with expert 4 (each rank one of the four experts; the experts' reduction group
is one rank) and expert 2 x data 2 (each pair of ranks splits the experts, each expert held by two
ranks whose gradients are summed), under ZeRO 1, 2 and 3; at pipe 2 x expert 2, Mixtral and
DeepSeek-V3 (shared experts, a dense first layer) under 1F1B (DeepSeek-V3 at ZeRO-1 and ZeRO-3),
Mixtral under ZB-V (split backward; the final norm and the head on different stages: the
load-balancing term crosses a boundary), gpt-oss under 1F1B, OLMoE under DualPipeV (four microbatches a rank, its F/B
pairs and split backwards) and DeepSeek-V3 under DualPipeV at ZeRO-3 (the V puts the embedding, the
dense first layer and the head on pipe rank 0, which holds no experts). Eight ranks: Qwen3-MoE at
pipe 2 x expert 4 (data 1, each rank one expert) under ZB-V at ZeRO-3. One row a microbatch.
With a sequence axis (each rank one slice of every row, Ulysses attention, the routers' sums added
over the slices): Qwen3-MoE at expert 2 x sequence 2 (the ranks holding the same experts are the
two sequence ranks) under ZeRO-1 and ZeRO-3, at expert 1 x sequence 2 x data 2 (the experts' group
one rank, the same experts on all four), Mixtral at pipe 2 x expert 2 x sequence 2 under ZB-V (eight ranks),
and build() with sequence_parallel_size 2 beside expert_parallel.
The groups come from Grid(expert=E, sequence=S): its expert axis (E consecutive ranks of the old
data axis) splits the experts, its data x sequence ranks hold the same experts. One optimizer,
ZeroOptimizer(LossScaler(SGD, clipping on)) over data x expert x sequence, takes expert_param_groups: the
experts reduce and shard over their own data x sequence group (zero/reduction.py).
The truth is transformers' model on the whole batch, one row a microbatch
(output_router_logits=True: the load-balancing loss too), its gradients clipped by torch's own
clip_grad_norm_ to half their norm: the loss and, through one SGD step of rate 1, every clipped
gradient by Hugging Face name (an expert's on the rank holding it), fp32; hf_state_dict gathers
every expert whole. An inf in one expert's gradient on one rank skips the step on every rank.
build() from a ds_config with expert_parallel trains the same (Adam). A param group's own reduction group
keeps its mean over two backwards before a step, at ZeRO 0-3 (a plain two-layer model). A parameter of an
experts module with no slice per expert (no shipped family has one: a tiny block here) stays whole and is
reduced with the dense parameters (over the expert group's data ranks only before, short by the expert degree);
written at expert 2, a checkpoint loads it and the experts at expert 4 as they were.
With the overlap on (pipe/expert/overlap.py: each layer's tokens in two halves, each half's all-to-alls in
flight while the other's experts compute), the same truth: Qwen3-MoE at expert 2 x data 2 under ZeRO-3 and,
its layers compiled (aot_eager), ZeRO-2; Mixtral at pipe 2 x expert 2 under ZB-V; build() with ds_config's
"overlap" at expert 2 x sequence 2; OLMoE at pipe 2 x expert 2 under DualPipeV with every layer
checkpointed (its all-to-alls made again in backward: counted), and Qwen3-MoE at ZeRO-3 checkpointed
without the overlap. On a small block, the overlap's output and gradients equal the serial path's (fp32,
1e-6 of each tensor's largest entry) and its events are recorded (dist.all_to_all_single and Work.wait
wrapped): one counts exchange, both halves' rows launched before the first wait, and an exchange in
flight whenever experts compute, forward and backward; it fails with a wait right after each launch, or
after each launch in backward only.
"""

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from test_hf_router import _adam_updates, _batch, _clipped_to_half, _model, _targets, _truth  # noqa: E402

WORLD = 4


def _expert_step(max_norm: float, family: str, expert: int, pipe: int, zero_stage: int, schedule: str,
                 microbatches: int, sequence: int = 1, overlap: bool = False, compiled: bool = False,
                 pairs: bool = False, recompute: str | None = None) -> tuple:
    """One step at pipe x data x expert x sequence = the world, one row per microbatch: the loss, each parameter's
    gradient by Hugging Face name, and which experts this rank holds. The groups are the Grid's; the asserts
    check them against the layout. overlap: the all-to-alls in two halves (pipe/expert/overlap.py); compiled:
    each decoder layer traced by torch.compile (aot_eager); pairs: PipelineRunner(overlap_pairs=True); recompute:
    PipelineModule's activation checkpointing ("full": each layer's forward again in backward)."""
    import torch.distributed as dist

    from pipezero.pipe import DualPipeV, OneFOneB, PipelineModule, PipelineRunner, ZeroBubbleV
    from pipezero.pipe.compile import CompileConfig
    from pipezero.pipe.expert import expert_param_groups, expert_parameters, shard_experts
    from pipezero.precision import LossScaler
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs, hf_state_dict
    from pipezero.pipe.hf.layers import _HFLayer
    from pipezero.pipe.sequence import shard_batch, whole_positions
    from pipezero.topology import Grid
    from pipezero.zero import ZeroOptimizer, gathered

    grid = Grid(pipe=pipe, expert=expert, sequence=sequence)  # data x expert x sequence = world / pipe
    expert_group, same_experts = grid.expert_group, grid.expert_data_group
    world = dist.get_world_size()
    replicas = world // pipe  # the dense parameters' replicas
    first = grid.pipe_rank * replicas  # ranks that split the experts, then those that hold the same ones
    local = grid.rank - first
    data, e, s = local // (expert * sequence), local // sequence % expert, local % sequence  # sequence fastest
    assert dist.get_process_group_ranks(expert_group) == [first + (data * expert + i) * sequence + s
                                                          for i in range(expert)]
    datas = replicas // (expert * sequence)  # the same experts: every data and sequence rank at expert index e
    assert dist.get_process_group_ranks(same_experts) == sorted(
        first + (d * expert + e) * sequence + t for d in range(datas) for t in range(sequence))
    assert grid.group_ranks("data_sequence") == list(range(first, first + replicas))
    v = schedule != "1f1b"  # ZB-V and DualPipeV: two chunks per rank in a V
    module = PipelineModule(hf_layer_specs(_model(family)), grid=grid, loss_fn=causal_lm_loss,
                            partition_method="uniform", num_chunks=2 if v else 1, placement="v" if v else "looped",
                            compile=CompileConfig(backend="aot_eager") if compiled else False, recompute=recompute)
    shard_experts(module, expert_group, overlap=overlap)  # none on a rank of dense layers only (DeepSeek-V3's first)
    experts = expert_parameters(module)
    assert all(p.shape[0] == 4 // expert for p in experts)  # this rank's experts only
    before = {n: p.detach().clone() for layer in module.modules() if isinstance(layer, _HFLayer)
              for n, p in layer.hf_parameters()}
    scaler = LossScaler(torch.optim.SGD(expert_param_groups(module, grid), lr=1.0), init_scale=1.0, dynamic=False,
                        clip_grad_norm=max_norm)
    opt = ZeroOptimizer(scaler, stage=zero_stage, group=grid.data_sequence_group,
                        module=module if zero_stage == 3 else None)
    kind = {"1f1b": OneFOneB, "zbv": ZeroBubbleV, "dualpipev": DualPipeV}[schedule]
    runner = PipelineRunner(module, kind(num_microbatches=microbatches), optimizer=opt, overlap_pairs=pairs)
    assert pairs or not runner.pairs
    ids, mask, labels = _batch(True, replicas // sequence * microbatches)
    rows = slice(grid.data_expert_rank * microbatches, (grid.data_expert_rank + 1) * microbatches)
    batch = (ids[rows], mask[rows]), _targets(labels)[rows]
    if sequence > 1:  # the whole rows' positions, then this rank's slice of each row
        batch = shard_batch((*batch[0], whole_positions(ids[rows])), batch[1], grid)
    real, made = dist.all_to_all_single, []
    dist.all_to_all_single = lambda *args, **kwargs: made.append(1) or real(*args, **kwargs)
    try:
        loss = runner.train_step(*batch)
    finally:
        dist.all_to_all_single = real
    assert opt.step() is not False
    if zero_stage == 1 and pipe == 1:  # an inf in one expert's gradient, on one rank: every rank skips
        hook = experts[0].register_hook(lambda g: g * float("inf")) if grid.rank == world - 1 else None
        opt.zero_grad()
        runner.train_step(*batch)
        assert opt.step() is False and scaler.skipped_steps == 1
        if hook is not None:
            hook.remove()
    held = grid.expert_rank
    assert held == dist.get_rank(expert_group)
    part = held * 4 // expert, (held + 1) * 4 // expert  # this rank's experts
    with gathered(opt) if zero_stage == 3 else contextlib.nullcontext():
        after = {n: p.detach().clone() for layer in module.modules() if isinstance(layer, _HFLayer)
                 for n, p in layer.hf_parameters()}
        whole = {n: t for n, t in hf_state_dict(module).items() if ".experts." in n}  # gathered over the group
    return loss, {n: before[n] - after[n] for n in after}, part, whole, len(made)


CASES = [("qwen3_moe", 4, 1, 1, "1f1b", 1), ("qwen3_moe", 4, 1, 3, "1f1b", 1), ("qwen3_moe", 2, 1, 2, "1f1b", 1),
         ("qwen3_moe", 2, 1, 3, "1f1b", 1), ("mixtral", 2, 2, 1, "1f1b", 2), ("deepseek_v3", 2, 2, 1, "1f1b", 2),
         ("mixtral", 2, 2, 1, "zbv", 2), ("olmoe", 2, 2, 1, "dualpipev", 4), ("deepseek_v3", 2, 2, 3, "1f1b", 2),
         ("deepseek_v3", 2, 2, 3, "dualpipev", 4), ("qwen3_moe", 2, 1, 1, "1f1b", 2, 2),
         ("qwen3_moe", 2, 1, 3, "1f1b", 2, 2), ("qwen3_moe", 1, 1, 1, "1f1b", 2, 2),
         ("gpt_oss", 2, 2, 1, "1f1b", 2)]
# family, expert, pipe, ZeRO stage (dense and expert parameters), schedule, microbatches per rank (one row each)
# [, sequence: each row split in that many slices, one a rank]
OVERLAP = [(("qwen3_moe", 2, 1, 3, "1f1b", 1), False), (("mixtral", 2, 2, 1, "zbv", 2), False),
           (("qwen3_moe", 2, 1, 2, "1f1b", 1), True)]  # overlap on: (case, compiled)
RECOMPUTED = [(("qwen3_moe", 2, 1, 3, "1f1b", 1), False), (("olmoe", 2, 2, 1, "dualpipev", 4), True)]  # (case, overlap)
STEPS = [(case, {}) for case in CASES] + [(case, dict(overlap=True, compiled=c)) for case, c in OVERLAP] + \
    [(case, dict(overlap=o, recompute="full")) for case, o in RECOMPUTED]
WIDE = [("qwen3_moe", 4, 2, 3, "zbv", 2),  # the same at world 8: expert 4 x pipe 2 (data 1)
        ("mixtral", 2, 2, 1, "zbv", 2, 2)]  # pipe 2 x expert 2 x sequence 2 under ZB-V: the sums cross a stage


def _rows(case: tuple, world: int) -> int:
    """The rows of the whole batch: one per microbatch of each data x expert rank."""
    return world // case[2] // (case[6] if len(case) > 6 else 1) * case[5]


def _clipped(family: str, rows: int) -> tuple[torch.Tensor, dict, float]:
    """transformers' loss and gradients (one microbatch per row), the gradients clipped by
    torch.nn.utils.clip_grad_norm_ to half their global norm, and that max norm."""
    loss, grads = _truth(family, True, rows, rows)
    return (loss, *_clipped_to_half(family, grads))


# build() from a ds_config with DeepSpeed's expert_parallel section: Adam whose eps (1e3) dwarfs every
# gradient steps each parameter by lr * g / (|g| + eps), near g at lr = eps: the update shows the gradient
BUILT = dict(family="qwen3_moe", expert=2, stage=2, lr=1e3, eps=1e3, clip=1.0)
# expert 2 x data 2, and expert 2 x sequence 2 (sequence_parallel_size, two rows a rank) with "overlap" on
BUILT_SEQUENCE = ((1, False), (2, True))


def _built_step(sequence: int, overlap: bool) -> tuple:
    """One step of build()'s parts at expert 2 x data 2 (or x sequence 2): the loss, each parameter's update by
    Hugging Face name, which experts this rank holds (as _expert_step)."""
    from pipezero.pipe.sequence import shard_batch, whole_positions
    from pipezero.pipe.expert import ExpertParallel, expert_parameters
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.hf.layers import _HFLayer
    from pipezero.train import build

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": sequence,
              "pipeline": {"stages": 1}, "sequence_parallel_size": sequence,
              "zero_optimization": {"stage": BUILT["stage"]}, "gradient_clipping": BUILT["clip"],
              "optimizer": {"type": "Adam", "params": {"lr": BUILT["lr"], "eps": BUILT["eps"]}},
              "expert_parallel": {"enabled": True, "autoep_size": BUILT["expert"], "overlap": overlap}}
    parts = build(config, specs=hf_layer_specs(_model(BUILT["family"])), loss_fn=causal_lm_loss)
    grid, module = parts.grid, parts.module
    assert grid.expert_size == BUILT["expert"] and len(parts.inner.param_groups) == 2
    assert {m.overlap for m in module.modules() if isinstance(m, ExpertParallel)} == {overlap}
    assert all(p.shape[0] == 4 // BUILT["expert"] for p in expert_parameters(module))
    before = {n: p.detach().clone() for layer in module.modules() if isinstance(layer, _HFLayer)
              for n, p in layer.hf_parameters()}
    ids, mask, labels = _batch(True)
    rows = slice(grid.data_expert_rank * sequence, (grid.data_expert_rank + 1) * sequence)
    batch = (ids[rows], mask[rows]), _targets(labels)[rows]
    if sequence > 1:
        batch = shard_batch((*batch[0], whole_positions(ids[rows])), batch[1], grid)
    loss = parts.runner.train_step(*batch)
    assert parts.optimizer.step() is not False
    after = {n: p.detach().clone() for layer in module.modules() if isinstance(layer, _HFLayer)
             for n, p in layer.hf_parameters()}
    held = grid.expert_rank
    part = held * 4 // BUILT["expert"], (held + 1) * 4 // BUILT["expert"]
    return loss, {n: before[n] - after[n] for n in after}, part, None


def _built_truth() -> tuple[torch.Tensor, dict]:
    """transformers' loss, and each parameter's update by torch's own clip_grad_norm_ and Adam."""
    loss, grads = _truth(BUILT["family"], True, WORLD)
    return loss, _adam_updates(BUILT["family"], grads, BUILT["clip"], BUILT["lr"], BUILT["eps"])


# a param group's own reduction group over two backwards before a step (each reduces; the second adds to the
# first's kept result): a plain two-layer model, its second layer reduced as an expert's would be
ACCUMULATED = [(0, 2), (1, 2), (2, 2), (3, 2), (0, 4), (1, 4)]  # ZeRO stage, expert degree


def _local_grads(rank: int) -> list[torch.Tensor]:
    """This rank's two backwards' gradients, summed, of the plain two-layer model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def _accumulated(stage: int, expert: int) -> list[torch.Tensor]:
    """Each parameter's SGD(lr=1) update: the dense layer averaged over the world, the other summed over the
    grid's expert data group and divided by data x expert (zero_group, zero_mean_over)."""
    from pipezero.topology import Grid
    from pipezero.zero import ZeroOptimizer, gathered

    grid = Grid(expert=expert)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    groups = [{"params": list(model[0].parameters())},
              {"params": list(model[2].parameters()), "zero_group": grid.expert_data_group,
               "zero_mean_over": grid.data_expert_size}]
    opt = ZeroOptimizer(torch.optim.SGD(groups, lr=1.0), stage=stage, group=grid.data_sequence_group,
                        module=model if stage == 3 else None)
    with gathered(opt) if stage == 3 else contextlib.nullcontext():
        before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * grid.rank + step))
        model(x).square().sum().backward()
    opt.step()
    with gathered(opt) if stage == 3 else contextlib.nullcontext():
        return [b - p.detach() for b, p in zip(before, model.parameters())]


# an experts module with a parameter that has no slice per expert (one scale for every expert): no shipped
# family holds one; it is a replica on every rank of the expert group, reduced with the dense parameters
class _Experts(torch.nn.Module):
    """Stacked experts as transformers 5 calls them (hidden, top-k indices, top-k weights), and one shared scale."""

    def __init__(self, num_experts: int, d: int):
        super().__init__()
        self.num_experts = num_experts
        self.weight = torch.nn.Parameter(torch.randn(num_experts, d, d) * 0.5)
        self.scale = torch.nn.Parameter(1 + 0.2 * torch.randn(num_experts // 2 + 1))  # dim 0 is not the experts'

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = sum(top_k_weights[:, k, None] * torch.einsum("nd,nde->ne", hidden, self.weight[top_k_index[:, k]])
                  for k in range(top_k_index.shape[1]))
        return out * self.scale.sum()


class _Block(torch.nn.Module):
    def __init__(self, num_experts: int = 4, d: int = 6):
        super().__init__()
        self.gate = torch.nn.Linear(d, num_experts, bias=False)
        self.experts = _Experts(num_experts, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.gate(x).softmax(-1).topk(2, dim=-1)
        return x + self.experts(x, index, weights)


def _replicated_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), _Block())


def _replicated_rows() -> torch.Tensor:
    return torch.randn(WORLD * 5, 6, generator=torch.Generator().manual_seed(3))


def _replicated_job(expert: int) -> tuple:
    """The model with its experts split over Grid(expert=N), ZeroOptimizer(SGD) over expert_param_groups."""
    from pipezero.pipe.expert import expert_param_groups, shard_experts
    from pipezero.topology import Grid
    from pipezero.train.checkpoint.state_parts import HandParts
    from pipezero.zero import ZeroOptimizer

    grid = Grid(expert=expert)
    model = _replicated_model()
    assert shard_experts(model, grid.expert_group) == 1
    opt = ZeroOptimizer(torch.optim.SGD(expert_param_groups(model, grid), lr=1.0), stage=1,
                        group=grid.data_sequence_group)
    return HandParts(model, opt, grid=grid)


def _replicated_in_experts(root: str) -> dict[str, torch.Tensor]:
    """Grid(expert=2) (data 2): each parameter's SGD(lr=1) update, the experts gathered whole; saved, then
    loaded at expert 4: the same whole parameters."""
    from pipezero.pipe.expert import expert_param_groups, expert_parameters, shard_experts, whole_experts
    from pipezero.topology import Grid
    from pipezero.train.checkpoint.state import load_state, save_state
    from pipezero.train.checkpoint.state_parts import HandParts
    from pipezero.zero import ZeroOptimizer

    grid = Grid(expert=2)
    model = _replicated_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert shard_experts(model, grid.expert_group) == 1
    scale = model[2].experts.scale
    assert [tuple(p.shape) for p in expert_parameters(model)] == [(2, 6, 6)]  # the scale is no expert parameter
    assert torch.equal(whole_experts(model).get(id(scale), scale), scale.detach())
    groups = expert_param_groups(model, grid)
    assert any(p is scale for p in groups[0]["params"])  # reduced over data x expert, as a dense parameter
    opt = ZeroOptimizer(torch.optim.SGD(groups, lr=1.0), stage=1, group=grid.data_sequence_group)
    rows = _replicated_rows().chunk(WORLD)[grid.data_expert_rank]
    model(rows).square().mean().backward()
    opt.step()
    whole = whole_experts(model)
    after = {n: whole.get(id(p), p.detach()) for n, p in model.named_parameters()}
    save_state(HandParts(model, opt, grid=grid), f"{root}/replicated", 1)
    wider = _replicated_job(4)
    load_state(wider, f"{root}/replicated")
    loaded = whole_experts(wider.module)
    for name, p in wider.module.named_parameters():
        torch.testing.assert_close(loaded.get(id(p), p.detach()), after[name], rtol=0, atol=0, msg=name)
    return {n: before[n] - after[n] for n in after}


def _replicated_truth() -> dict[str, torch.Tensor]:
    model = _replicated_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(_replicated_rows()).square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


OVERLAP_TOKENS = (5, 1)  # halves of 2 and 3 tokens; of 0 and 1 (A sends nothing)


# the overlap's order of events (pipe/expert/overlap.py): the all-to-alls recorded as they are launched and waited
class _Recorded:
    """An async all-to-all's work that writes its wait into the events."""

    def __init__(self, work, n: int, events: list):
        self.work, self.n, self.events = work, n, events

    def wait(self):
        self.events.append(("wait", self.n))
        return self.work.wait()


class _RecordingExperts(_Experts):
    """_Experts that write each call (the first of a forward is half A) and its backward's start and end."""

    events: list = []

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        half = "AB"[sum(e[0] == "experts" for e in self.events) % 2]
        self.events.append(("experts", half))
        out = super().forward(hidden, top_k_index, top_k_weights)
        out.register_hook(lambda g: self.events.append(("experts backward", half)))
        hidden.register_hook(lambda g: self.events.append(("experts backward done", half)))
        return out


def _overlap_events(tokens: int) -> tuple:
    """Grid(expert=2): one MoE layer's forward and backward on `tokens` rows a rank, serial and with the overlap
    on: the largest difference of the output, the input's and every parameter's gradient (relative to the
    tensor's largest entry: an expert's weight gradient sums its rows in two parts); the overlap's events
    (forward, backward): ("counts",) a blocking exchange, ("launch", n) / ("wait", n) the n-th async one,
    ("experts", half), ("experts backward", half), ("experts backward done", half)."""
    import torch.distributed as dist

    from pipezero.pipe.expert import shard_experts
    from pipezero.topology import Grid

    grid, events = Grid(expert=2), []
    real = dist.all_to_all_single

    def recording(out, rows, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        work = real(out, rows, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if not async_op:
            events.append(("counts",))
            return work
        n = sum(e[0] == "launch" for e in events)
        events.append(("launch", n))
        return _Recorded(work, n, events)

    results = []
    for overlap in (False, True):
        torch.manual_seed(0)
        block = _Block()
        block.experts.__class__ = _RecordingExperts  # the same weights, recorded
        block.experts.events = events
        shard_experts(block, grid.expert_group, overlap=overlap)
        rows = torch.randn(4 * tokens, 6, generator=torch.Generator().manual_seed(5))
        rows = rows.chunk(4)[grid.rank].clone().requires_grad_()
        events.clear()
        dist.all_to_all_single = recording
        try:
            out = block(rows)
            forward = list(events)
            out.square().sum().backward()
        finally:
            dist.all_to_all_single = real
        results.append((out.detach(), rows.grad, *(p.grad for p in block.parameters())))
    largest = max(((a - b).abs().max() / a.abs().max()).item() if a.numel() else 0.0 for a, b in zip(*results))
    return largest, forward, events[len(forward):]


def _cases(max_norms: list[float], root: str) -> list:
    return ([_expert_step(max_norm, *case, **options) for (case, options), max_norm in zip(STEPS, max_norms)] +
            [_built_step(*built) for built in BUILT_SEQUENCE] +
            [_accumulated(*case) for case in ACCUMULATED] + [_overlap_events(n) for n in OVERLAP_TOKENS] +
            [_replicated_in_experts(root)])


def _wide(max_norms: list[float]) -> list:
    return [_expert_step(max_norm, *case) for case, max_norm in zip(WIDE, max_norms)]


def _check_overlap(largest: float, forward: list, backward: list) -> None:
    """The overlap gives the serial path's numbers (fp32, 1e-6); one counts exchange (one host sync), both halves' rows
    launched before the first wait, and some exchange in flight whenever experts compute, forward and backward
    (in backward: one half's reverse exchange launched before the other half's expert backward, waited after)."""
    assert largest <= 1e-6, largest
    assert forward.count(("counts",)) == 1 and ("counts",) not in backward, (forward, backward)
    first_wait = next(i for i, e in enumerate(forward) if e[0] == "wait")
    assert {("launch", 0), ("launch", 1)} <= set(forward[:first_wait]), forward
    for events in (forward, backward):
        flying = set()
        for event in events:
            if event[0] == "launch":
                flying.add(event[1])
            elif event[0] == "wait":
                flying.discard(event[1])
            elif event[0].startswith("experts"):
                assert flying, f"{event} with no all-to-all in flight: {events}"
    assert sum(e[0] == "experts backward" for e in backward) == 2 and len(flying) == 0, backward


def test_expert_parallel_equals_one_process(tmp_path):
    """Each fails with the expert gradients divided by the ranks holding the same experts only, or left
    out of the clipping norm."""
    keys = [(case[0], _rows(case, WORLD)) for case, _ in STEPS] + [(case[0], _rows(case, 8)) for case in WIDE]
    truths = {key: _clipped(*key) for key in sorted(set(keys))}
    norms = [truths[key][2] for key in keys]
    results = run(_cases, WORLD, norms[:len(STEPS)], str(tmp_path), timeout=300)
    wide = run(_wide, 8, norms[len(STEPS):], timeout=300)
    wanted = [(key[0], *truths[key][:2]) for key in keys[:len(STEPS)]]
    wanted += [(BUILT["family"], *_built_truth())] * len(BUILT_SEQUENCE)
    checked = [(results, i, want) for i, want in enumerate(wanted)]
    checked += [(wide, i, (key[0], *truths[key][:2])) for i, key in enumerate(keys[len(STEPS):])]
    for ranks, i, (family, want_loss, want_grads) in checked:
        grads, wholes = {}, set()
        for rank_results in ranks:
            loss, rank_grads, (lo, hi), whole = rank_results[i][:4]
            stepped = {n: p.detach() - want_grads[n] for n, p in _model(family).named_parameters()}
            assert whole is None or all(torch.allclose(t, stepped[n], rtol=1e-5, atol=1e-5) for n, t in whole.items())
            wholes |= set(whole or ())
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{family} {i}: {m}")
            for name, value in rank_grads.items():
                want = want_grads[name][lo:hi] if ".experts." in name else want_grads[name]
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{family} {i} {name}: {m}")
                grads[name] = value
        assert set(grads) == set(want_grads), (family, i, set(grads) ^ set(want_grads))
        assert ranks[0][i][3] is None or wholes == {n for n in want_grads if ".experts." in n}, (family, i, wholes)
    plain = STEPS.index((RECOMPUTED[0][0], {}))  # the same case without checkpointing
    for rank_results in results:  # a checkpointed MoE layer makes its forward's all-to-alls again in backward
        assert rank_results[len(STEPS) - len(RECOMPUTED)][4] > rank_results[plain][4], rank_results[plain][4]
    local = [_local_grads(rank) for rank in range(WORLD)]
    for i, (stage, expert) in enumerate(ACCUMULATED, start=len(wanted)):
        for rank, updates in enumerate(results):
            same = [r for r in range(WORLD) if r % expert == rank % expert]  # the grid's expert data group
            want = [sum(g[k] for g in local) / WORLD for k in range(2)] + \
                [sum(local[r][k] for r in same) / WORLD for k in range(2, 4)]
            for k, (got, w) in enumerate(zip(updates[i], want)):
                torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{stage, expert, k}: {m}")
    for rank_results in results:
        for largest, forward, backward in rank_results[len(wanted) + len(ACCUMULATED):][:len(OVERLAP_TOKENS)]:
            _check_overlap(largest, forward, backward)
    truth = _replicated_truth()  # a parameter of the experts with no slice per expert: reduced as a dense one
    for rank, updates in enumerate(results):
        assert set(updates[-1]) == set(truth)
        for name, want in truth.items():
            torch.testing.assert_close(updates[-1][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
