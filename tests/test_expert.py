"""Expert parallelism (pipe/expert/) equals one process: a tiny Qwen3-MoE, its experts split over an expert group.

Four gloo ranks, pipe 1, each rank a data replica with its own rows of the batch: expert 4
(each rank one of the four experts) and expert 2 x data 2 (each pair of ranks splits the
experts, each expert held by two ranks whose gradients are summed). The dense parameters
train under ZeRO-1 over all four ranks, the experts under their own SGD after
reduce_expert_grads. The truth is transformers' model on the whole batch, one microbatch per
rank (output_router_logits=True: the load-balancing loss too): the loss and, through one SGD
step of rate 1, every gradient by Hugging Face name (an expert's on the rank holding it), fp32.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from test_hf_router import _batch, _targets, _truth, _model  # noqa: E402

FAMILY, WORLD = "qwen3_moe", 4


def _expert_step(expert: int) -> tuple[torch.Tensor, dict]:
    """One step at data x expert = WORLD: the loss and each parameter's gradient, by Hugging Face name."""
    import torch.distributed as dist

    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.pipe.expert import expert_parameters, reduce_expert_grads, shard_experts
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.hf.specs import _HFLayer
    from pipezero.topology import Grid
    from pipezero.zero import ZeroOptimizer

    rank = dist.get_rank()
    expert_group, _ = dist.new_subgroups_by_enumeration(
        [list(range(s, s + expert)) for s in range(0, WORLD, expert)])  # ranks that split the experts
    same_experts, _ = dist.new_subgroups_by_enumeration(
        [list(range(r, WORLD, expert)) for r in range(expert)])         # ranks that hold the same experts
    grid = Grid(pipe=1)  # data = WORLD: the dense parameters' replicas
    module = PipelineModule(hf_layer_specs(_model(FAMILY)), grid=grid, loss_fn=causal_lm_loss)
    assert shard_experts(module, expert_group) == _model(FAMILY).config.num_hidden_layers
    experts = expert_parameters(module)
    assert experts and all(p.shape[0] == 4 // expert for p in experts)  # this rank's experts only
    dense = [p for p in module.parameters() if all(p is not e for e in experts)]
    before = {n: p.detach().clone() for layer in module.modules() if isinstance(layer, _HFLayer)
              for n, p in layer.hf_parameters()}
    opt = ZeroOptimizer(torch.optim.SGD(dense, lr=1.0), stage=1, group=grid.data_group)
    expert_opt = torch.optim.SGD(experts, lr=1.0)
    runner = PipelineRunner(module, OneFOneB(num_microbatches=1), optimizer=opt)
    ids, mask, labels = _batch(True)
    rows = slice(rank * ids.shape[0] // WORLD, (rank + 1) * ids.shape[0] // WORLD)
    loss = runner.train_step((ids[rows], mask[rows]), _targets(labels)[rows])
    reduce_expert_grads(experts, same_experts, WORLD)
    opt.step()
    expert_opt.step()
    after = {n: p.detach() for layer in module.modules() if isinstance(layer, _HFLayer)
             for n, p in layer.hf_parameters()}
    part = (rank % expert) * 4 // expert, (rank % expert + 1) * 4 // expert  # this rank's experts
    return loss, {n: before[n] - after[n] for n in after}, part


def _both(degrees: list[int]) -> list:
    return [_expert_step(expert) for expert in degrees]


def test_expert_parallel_equals_one_process():
    """Each fails with the expert gradients divided by the ranks holding the same experts only."""
    want_loss, want_grads = _truth(FAMILY, True, WORLD)
    results = run(_both, WORLD, [4, 2], timeout=300)
    for loss, grads, (lo, hi) in (r for rank_results in results for r in rank_results):
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        assert set(grads) == set(want_grads), set(grads) ^ set(want_grads)
        for name, want in want_grads.items():
            want = want[lo:hi] if "experts." in name else want
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-5, msg=name)
