"""The expert axis beyond one step (issue 47): checkpoints across expert degrees, loaders, LoRA.

A tiny Qwen3-MoE (a dense first layer, four experts in the second), four gloo ranks.
Checkpoints: one ZeroOptimizer (ZeRO-1) Adam over expert_param_groups (the README's recipe: the
experts in a param group reduced over their own ranks), saved with save_state(HandParts(module, opt))
by global name; written at expert 2 the run resumes at expert 4, written at expert 1 (experts whole, one
ZeroOptimizer) and at expert 4 it resumes at expert 2 (the dense parameters under ZeRO-3 then); written
at expert 2 it resumes at expert 2 x sequence 2 (each rank one slice of every row) and at expert 2 x
tensor 2 (attention split by heads, the MoE block on each tensor rank's share of the tokens), and written
at each of those at expert 4; written at expert 2 it resumes at expert 1 x tensor 2 under ZeRO-3 (each MoE
block's parameters reduced and sharded over data x tensor), written there at expert 4: the losses (at
expert 2 x sequence 2 from the start too) and after the resume equal the uninterrupted expert-2 run's
within 1e-5, and a checkpoint of the last step (every weight and Adam
moment, whole, by name) equals the uninterrupted run's.
Loaders: under Grid(pipe=2, expert=2) (data 1) and Grid(expert=2) (data 2) the GPT job's token
batches feed the MoE, whose loss and gradients (one SGD step of rate 1) equal transformers' on the union of the rows; initialize's sampler and the fine-tuning
job's packed rows are split by data x expert rank too. LoRA on the attention with the experts split
(frozen, no target) equals peft in one process (losses and adapters), at expert 2 x data 2. A list of
optimizers that cannot be saved as one is refused, naming why.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from harness import run  # noqa: E402
from peft_start import peft_start, peft_train  # noqa: E402

WORLD, VOCAB, SEQ, BATCH = 4, 256, 8, 4  # byte tokens: the GPT job's batches feed the model as they are
STEPS, SAVED_AT, LR = 4, 2, 1e-3
# attention and the dense layer's MLP: by a pattern, since peft maps the names gate_proj / up_proj / down_proj
# onto a MoE's fused expert weights as well (a rank_pattern on gate_up_proj), which the pipeline's LoRA skips
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the attention: peft 0.21 maps any MLP name of a Qwen3-MoE
# (gate_proj, up_proj, down_proj, the dense layer's too) onto the fused experts (target_parameters), which
# the pipeline's LoRA does not adapt, so the dense MLP has no peft truth here


def _base(router: bool = True):
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[0],
        output_router_logits=router, router_aux_loss_coef=0.5, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # no router all zeros, no norm one
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _mine(x: torch.Tensor, grid) -> torch.Tensor:
    share = x.shape[0] // grid.data_expert_size
    return x[grid.data_expert_rank * share:(grid.data_expert_rank + 1) * share]


# -- (a) checkpoints across expert degrees ------------------------------------------------------------

def _adam_job(expert: int, stage: int = 1, sequence: int = 1, tensor: int = 1):
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.pipe.expert import expert_param_groups, shard_experts
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs, hf_tensor_plan
    from pipezero.topology import Grid
    from pipezero.train.checkpoint.state_parts import HandParts
    from pipezero.zero import ZeroOptimizer

    grid = Grid(expert=expert, sequence=sequence, tensor=tensor)  # data = WORLD / (expert x sequence x tensor)
    module = PipelineModule(hf_layer_specs(_base()), grid=grid, loss_fn=causal_lm_loss, partition_method="uniform",
                            tensor_plan=hf_tensor_plan() if tensor > 1 else None)
    if expert > 1:  # expert 1: the experts whole, dense parameters like the rest
        assert shard_experts(module, grid.expert_group) == 1
    opt = ZeroOptimizer(torch.optim.Adam(expert_param_groups(module, grid, lr=LR)), stage=stage,
                        group=grid.data_sequence_group, module=module if stage == 3 else None)
    rows = OneFOneB(num_microbatches=BATCH // grid.data_expert_size)  # one row a microbatch
    return HandParts(module, opt, grid=grid), PipelineRunner(module, rows, optimizer=opt)


def _train(parts, runner, start: int, stop: int) -> list[float]:
    from pipezero.pipe.sequence import shard_batch, whole_positions

    grid, losses = parts.grid, []
    for step in range(start, stop):
        ids, targets = (_mine(t, grid) for t in _rows(step))
        batch = shard_batch((ids, None, whole_positions(ids)), targets, grid) if grid.sequence_size > 1 else (
            ids, targets)  # a sequence split: each rank one slice of every row
        losses.append(runner.train_step(*batch).item())
        parts.optimizer.step()
        parts.optimizer.zero_grad()
    return losses


def _resumes(root: str) -> dict[str, list[float]]:
    """The uninterrupted expert-2 run, and each (saved at, resumed at) pair's losses; every run's last step
    saved under root (a collective, every rank)."""
    from pipezero.train.checkpoint.state import load_state, save_state

    parts, runner = _adam_job(2)
    out = {"2": _train(parts, runner, 0, SAVED_AT)}
    save_state(parts, f"{root}/at2", SAVED_AT)
    out["ref"] = out["2"] + _train(parts, runner, SAVED_AT, STEPS)
    save_state(parts, f"{root}/ref", STEPS)
    # some resumed under ZeRO-3 (a stage may differ); "2s": expert 2 x sequence 2 (data 1), "2t": x tensor 2,
    # "1t": expert 1 x tensor 2 (data 2: each MoE block's parameters sharded over data x tensor)
    for saved, resumed in ((2, 4), (1, 2), (4, 2), (2, "2s"), ("2s", 4), (2, "2t"), ("2t", 4), (2, "1t"), ("1t", 4)):
        if saved != 2:
            parts, runner = _job(saved)
            out[str(saved)] = _train(parts, runner, 0, SAVED_AT)
            save_state(parts, f"{root}/at{saved}", SAVED_AT)
        parts, runner = _job(resumed, stage=3 if saved in (4, "2s", "2t", "1t") or resumed == "1t" else 1)
        assert load_state(parts, f"{root}/at{saved}")["step"] == SAVED_AT
        out[f"{saved}->{resumed}"] = _train(parts, runner, SAVED_AT, STEPS)
        save_state(parts, f"{root}/{saved}-{resumed}", STEPS)
    return out


def _job(layout: int | str, stage: int = 1):
    """_adam_job at expert N, "Ns": expert N x sequence 2, or "Nt": expert N x tensor 2 (each MoE block on its
    tensor rank's share of the tokens)."""
    split = str(layout)[-1]
    return _adam_job(int(str(layout).rstrip("st")), stage, 2 if split == "s" else 1, 2 if split == "t" else 1)


PAIRS = ("2-4", "1-2", "4-2", "2-2s", "2s-4", "2-2t", "2t-4", "2-1t", "1t-4")  # saved at, resumed at


def test_checkpoint_resumes_across_expert_degrees(tmp_path):
    """Each fails on main: the expert slices were saved as frozen weights by every expert rank under one
    name (no Adam state), and loaded onto another degree's slices."""
    from pipezero.train.checkpoint import load_checkpoint

    results = run(_resumes, WORLD, str(tmp_path), timeout=300)
    ref = load_checkpoint(tmp_path / "ref").tensors
    kept = sorted(k for k in ref if k.startswith(("model/", "optim/")))
    assert any(".experts." in k and k.endswith("exp_avg") for k in kept)
    for out in results:
        for saved in ("1", "4", "2s", "2t", "1t"):
            np.testing.assert_allclose(out[saved], out["ref"][:SAVED_AT], rtol=0, atol=1e-5, err_msg=saved)
        for pair in PAIRS:
            np.testing.assert_allclose(out[pair.replace("-", "->")], out["ref"][SAVED_AT:], rtol=0, atol=1e-5,
                                       err_msg=pair)
    for pair in PAIRS:
        got = load_checkpoint(tmp_path / pair).tensors
        assert sorted(k for k in got if k.startswith(("model/", "optim/"))) == kept, pair
        atol = 1e-7 if "t" in pair else 1e-8  # a tensor split sums attention's output in another order: ~2e-8 off
        for key in kept:
            torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=atol, msg=lambda m: f"{pair} {key}: {m}")


# -- (b) the loaders read by data x expert rank -----------------------------------------------------------

def _fed_by_the_loaders() -> list[tuple]:
    """Per grid: the loss and each gradient by Hugging Face name (one SGD step of rate 1) of the MoE fed by the
    GPT job's token batches, this rank's experts, initialize's sampler indices and the fine-tuning rows."""
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.pipe.expert import expert_param_groups, shard_experts
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.hf.layers import _HFLayer
    from pipezero.topology import Grid
    from pipezero.train.data import MemoryCorpus
    from pipezero.train.finetune import batches
    from pipezero.train.gpt.job import token_batches
    from pipezero.train.initialize import _data_loader
    from pipezero.zero import ZeroOptimizer

    out = []
    for sizes in (dict(pipe=2, expert=2), dict(expert=2)):
        grid = Grid(**sizes)
        per_rank = BATCH // grid.data_expert_size
        ids, targets = token_batches(SimpleNamespace(data_path=None, seq_len=SEQ), per_rank, grid)[0].next_batch()
        module = PipelineModule(hf_layer_specs(_base()), grid=grid, loss_fn=causal_lm_loss,
                                partition_method="uniform")
        shard_experts(module, grid.expert_group)  # at pipe 2 the first stage holds the dense layer only
        opt = ZeroOptimizer(torch.optim.SGD(expert_param_groups(module, grid, lr=1.0)), stage=1,
                            group=grid.data_sequence_group)
        runner = PipelineRunner(module, OneFOneB(num_microbatches=per_rank), optimizer=opt)
        named = {n: p for layer in module.modules() if isinstance(layer, _HFLayer) for n, p in layer.hf_parameters()}
        before = {n: p.detach().clone() for n, p in named.items()}
        loss = runner.train_step(ids, targets)
        opt.step()
        grads = {n: before[n] - p.detach() for n, p in named.items()}
        parts = SimpleNamespace(grid=grid, config=SimpleNamespace(batch=SimpleNamespace(
            micro_batch_size=2, per_rank_batch_size=2, accumulation_steps=1)))
        sampled = [int(i) for batch in _data_loader(list(range(16)), None, parts) for i in batch]
        args = SimpleNamespace(seq_len=SEQ, packing=True, long_docs="split", data=None, seed=0, val_fraction=0.2)
        corpus = MemoryCorpus([np.arange(3, 3 + n) + 10 * i for i, n in enumerate([5, 7, 6, 8] * 10)])
        packed = batches(args, parts, corpus, 0)[0].next_batch()[0][0]
        out.append((loss, grads, grid.expert_rank, sampled, packed, grid.data_expert_rank))
    return out


def _truth_on_the_union() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' loss (its load-balancing term as it adds it) and gradients on the global batch, one
    microbatch per row (as each grid takes them)."""
    from pipezero.pipe.hf import causal_lm_loss
    from pipezero.train.data import ShardedBatches, TokenData

    ids, targets = ShardedBatches(TokenData.stdlib(SEQ), BATCH, 0, 1, split="train").next_batch()
    model, losses = _base(), []
    for row in range(BATCH):
        out = model(ids[row:row + 1])
        loss = causal_lm_loss(out.logits, targets[row:row + 1]) + model.config.router_aux_loss_coef * out.aux_loss
        (loss / BATCH).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in model.named_parameters()}


def test_loaders_read_by_data_x_expert_rank():
    """Each fails with the loaders reading by data rank: two expert ranks of one data index take the same rows."""
    results = run(_fed_by_the_loaders, WORLD, timeout=300)
    want_loss, want_grads = _truth_on_the_union()
    for case in range(2):
        sampled, packed, grads = {}, {}, {}
        for rank_results in results:
            loss, rank_grads, held, indices, rows, reader = rank_results[case]
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
            for name, value in rank_grads.items():
                want = want_grads[name][held * 2:(held + 1) * 2] if ".experts." in name else want_grads[name]
                torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
                grads[name] = value
            assert sampled.setdefault(reader, indices) == indices and packed.setdefault(reader, rows).equal(rows)
        assert set(grads) == set(want_grads)
        readers = len(sampled)
        assert readers == {0: 2, 1: 4}[case] and sorted(i for s in sampled.values() for i in s) == list(range(16))
        assert len({tuple(r.reshape(-1).tolist()) for r in packed.values()}) == readers  # each its own rows


# -- (c) LoRA on the attention, the experts split --------------------------------------------------

def _peft_config():
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)


def _peft_truth(root: str) -> dict:
    """The base and its starting adapters (B non-zero) on disk; peft's losses and adapters, one process, AdamW."""
    model = peft_start(_base(router=False), _peft_config(), root)
    losses, adapters = peft_train(model, (_rows(step) for step in range(2)), lr=1e-2)
    return {"losses": losses, "adapters": adapters}


def _lora_with_split_experts(root: str) -> tuple:
    """Grid(expert=2) (data 2): the losses and every adapter of the LoRA model with its experts split."""
    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.pipe.expert import expert_parameters, shard_experts
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.lora import adapter_state_dict, lora_specs, trainable_parameters
    from pipezero.topology import Grid
    from pipezero.train.checkpoint.lora_export import load_peft_adapter
    from pipezero.zero import ZeroOptimizer

    grid = Grid(expert=2)
    model = PipelineModule(lora_specs(hf_layer_specs(f"{root}/base"), _peft_config()), grid=grid,
                           loss_fn=causal_lm_loss, partition_method="uniform")
    assert shard_experts(model, grid.expert_group) == 1
    assert all(not p.requires_grad for p in expert_parameters(model))  # the experts are no target: frozen
    assert load_peft_adapter(model, f"{root}/start")
    opt = ZeroOptimizer(torch.optim.AdamW(trainable_parameters(model), lr=1e-2), stage=1,
                        group=grid.data_sequence_group)
    runner = PipelineRunner(model, OneFOneB(num_microbatches=1), optimizer=opt)
    losses = []
    for step in range(2):
        ids, targets = _rows(step)
        losses.append(runner.train_step(_mine(ids, grid), _mine(targets, grid)).item())
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        opt.step()
        opt.zero_grad()
    return losses, {n: t.clone() for n, t in adapter_state_dict(model).items()}


def test_lora_with_split_experts_equals_peft(tmp_path):
    """The experts split under LoRA (frozen, their stacked weights no target): the adapters train as peft's."""
    truth = _peft_truth(str(tmp_path))
    for losses, adapters in run(_lora_with_split_experts, WORLD, str(tmp_path), timeout=300):
        np.testing.assert_allclose(losses, truth["losses"], rtol=0, atol=1e-5)
        assert set(adapters) == set(truth["adapters"])
        for name, want in truth["adapters"].items():
            torch.testing.assert_close(adapters[name], want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_list_of_optimizers_that_cannot_save_as_one_is_refused():
    """One process: a parameter in two optimizers, a second chain with state of its own (a loss scale), an
    empty list or a non-optimizer in it: each named before anything is saved."""
    from pipezero.precision import LossScaler
    from pipezero.train.checkpoint.by_name import by_name
    from pipezero.train.checkpoint.state_parts import HandParts

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"a parameter of shape \(2, 2\) is in optimizers 0 and 1"):
        by_name([torch.optim.SGD(a.parameters()), torch.optim.SGD([a.weight])])
    with pytest.raises(TypeError, match=r"optimizers after the first keep state of their own in \['LossScaler'\]"):
        by_name([torch.optim.SGD(a.parameters()), LossScaler(torch.optim.SGD(b.parameters()))])
    assert len(by_name([LossScaler(torch.optim.SGD(a.parameters())), torch.optim.SGD(b.parameters())])
               .full_parameters()) == 4
    with pytest.raises(TypeError, match=r"HandParts\(optimizer=\[\]\)"):
        HandParts(a, [])
    with pytest.raises(TypeError, match=r"HandParts\(optimizer=\['Linear'\]\)"):
        HandParts(a, [torch.optim.SGD(a.parameters()), b])
