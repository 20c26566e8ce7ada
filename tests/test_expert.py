"""Expert parallelism (pipe/expert/) equals one process: tiny MoEs, their experts split over an expert group.

Four gloo ranks, each a data replica of the dense layers with its own rows of the batch:
Qwen3-MoE at pipe 1 with expert 4 (each rank one of the four experts) and expert 2 x data 2
(each pair of ranks splits the experts, each expert held by two ranks whose gradients are
summed; the dense parameters under ZeRO-3 there); Mixtral and DeepSeek-V3 (shared experts, a
dense first layer) at pipe 2 x expert 2 under 1F1B, and Mixtral under ZB-V (split backward; the
final norm and the head on different stages: the load-balancing term crosses a boundary). The
groups come from Grid(expert=E): its expert axis (E consecutive ranks of the old data axis) splits
the experts, its data axis holds the same experts. The dense parameters train under ZeRO-1 over
data x expert (all four ranks at pipe 1), the experts under their own SGD after reduce_expert_grads.
The truth is transformers' model on the whole batch, one microbatch per
rank (output_router_logits=True: the load-balancing loss too): the loss and, through one SGD
step of rate 1, every gradient by Hugging Face name (an expert's on the rank holding it), fp32;
hf_state_dict gathers every expert whole.
"""

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from test_hf_router import _batch, _targets, _truth, _model  # noqa: E402

WORLD = 4


def _expert_step(family: str, expert: int, pipe: int = 1, zero_stage: int = 1, zbv: bool = False) -> tuple:
    """One step at pipe x data x expert = WORLD: the loss, each parameter's gradient by Hugging Face name, and
    which experts this rank holds. The groups are the Grid's; the asserts check them against the layout."""
    import torch.distributed as dist

    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner, ZeroBubbleV
    from pipezero.pipe.expert import expert_parameters, reduce_expert_grads, shard_experts
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs, hf_state_dict
    from pipezero.pipe.hf.specs import _HFLayer
    from pipezero.topology import Grid
    from pipezero.zero import ZeroOptimizer, gathered

    grid = Grid(pipe=pipe, expert=expert)  # data x expert = WORLD / pipe: the dense parameters' replicas
    expert_group, same_experts = grid.expert_group, grid.expert_data_group
    replicas = WORLD // pipe
    first = grid.pipe_rank * replicas  # ranks that split the experts, then those that hold the same ones
    block = (grid.rank - first) // expert * expert + first
    assert dist.get_process_group_ranks(expert_group) == list(range(block, block + expert))
    assert dist.get_process_group_ranks(same_experts) == list(range(first + grid.expert_rank, first + replicas,
                                                                    expert))
    assert grid.group_ranks("data_sequence") == list(range(first, first + replicas))
    module = PipelineModule(hf_layer_specs(_model(family)), grid=grid, loss_fn=causal_lm_loss,
                            partition_method="uniform", num_chunks=2 if zbv else 1, placement="v" if zbv else "looped")
    assert shard_experts(module, expert_group) > 0
    experts = expert_parameters(module)
    assert experts and all(p.shape[0] == 4 // expert for p in experts)  # this rank's experts only
    dense = [p for p in module.parameters() if all(p is not e for e in experts)]
    before = {n: p.detach().clone() for layer in module.modules() if isinstance(layer, _HFLayer)
              for n, p in layer.hf_parameters()}
    opt = ZeroOptimizer(torch.optim.SGD(dense, lr=1.0), stage=zero_stage, group=grid.data_sequence_group,
                        module=module if zero_stage == 3 else None)
    expert_opt = torch.optim.SGD(experts, lr=1.0)
    runner = PipelineRunner(module, (ZeroBubbleV if zbv else OneFOneB)(num_microbatches=pipe), optimizer=opt)
    ids, mask, labels = _batch(True)
    share = ids.shape[0] // grid.data_expert_size
    rows = slice(grid.data_expert_rank * share, (grid.data_expert_rank + 1) * share)
    loss = runner.train_step((ids[rows], mask[rows]), _targets(labels)[rows])
    reduce_expert_grads(experts, same_experts, grid.data_expert_size)
    opt.step()
    expert_opt.step()
    held = grid.expert_rank
    assert held == dist.get_rank(expert_group)
    part = held * 4 // expert, (held + 1) * 4 // expert  # this rank's experts
    with gathered(opt) if zero_stage == 3 else contextlib.nullcontext():
        after = {n: p.detach().clone() for layer in module.modules() if isinstance(layer, _HFLayer)
                 for n, p in layer.hf_parameters()}
        whole = {n: t for n, t in hf_state_dict(module).items() if ".experts." in n}  # gathered over the group
    return loss, {n: before[n] - after[n] for n in after}, part, whole


CASES = [("qwen3_moe", 4, 1, 1, False), ("qwen3_moe", 2, 1, 3, False), ("mixtral", 2, 2, 1, False),
         ("deepseek_v3", 2, 2, 1, False), ("mixtral", 2, 2, 1, True)]
# family, expert, pipe, ZeRO stage of the dense parameters, ZB-V (else 1F1B)


def _cases() -> list:
    return [_expert_step(*case) for case in CASES]


def test_expert_parallel_equals_one_process():
    """Each fails with the expert gradients divided by the ranks holding the same experts only."""
    results = run(_cases, WORLD, timeout=300)
    for i, (family, expert, pipe, *_) in enumerate(CASES):
        want_loss, want_grads = _truth(family, True, WORLD)  # one microbatch per (data rank, microbatch)
        grads = {}
        for rank_results in results:
            loss, rank_grads, (lo, hi), whole = rank_results[i]
            stepped = {n: p.detach() - want_grads[n] for n, p in _model(family).named_parameters()}
            assert whole and all(torch.allclose(t, stepped[n], rtol=1e-5, atol=1e-5) for n, t in whole.items())
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{family}: {m}")
            for name, value in rank_grads.items():
                want = want_grads[name][lo:hi] if ".experts." in name else want_grads[name]
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{family} {name}: {m}")
                grads[name] = value
        assert set(grads) == set(want_grads), (family, set(grads) ^ set(want_grads))
