"""ZeroOptimizer: accumulation, the readiness protocol and overlap, frozen/tied/odd parameters,
sub-groups, a group of 1, and clear errors. fp32 parity against single-process training."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run
from pipezero.comm import TRAFFIC
from pipezero.topology import Grid
from pipezero.zero import ZeroConfig, ZeroOptimizer
from test_zero_parity import Tied, data, local_batch, make_model, make_opt, reference, train_zero

TOL = dict(rtol=1e-6, atol=1e-6)


def _assert_params(results, want, what):
    for rank, got in enumerate(results):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} rank {rank}: {m}")


# -- gradient accumulation with no_sync ---------------------------------------------------
def _accumulate(stage):
    return train_zero("adam", stage, steps=4, accum=4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_no_sync(stage):
    _assert_params(run(_accumulate, 2, stage), reference("adam", 2, steps=4, accum=4), f"stage {stage}")


def _accumulate_synced(stage):
    return train_zero("adam", stage, steps=3, accum=2, sync_each=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_reducing_every_backward(stage):
    """Several synced backward passes before one step add up (no no_sync, like DDP)."""
    _assert_params(run(_accumulate_synced, 2, stage), reference("adam", 2, steps=3, accum=2), f"stage {stage}")


# -- the pipeline runner's readiness protocol ------------------------------------------------
def _readiness(stage):
    """What the runner does: hold all, backward 3 microbatches, release, last backward, flush, step."""
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adamw2"), module=model if stage == 3 else None,
                        config=ZeroConfig(stage=stage, stage3_param_persistence_threshold=10))
    params = list(model.parameters())
    counts = []
    for step in range(3):
        x, y = local_batch(world, step)
        opt.zero_grad()
        opt.hold_grad_sync(params)
        TRAFFIC.reset()
        for m, (xs, ys) in enumerate(zip(x.chunk(4), y.chunk(4))):
            if m == 3:
                counts.append(_reductions())           # nothing reduced while held
                opt.release_grad_sync(params)
            opt.backward(nn.functional.mse_loss(model(xs), ys) / 4)
        opt.flush_grad_sync(params)
        counts.append(_reductions())                   # everything launched before step
        opt.step()
    with opt.gathered_parameters():
        return [p.detach().clone() for p in params], counts


def _reductions():
    snap = TRAFFIC.snapshot()
    return sum(snap.get(k, {}).get("calls", 0) for k in ("all_reduce", "reduce_scatter"))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_readiness_protocol_reduces_before_step(stage):
    results = run(_readiness, 2, stage)
    want = reference("adamw2", 2, steps=3, accum=4)
    _assert_params([r[0] for r in results], want, f"stage {stage}")
    for _, counts in results:
        held, flushed = counts[0::2], counts[1::2]
        assert held == [0, 0, 0] and all(c > 0 for c in flushed), counts


def _overlap_plain_backward(stage):
    """Plain loss.backward(): small buckets are reduced during backward, before step()."""
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), config=ZeroConfig(stage=stage, reduce_bucket_size=64),
                        module=model if stage == 3 else None)
    x, y = local_batch(world, 0)
    TRAFFIC.reset()
    nn.functional.mse_loss(model(x), y).backward()
    during = _reductions()
    opt.step()
    return during, len(opt.buckets)


@pytest.mark.parametrize("stage", [1, 2])
def test_buckets_reduce_during_backward(stage):
    for during, buckets in run(_overlap_plain_backward, 2, stage):
        assert buckets > 2 and during == buckets


def _without_overlap(stage):
    """overlap_comm=False: backward reduces nothing, step() reduces every bucket."""
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), module=model if stage == 3 else None, config=ZeroConfig(
        stage=stage, overlap_comm=False, reduce_bucket_size=64, stage3_param_persistence_threshold=10))
    during = []
    for step in range(3):
        x, y = local_batch(world, step)
        opt.zero_grad()
        TRAFFIC.reset()
        opt.backward(nn.functional.mse_loss(model(x), y))
        during.append(_reductions())
        opt.step()
    with opt.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()], during


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_without_overlap_step_reduces_everything(stage):
    results = run(_without_overlap, 2, stage)
    _assert_params([r[0] for r in results], reference("adam", 2, steps=3), f"stage {stage}")
    assert all(during == [0, 0, 0] for _, during in results), results


# -- frozen layers, tied weights -------------------------------------------------------------------
def _frozen(stage):
    return train_zero("adamw2", stage, steps=4, build=lambda: make_model(frozen=True))


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_layers_skipped(stage):
    want = reference("adamw2", 4, steps=4, build=lambda: make_model(frozen=True))
    _assert_params(run(_frozen, 4, stage), want, f"stage {stage}")


def _tied(stage):
    return train_zero("adam", stage, steps=4, build=Tied, tied=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_tied_weights(stage):
    results = run(_tied, 2, stage)
    _assert_params(results, reference("adam", 2, steps=4, build=Tied, tied=True), f"stage {stage}")


# -- groups other than the world, and a group of one ------------------------------------------------
def _data_group_of_grid(stage, pipe):
    """Each pipe rank trains the whole model over its own data group (pipe x data = world)."""
    grid = Grid(pipe=pipe)
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), group=grid.data_group, module=model if stage == 3 else None,
                        config=ZeroConfig(stage=stage, stage3_param_persistence_threshold=0))
    TRAFFIC.reset()
    for step in range(3):
        x, y = data(grid.data_size, step)
        xs, ys = x.chunk(grid.data_size)[grid.data_rank], y.chunk(grid.data_size)[grid.data_rank]
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(model(xs), ys))
        opt.step()
    calls = sum(v["calls"] for v in TRAFFIC.snapshot().values())
    with opt.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()], calls


@pytest.mark.parametrize("stage", [2, 3])
def test_data_group_of_a_grid(stage):
    results = run(_data_group_of_grid, 4, stage, 2)
    _assert_params([r[0] for r in results], reference("adam", 2, steps=3), f"stage {stage}")


def test_group_of_one_costs_nothing():
    results = run(_data_group_of_grid, 2, 2, 2)     # pipe=2 on 2 ranks: data groups of 1
    _assert_params([r[0] for r in results], reference("adam", 1, steps=3), "data=1")
    assert [r[1] for r in results] == [0, 0]


# -- errors ---------------------------------------------------------------------------------------------
class Lamb(torch.optim.Optimizer):
    """A stand-in with a per-tensor trust ratio: not element-wise."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-3})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-12)
                    p.data.add_(p.grad, alpha=-group["lr"] * float(ratio))


def test_refuses_whole_tensor_optimizers():
    model = make_model()
    with pytest.raises(TypeError, match="Lamb.*elementwise=True"):
        ZeroOptimizer(Lamb(model.parameters()), stage=1)


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        ZeroOptimizer(torch.optim.Adam(model.parameters()), stage=4)
    with pytest.raises(ValueError, match="needs module="):
        ZeroOptimizer(torch.optim.Adam(model.parameters()), stage=3)
    with pytest.raises(TypeError, match="wraps an optimizer"):
        ZeroOptimizer(model, stage=1)


def test_a_param_groups_own_reduction_group_keys():
    """zero_group / zero_mean_over (zero/reduction.py) are taken out of the param group (no process group
    reaches a state_dict); a misspelt zero_ key or a bad divisor is refused, naming it."""
    model = make_model()
    params = list(model.parameters())
    opt = ZeroOptimizer(torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "zero_group": None,
                                                                   "zero_mean_over": 2}], lr=0.1), stage=1)
    assert [r.mean_over for r in opt.reductions] == [1, 2]
    saved = opt.param_groups + opt.consolidated_state_dict()["consolidated"]["param_groups"]
    assert len(saved) == 4 and all(not any(k.startswith("zero_") for k in g) for g in saved)
    with pytest.raises(ValueError, match=r"param group 1: unknown ZeroOptimizer key\(s\) \['zero_groups'\]"):
        ZeroOptimizer(torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "zero_groups": None}], lr=0.1),
                      stage=1)
    with pytest.raises(ValueError, match="'zero_mean_over' = 0; expected a positive integer"):
        ZeroOptimizer(torch.optim.SGD([{"params": params, "zero_mean_over": 0}], lr=0.1), stage=1)


# -- stage 3 really partitions ---------------------------------------------------------------------
def _stage3_layout():
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=10))
    x, y = local_batch(world, 0)
    opt.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    with torch.no_grad():
        out = model(x)                                  # inference gathers and releases too
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    shards = sorted(p.numel() for g in opt.param_groups for p in g["params"])
    return sizes, shards, tuple(out.shape)


def test_stage3_keeps_only_small_params_whole():
    for sizes, shards, shape in run(_stage3_layout, 4):
        assert shape == (8, 8)
        assert {n: s for n, s in sizes.items() if s} == {"4.bias": 7, "6.bias": 8}
        # one bucket per module and persistence: 128+16, 256+16, 112, 56 elements over 4 ranks;
        # the 7- and 8-element biases (persistent) are padded to 8 and their state sharded too
        assert shards == sorted([36, 68, 28, 14, 2, 2])


def _where_accumulated(stage):
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), stage=stage)
    x, y = local_batch(world, 0)
    with opt.no_sync():
        nn.functional.mse_loss(model(x), y).backward()
    return [p.grad is None for p in model.parameters()]


@pytest.mark.parametrize("stage,in_buffer", [(1, True), (2, False)])
def test_no_sync_accumulates_in_the_stage1_buffer(stage, in_buffer):
    """Stage 1 keeps one full gradient buffer, so accumulation must not add a second copy in .grad."""
    for flags in run(_where_accumulated, 2, stage):
        assert all(f == in_buffer for f in flags), flags


def _blocks():
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))  # noqa: E731
    return nn.Sequential(block(), nn.Tanh(), block())


def _stage3_blocks():
    return train_zero("sgd", 3, steps=3, build=_blocks,
                      config=ZeroConfig(stage=3, stage3_param_persistence_threshold=0))


def test_stage3_gathers_a_block_as_one_unit():
    from pipezero.zero.partition import stage3_units
    units = stage3_units(_blocks())
    assert [(type(m).__name__, recurse) for m, recurse in units] == [("Sequential", True)] * 2
    _assert_params(run(_stage3_blocks, 2), reference("sgd", 2, steps=3, build=_blocks), "blocks")


# -- traffic: stage 3 moves 1.5x the bytes of stage 2 (ZeRO section 7) -------------------------------
def _bytes_per_step(stage):
    world = dist.get_world_size()
    model = make_model()
    opt = ZeroOptimizer(make_opt(model, "adam"), module=model,
                        config=ZeroConfig(stage=stage, stage3_param_persistence_threshold=0))
    x, y = local_batch(world, 0)
    TRAFFIC.reset()
    opt.backward(nn.functional.mse_loss(model(x), y))
    opt.step()
    snap = TRAFFIC.snapshot()
    return sum(snap.get(k, {}).get("bytes", 0) for k in ("all_reduce", "reduce_scatter", "all_gather"))


def test_stage3_traffic_is_one_and_a_half_times_stage2():
    stage2, stage3 = run(_bytes_per_step, 2, 2)[0], run(_bytes_per_step, 2, 3)[0]
    assert stage3 == 1.5 * stage2, (stage2, stage3)


def _prefetch(prefetch):
    world = dist.get_world_size()
    model = _blocks()
    opt = ZeroOptimizer(make_opt(model, "adam"), module=model, config=ZeroConfig(
        stage=3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=prefetch))
    seen = []   # while block 0 starts: which blocks' all-gathers are already under way
    model[0].register_forward_pre_hook(lambda m, a: seen.append([b.flat is not None for b in opt.buckets]))
    for step in range(3):
        x, y = local_batch(world, step)
        TRAFFIC.reset()
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
    calls = TRAFFIC.snapshot()["all_gather"]["calls"]
    with opt.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()], calls, seen


def test_stage3_prefetch_changes_nothing_but_timing():
    plain, ahead = run(_prefetch, 2, 0), run(_prefetch, 2, 1)
    for (a, calls_a, seen_a), (b, calls_b, seen_b) in zip(plain, ahead):
        assert calls_a == calls_b == 4        # two blocks, forward and backward, none wasted
        assert seen_a == [[True, False]] * 3 and seen_b == [[True, False]] + [[True, True]] * 2
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _different_models():
    model = nn.Linear(4, 4 + dist.get_rank())
    with pytest.raises(ValueError, match="hold different parameters"):
        ZeroOptimizer(torch.optim.Adam(model.parameters()), stage=2)


def test_different_models_on_ranks_fail_on_every_rank():
    run(_different_models, 2)


# -- padding of the flat buffers -------------------------------------------------------------
def _poisoned_empty(stage):
    """Train with torch.empty filled with NaN (deterministic mode's fill_uninitialized_memory)
    under a dynamic LossScaler, which skips any step with a non-finite gradient: padding that a
    fresh gradient buffer did not zero would reach the shards' gradients and skip every step."""
    from pipezero.precision import LossScaler

    world = dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        model = make_model()  # a 7-element bias: the flat buffers need padding over 2 ranks
        inner = LossScaler(make_opt(model, "sgd"), init_scale=1.0)
        opt = ZeroOptimizer(inner, stage=stage, module=model if stage == 3 else None,
                            config=ZeroConfig(stage=stage, stage3_param_persistence_threshold=10))
        stepped = []
        for step in range(3):
            x, y = local_batch(world, step)
            opt.zero_grad()
            opt.backward(nn.functional.mse_loss(model(x), y))
            stepped.append(opt.step())
        with opt.gathered_parameters():
            return stepped, [p.detach().clone() for p in model.parameters()]
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_uninitialised_padding_never_reaches_the_gradients(stage):
    want = reference("sgd", 2, steps=3)
    results = run(_poisoned_empty, 2, stage)
    assert [stepped for stepped, _ in results] == [[True] * 3] * 2
    _assert_params([params for _, params in results], want, f"stage {stage}")


def _forward_inside_gathered():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3, module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    with opt.gathered_parameters():
        model(torch.randn(2, 8))  # the stage-3 hooks used to free each layer after its forward
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
    return whole, inside, [p.numel() for p in model.parameters()]


def test_a_forward_inside_gathered_parameters_leaves_them_whole():
    for whole, inside, after in run(_forward_inside_gathered, 2):
        for name, value in whole.items():
            torch.testing.assert_close(inside[name], value, rtol=0, atol=0, msg=name)
        assert sum(after) < sum(v.numel() for v in whole.values()), after  # partitioned again after the block


def _tied_gpt_outside_the_runner():
    from pipezero.pipe import PipelineModule
    from pipezero.train.gpt.model import GPTConfig, gpt_loss, gpt_specs

    grid = Grid(pipe=1)
    model = PipelineModule(gpt_specs(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)), grid=grid,
                           loss_fn=gpt_loss)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    want = model(x).detach()
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters()), group=grid.data_group, module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    with pytest.raises(Exception, match=r"tied layer .*partitioned \(ZeRO-3\).*gathered_parameters"):
        model(x)
    with opt.gathered_parameters():
        inside = model(x).detach()
    return want, inside


def test_a_tied_head_outside_the_runner_is_named_and_runs_inside_gathered_parameters():
    """The GPT's head reuses the embedding's weight through a forward_fn, which runs no stage-3
    hook: outside the runner it used to fail with a matmul's size mismatch against an empty weight."""
    for want, inside in run(_tied_gpt_outside_the_runner, 2):
        torch.testing.assert_close(inside, want, rtol=0, atol=0)
