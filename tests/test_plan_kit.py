"""The planner's memory kit and expert axis: predicted peaks against the H100 measurements, the kit it
picks at long sequences, a Hugging Face block's saved bytes against autograd, MoE layouts and traffic.

No process group: arithmetic over the planner's model (the autograd count runs one layer on CPU).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from pipezero.train.plan import kit_table, plan, predict
from pipezero.train.plan.hardware import h100, h200
from pipezero.train.plan.layout import Layout, enumerate_layouts
from pipezero.train.plan.memory import rank_memory
from pipezero.train.plan.model import ModelShape, flops_profile, total_params
from pipezero.train.plan.step_time import expert_all_to_all_seconds

GIB = 2**30

# bench/live_tensors.py's extrapolation of the offloaded run (pipezero-offload: every layer checkpointed, its
# input in pinned host memory) to TinyLlama's shape, for the code since memlive (norms in row tiles past 64K,
# grouped k/v to SDPA as they are, one split for tiles and documents): `python bench/live_tensors.py --run
# pipezero-offload --length L/32 --to L` (CPU, 2026-12-06; at 32K --length 16384 and 32768 read the same:
# the norms are whole there).
# L/32 keeps the norms' tile count (NORM_TILE 512 scaled rows stand for 16,384). Only the offloaded run: its
# extrapolation counts the scaled model's 6 checkpointed inputs, not 22, so the other runs' would be low.
LIVE_TENSORS_GIB = {32768: 10.55, 131072: 13.51, 524288: 29.03, 1048576: 49.72}
# The offloaded run measured on one H100 (torch.cuda.max_memory_allocated, torch 2.11, main at 67a7764,
# bench/RESULTS.md of 2026-12-07) where a step after the first was timed (the 1M run's only step was a first
# one, before AdamW's state: 45.99 GiB).
H100_GIB = {32768: 10.71, 524288: 29.39}


def tinyllama(seq_len: int) -> ModelShape:
    """bench/long_context.py's "tinyllama" shape as `from_hf_config` reads a LlamaConfig of it."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4)
    return ModelShape.from_hf_config(config, seq_len)


def _bench_peak(run: str, seq_len: int) -> float:
    """The model's peak for the bench's run: one stage, one packed row, bf16 weights and torch AdamW on them
    (its moments in bf16: 4 bytes a parameter; foreach's one bf16 temporary in the step), no reserve
    (max_memory_allocated counts tensors only)."""
    shape = tinyllama(seq_len)
    profile = flops_profile(shape, 1.0)
    layout = Layout(1, 1, 1, "1f1b", 1, 1, 1, 0, False, 0 if run == "pipezero" else 1,
                    host_inputs=run == "pipezero-offload")
    mem = rank_memory(profile, range(len(profile)), 1.0, layout, replace(h100(1, 1), reserved_gb=0.0), "bf16",
                      shape.d_model, seq_len)
    n = total_params(profile)
    return replace(mem, optimizer=4.0 * n, step=2.0 * n).total / GIB


@pytest.mark.parametrize("seq_len", sorted(LIVE_TENSORS_GIB))
def test_offloaded_peak_is_within_5_percent_of_the_live_tensors(seq_len):
    live = LIVE_TENSORS_GIB[seq_len]
    predicted = _bench_peak("pipezero-offload", seq_len)
    assert predicted == pytest.approx(live, rel=0.05), (seq_len, predicted)


@pytest.mark.parametrize("seq_len", sorted(H100_GIB))
def test_offloaded_peak_is_within_5_percent_of_the_h100s(seq_len):
    predicted = _bench_peak("pipezero-offload", seq_len)
    assert predicted == pytest.approx(H100_GIB[seq_len], rel=0.05), (seq_len, predicted)


def test_the_kit_the_plan_picks_is_the_fastest_that_fits():
    """On one H100 at 32K nothing needs checkpointing (the fastest fits); at 512K with the optimizer on the host
    the device holds the last layers whole, so only the first 22 of the 25 are checkpointed (less recompute
    than the inputs on the host, next); at 1M only checkpointed inputs in host memory fit, and the table says
    which choices do not; 2M does not fit."""
    hw = h100(1, 1)
    for seq_len, recompute, host, first, misfits in ((32768, "none", False, None, 0), (524288, "full", False, 22, 3),
                                                     (1048576, "full", True, None, 4)):
        shape = tinyllama(seq_len)
        profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
        preds = plan(shape, profile, hw, 1, "bf16", top=3)
        best = preds[0].layout
        assert (best.recompute, best.host_inputs, best.checkpoint_layers) == (recompute, host, first), best.label
        table = kit_table(profile, preds[0])
        assert table.count("does not fit") == misfits, table
    shape = tinyllama(524288)
    profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
    twin = plan(shape, profile, hw, 1, "bf16", top=1)[0]
    every, fewer = (predict(profile, replace(twin.layout, checkpoint_layers=n), hw, shape, "bf16") for n in (None, 21))
    assert every.fits and every.tokens_per_second < twin.tokens_per_second  # each recompute costs
    assert not fewer.fits and twin.fits  # 22 is the fewest the device holds
    with pytest.raises(ValueError, match="no layout"):
        plan(tinyllama(2 * 1048576), flops_profile(tinyllama(2 * 1048576), 1e15), hw, 1, "bf16", top=3)


def test_a_tiled_layers_recompute_is_its_forward_less_the_mlp(monkeypatch):
    """Full checkpointing adds one forward of each layer to the step, but where the MLP runs in row tiles the
    recompute stops before them (they recompute themselves, tiled or not checkpointed): the MLP's share of
    the forward is not counted twice (the runtime: tests/test_long_context.py counts the matmuls)."""
    from pipezero.train.plan import memory

    hw = h100(1, 1)
    shape = tinyllama(32768)
    profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)

    def added() -> float:  # what checkpointing every layer adds to the step
        steps = [predict(profile, Layout(1, 1, 1, "1f1b", 1, 1, 1, 0, False, k), hw, shape, "bf16").time.total
                 for k in (0, 1)]
        return steps[1] - steps[0]

    tiled = added()
    monkeypatch.setattr(memory, "TILE_FROM_ROWS", 10**9)  # the MLP whole at this length
    mlp = sum(p.seconds / 3 * p.mlp_flops / p.flops for p in profile if p.act_tiled) * 32768 * hw.compute_slowdown
    assert mlp > 0.1 * added()
    assert tiled == pytest.approx(added() - mlp, rel=1e-6)


def test_pipezero_plan_reads_a_hugging_face_config_and_prints_the_finetune_line(tmp_path, capsys):
    from transformers import LlamaConfig

    from pipezero.train.cli import main

    LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4).save_pretrained(tmp_path / "tinyllama")
    config = tmp_path / "ds.json"
    assert main(["plan", "--hardware", "h100", "--gpus-per-node", "1", "--hf-config", str(tmp_path / "tinyllama"),
                 "--seq-len", "1048576", "--global-batch", "1", "--precision", "bf16", "--top", "1",
                 "--write-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "ck1+h" in out and "full, every 1 layer, its inputs in pinned host memory" in out, out
    assert (f"pipezero finetune --nproc 1 --model {tmp_path / 'tinyllama'} --data DATA --seq-len 1048576 --config "
            f"{config} --activation-checkpointing full --offload-activations") in out, out
    from pipezero.train.config import parse_config

    parsed = parse_config(json.loads(config.read_text()), world_size=1)
    assert parsed.recompute.mode == "full" and parsed.recompute.offload and parsed.recompute.offload_layers is None
    # 80 GB of host memory: all 23 inputs (109 GB) do not fit it; the first 18 layers' do, the rest on the device
    assert main(["plan", "--hardware", "h100", "--gpus-per-node", "1", "--hf-config", str(tmp_path / "tinyllama"),
                 "--seq-len", "1048576", "--global-batch", "1", "--precision", "bf16", "--top", "1",
                 "--write-config", str(config), "--host-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "ck1+h18" in out and "full, every 1 layer, the first 18 layers' inputs in pinned host memory" in out, out
    assert "--offload-activations --offload-activation-layers 18" in out, out
    parsed = parse_config(json.loads(config.read_text()), world_size=1)
    assert parsed.recompute.offload and parsed.recompute.offload_layers == 18


def _saved_bytes_per_layer(layers: int, tokens: int) -> float:
    """Bytes autograd keeps in the forward of a tiny Llama's decoder layers, as pipezero runs them (bf16) on a
    row of packed documents (each attended alone, grouped key/value heads as they are: CPU's SDPA takes them)."""
    from transformers import LlamaConfig

    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.topology import Grid

    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=tokens)
    module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=Grid(pipe=1), loss_fn=causal_lm_loss,
                            compile=False).to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, tokens))
    saved, params = {}, {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module((ids, None, torch.arange(128).repeat(tokens // 128)[None]))  # packed documents, as the bench's
    return sum(v for k, v in saved.items() if k not in params)


def test_a_hugging_face_blocks_saved_bytes_match_autograd(monkeypatch):
    """layers.py's count of a Llama block (fp32 norms whole, then in row tiles; key/value heads as SDPA takes
    them, grouped; the gated MLP whole) against what autograd keeps for one more decoder layer."""
    from pipezero.pipe import tiled_mlp

    tokens = 512
    shape = ModelShape(layers=1, d_model=128, heads=4, kv_heads=1, intermediate=352, vocab=128, seq_len=tokens,
                       family="llama")
    block = flops_profile(shape, 1.0)[1]
    for norms_tiled in (False, True):
        if norms_tiled:  # 4 tiles of 128 rows
            monkeypatch.setattr(tiled_mlp, "NORM_TILE_FROM_ROWS", 1)
            monkeypatch.setattr(tiled_mlp, "NORM_TILE_ROWS", 128)
        per_layer = _saved_bytes_per_layer(3, tokens) - _saved_bytes_per_layer(2, tokens)
        model = block.act_bytes("bf16", norms_tiled=norms_tiled) * tokens
        assert model == pytest.approx(per_layer, rel=0.002), (norms_tiled, model, per_layer)
    # where the kernel needs equal heads (CUDA's in fp32) k and v are repeated: act_kv_repeat elements more
    from pipezero.pipe import document_attention

    monkeypatch.setattr(document_attention, "_grouped_kernel", lambda q, k, v: False)
    per_layer = _saved_bytes_per_layer(3, tokens) - _saved_bytes_per_layer(2, tokens)
    model = (block.act_bytes("bf16", norms_tiled=True) + block.act_kv_repeat * 2) * tokens
    assert model == pytest.approx(per_layer, rel=0.002), (model, per_layer)


# --- the expert axis (issue 47) ---

QWEN_MOE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                num_experts_per_tok=2)


def moe_shape(seq_len: int = 1024) -> ModelShape:
    from transformers import Qwen3MoeConfig

    return ModelShape.from_hf_config(Qwen3MoeConfig(**QWEN_MOE), seq_len)


def test_a_moe_config_gives_experts_and_expert_layouts():
    shape = moe_shape()
    assert (shape.experts, shape.top_k, shape.moe_intermediate) == (8, 2, 256)
    block = flops_profile(shape, 1.0)[1]
    assert block.expert_params == 8 * 3 * 512 * 256
    layouts = list(enumerate_layouts(8, 8, 16, 6, shape.heads, seq_len=shape.seq_len, experts=shape.experts))
    assert {lay.expert for lay in layouts} == {1, 2, 4, 8}
    assert any(lay.expert > 1 and lay.tensor > 1 for lay in layouts)  # experts beside a tensor split
    assert all(lay.expert * lay.sequence * lay.tensor <= 8 for lay in layouts)  # the expert group inside the node
    for lay in layouts:
        assert lay.world == 8 and lay.replicas * lay.microbatches * lay.microbatch_size == 16, lay
        assert lay.reducing == lay.data * lay.expert * lay.sequence
    assert " e2 " in replace(layouts[0], expert=2).label


def test_experts_memory_divides_by_the_expert_degree():
    shape, hw = moe_shape(), h200(1, 8)
    profile = flops_profile(shape, 1e15)
    one, four = (rank_memory(profile, range(len(profile)), 1.0, Layout(1, 8 // e, 1, "1f1b", 1, 2, 1, 1, expert=e),
                             hw, "bf16", shape.d_model, shape.seq_len) for e in (1, 4))
    experts = shape.layers * flops_profile(shape, 1.0)[1].expert_params
    # bf16 parameters and gradients (2 + 2 bytes) of 3/4 of the experts leave the rank; their fp32 state
    # is sharded over the ranks holding the same experts (zero/reduction.py), the dense over 8 either way
    assert one.params - four.params == pytest.approx(2 * experts * 3 / 4)
    assert (one.grads - four.grads) == pytest.approx(2 * experts * 3 / 4)
    assert one.optimizer == pytest.approx(four.optimizer)  # ZeRO-1: every expert's state over 8 ranks in both


def test_experts_beside_a_tensor_split_stay_whole_on_each_tensor_rank():
    """A MoE block beside a tensor split runs on each tensor rank's share of the tokens with whole experts
    (pipe/tensor_tokens.py): they were counted split t ways, their state sharded over data x sequence only,
    and each tensor rank dispatching every token."""
    from pipezero.train.plan.model import held_experts
    from pipezero.train.plan.step_time import data_parallel_seconds, expert_all_to_all_seconds, ring_seconds

    shape, hw = moe_shape(), h200(1, 8)
    profile = flops_profile(shape, 1e15)
    experts = shape.layers * flops_profile(shape, 1.0)[1].expert_params
    flat, split = Layout(1, 2, 1, "1f1b", 1, 2, 1, 1, expert=4), Layout(1, 1, 2, "1f1b", 1, 2, 1, 1, expert=4)
    assert held_experts(profile, range(len(profile)), 2, 4) == pytest.approx(experts / 4)
    assert (flat.expert_holders, split.expert_holders) == (2, 2)  # data 2; data 1 x tensor 2
    whole = rank_memory(profile, range(len(profile)), 1.0, split, hw, "bf16", shape.d_model, shape.seq_len)
    assert whole.params > 2 * experts / 4  # bf16 experts, a quarter of them, whole beside the halved dense part
    a2a = [expert_all_to_all_seconds(lay, hw, "bf16", shape.d_model, shape.seq_len, shape.top_k) for lay in
           (flat, split)]
    assert a2a[1] < a2a[0]  # each tensor rank dispatches half the tokens
    # the winner's finetune line names the tensor degree (it is no ds_config key; the expert degree is)
    from types import SimpleNamespace

    from pipezero.train.plan.cli import _finetune_line

    args = SimpleNamespace(hf_config="moe/config.json", seq_len=1024)
    line = _finetune_line(args, SimpleNamespace(layout=split), "ds.json")
    assert line == "pipezero finetune --nproc 8 --model moe --data DATA --seq-len 1024 --config ds.json --tensor 2"
    # without an expert axis the whole experts' gradients are summed over the tensor group with their data
    # reduction, once a step (they were all-reduced over it in every micro-batch's backward: 2 more at m=4)
    whole_experts = Layout(1, 4, 2, "1f1b", 1, 2, 1, 1)
    assert whole_experts.expert_holders == 8  # data 4 x tensor 2
    steps = [data_parallel_seconds(1e9, replace(whole_experts, microbatches=m), hw, "bf16", 0.0, 0.0, 1, experts)[0]
             for m in (2, 4)]
    assert steps[1] == pytest.approx(steps[0])
    dense = ring_seconds(2 * (1e9 - experts), 4, *hw.link(8), 1.0)  # ZeRO-1: reduce-scattered, gathered
    assert steps[0] == pytest.approx(2 * dense + ring_seconds(2 * experts, 8, *hw.link(8), 2.0))


def test_adam_steps_the_experts_shard_of_their_own_zero_group():
    """Under ZeRO 1-3 the experts' state is sharded over the ranks holding the same experts (expert_param_groups'
    zero_group), as rank_memory counts it; the optimizer's time counted them whole on every rank."""
    from pipezero.train.plan.step_time import optimizer_seconds

    hw, params, experts = h200(1, 8), 1e9, 6e8
    lay = Layout(1, 2, 2, "1f1b", 1, 2, 1, 1, expert=2)  # dense over data x expert 4, experts over data x tensor 4
    assert (lay.reducing, lay.expert_holders) == (4, 4)
    want = ((params - experts) / 4 + experts / 4) * hw.optimizer_ns_per_param * 1e-9
    assert optimizer_seconds(params, lay, hw, "bf16", experts) == pytest.approx(want)
    unsharded = replace(lay, zero=0)
    assert optimizer_seconds(params, unsharded, hw, "bf16", experts) == pytest.approx(params * hw.optimizer_ns_per_param
                                                                                      * 1e-9)


def test_expert_all_to_all_bytes_and_time_in_the_step():
    """Dispatch and combine per MoE block: tokens x hidden x top-k x bytes, (E-1)/E of it sent, E-1 latencies;
    2 forward and 2 backward per micro-batch."""
    shape, hw = moe_shape(), h200(1, 8)
    profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
    e, m, b = 4, 3, 2
    lay = Layout(1, 2, 1, "1f1b", 1, m, b, 0, expert=e)
    nbytes = b * shape.seq_len * shape.d_model * shape.top_k * 2
    one = (e - 1) / e * nbytes / (hw.intra_gbps * 1e9) + (e - 1) * hw.intra_latency_us * 1e-6
    assert expert_all_to_all_seconds(lay, hw, "bf16", shape.d_model, shape.seq_len, shape.top_k) == pytest.approx(one)
    split, whole = (predict(profile, replace(lay, expert=x, data=8 // x), hw, shape, "bf16").time for x in (e, 1))
    assert split.expert_comm == pytest.approx(shape.layers * m * 4 * one) and whole.expert_comm == 0
    assert split.compute > whole.compute  # the exchanges are not hidden (no DualPipeV overlap yet)


# --- host memory (issue 45: the planner counted only the device's) ---

def _host_peak(tracker) -> int:
    """The most bytes of host allocations (LiveTensors.host()) alive at once."""
    events = sorted([(a.born, a.nbytes) for a in tracker.allocs if a.host]
                    + [(a.died + 1, -a.nbytes) for a in tracker.allocs if a.host and a.died >= 0])
    running, best = 0, 0
    for _, delta in events:
        running += delta
        best = max(best, running)
    return best


def _distinct_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("first", [None, 3])
def test_host_bytes_are_what_the_offloads_hold(first):
    """A tiny Llama in bf16, every layer checkpointed with its input offloaded (or, `first`, the first three
    layers': the embedding's token ids and two decoder layers' hidden states), two micro-batches in flight,
    under ZeroOptimizer(stage 1, offload_optimizer) over AdamW, one step on CPU: the planner's host bytes are
    the offloaded inputs alive at once (every allocation tracked, bench/live_tensors.py) and the tensors the
    offloaded optimizer keeps (fp32 masters, their gradients, Adam's moments), the masters and gradients
    each a pinned block on a GPU (a power of two bytes). On CPU the gradient lands in the fp32 sum where a
    GPU lands it in a pinned fp32 buffer, the same 4 bytes at stage 1."""
    from transformers import LlamaConfig

    from bench.live_tensors import LiveTensors, simulated_offload
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid
    from pipezero.train.plan.memory import host_bytes, pinned
    from pipezero.zero import ZeroConfig, ZeroOptimizer

    tokens, micro = 512, 2
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=tokens)
    module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=Grid(pipe=1), loss_fn=causal_lm_loss,
                            recompute=RecomputeConfig(mode="full", offload=True, offload_layers=first)
                            ).to(torch.bfloat16)
    opt = ZeroOptimizer(torch.optim.AdamW(module.parameters()),  # the bucket size the planner's ds_config sets
                        config=ZeroConfig(stage=1, offload_optimizer=True, reduce_bucket_size=64 * 64))
    ids = torch.randint(0, 64, (micro, 1, tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens).remainder(128)[None]
    tracker = LiveTensors()
    with tracker, simulated_offload(tracker):  # both forwards before either backward: two in flight
        losses = [module.loss(module((row, None, positions)), row) for row in ids]
        sum(losses).backward()
    opt.step()
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert len(masters) > 3  # several buckets
    # on a GPU each master and its gradient's landing is a pinned block of a power of two bytes
    held = (sum(pinned(t.untyped_storage().nbytes()) for t in masters + [p.grad for p in masters])
            + _distinct_bytes([t for s in opt.state.values() for t in s.values() if t.numel() > 1]))

    shape = ModelShape.from_hf_config(config, tokens)
    profile = flops_profile(shape, 1.0)
    layout = Layout(1, 1, 1, "1f1b", 1, micro, 1, 1, True, 1, host_inputs=True, host_layers=first)
    planned = host_bytes(profile, range(len(profile)), float(micro), layout, h100(1, 1), "bf16", shape.d_model,
                         tokens)
    # each micro-batch's decoder layers' and final norm's inputs, and the fused head's copy, dropped at once
    held_inputs = micro * (3 + 1) + 1 if first is None else micro * (first - 1)
    assert planned.inputs == _host_peak(tracker) == held_inputs * tokens * 64 * 2
    assert planned.optimizer == held
    assert planned.reserved == h100(1, 1).host_reserved_gb * 1e9


def llama8b(seq_len: int) -> ModelShape:
    """The Llama-3-8B shape as issue 45's reproduction writes its config.json."""
    return ModelShape.from_hf_config({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                                      "intermediate_size": 14336, "num_hidden_layers": 32,
                                      "num_attention_heads": 32, "num_key_value_heads": 8,
                                      "tie_word_embeddings": False}, seq_len, name="l8b")


def test_a_layout_fits_only_where_the_host_holds_what_it_offloads(tmp_path):
    """The 8B shape at 512K tokens on one H200: the only layout the device holds (z1 off ck1+h, 79.6 GB) keeps
    its optimizer (16 B/param, in pinned blocks 135 GB) and 33 checkpointed inputs (the decoder layers' and the
    final norm's) and the fused head's brief copy (146 GB) on the host; with 1 TB it wins, with 120 GB (one GPU
    in a 128 GiB machine) nothing fits and the error says host memory. A layout that offloads nothing plans the
    same whatever the host."""
    from pipezero.train.cli import main

    shape, hw = llama8b(524288), h200(1, 1)
    profile = flops_profile(shape, hw.peak_tflops * 1e12 * hw.efficiency)
    best = plan(shape, profile, replace(hw, host_memory_gb=1000.0), 1, "bf16", top=1)[0]
    assert best.layout.label == "p1 d1 t1 1f1b v1 m1x1 z1 off ck1+h" and best.memory.total < 141e9
    # 16 B/param, 128.5 GB, the masters and the landing in pinned blocks of powers of two: 135.1 GB
    assert best.memory.host.optimizer == pytest.approx(135.1e9, rel=1e-3) and total_params(profile) == 8030261248
    assert best.memory.host.inputs == 34 * 524288 * 4096 * 2
    with pytest.raises(ValueError, match=r"120 GB of host memory.* the least 2\d\d\.\d GB \(p1 d1 t1 1f1b v1 m1x1 "
                                         r"z1 off ck1\+h: optimizer 135, checkpointed inputs 146"):
        plan(shape, profile, replace(hw, host_memory_gb=120.0), 1, "bf16", top=1)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "tie_word_embeddings": False}))
    with pytest.raises(SystemExit, match="host memory"):
        main(["plan", "--hf-config", str(tmp_path), "--seq-len", "524288", "--global-batch", "1", "--precision",
              "bf16", "--hardware", "h200", "--gpus-per-node", "1", "--top", "5", "--host-memory-gb", "120"])
    with pytest.raises(SystemExit, match="--host-memory-gb 120.0 applies only to --hardware h100 / h200"):
        main(["plan", "--host-memory-gb", "120"])  # here the devices are the host: nothing is offloaded
    short, node = llama8b(8192), h200(1, 8)
    short_profile = flops_profile(short, node.peak_tflops * 1e12 * node.efficiency)
    lean, roomy = (plan(short, short_profile, replace(node, host_memory_gb=gb), 8, "bf16", top=3) for gb in (8, 1000))
    assert [(p.layout, p.tokens_per_second) for p in lean] == [(p.layout, p.tokens_per_second) for p in roomy]
    assert not lean[0].layout.offload and lean[0].memory.host.total == node.host_reserved_gb * 1e9


def test_a_nodes_ranks_share_its_host_memory():
    """Pipeline ranks in one node take its memory together: the fullest node's mean per device is what must fit
    (ranks are numbered pipe slowest, so a node holds one stage where the other axes fill it)."""
    from pipezero.train.plan import node_host
    from pipezero.train.plan.memory import HostBreakdown

    first, last = HostBreakdown(10.0, 20.0, 1.0), HostBreakdown(10.0, 0.0, 1.0)  # 1F1B: stage 0 keeps more inputs
    p2d4 = Layout(2, 4, 1, "1f1b", 1, 8, 1, 1, True, 1, host_inputs=True)
    assert node_host([first, last], p2d4, h200(1, 8)) == HostBreakdown(10.0, 10.0, 1.0)  # both stages in a node
    assert node_host([first, last], p2d4, h200(2, 4)) == first  # a node a stage: the first stage's node
    assert node_host([first, last], replace(p2d4, data=1), h200(1, 1)) == first


@pytest.mark.parametrize("stage, parts", [(1, 1), (2, 8), (3, 1)])
def test_the_offloaded_buckets_are_zeros(stage, parts):
    """The planner cuts a rank's parameters into ZeRO's buckets (whose pinned blocks round up to powers of two
    each) as zero/partition.py's plan_groups does, on the 8B's and TinyLlama's parameters (meta tensors)."""
    import transformers

    from pipezero.train.plan.memory import optimizer_shards
    from pipezero.zero.partition import plan_groups
    from pipezero.zero.reduction import Reduction

    for shape in (llama8b(4096), tinyllama(4096)):
        config = transformers.LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.d_model,
                                          intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        groups = [{"params": list(model.parameters())}]
        buckets = plan_groups(groups, shape.d_model ** 2, [Reduction(None, parts, 0, parts)], True,
                              model if stage == 3 else None, [float("inf")])
        profile = flops_profile(shape, 1.0)
        layout = Layout(1, parts, 1, "1f1b", 1, 1, 1, stage, True)
        assert optimizer_shards(profile, range(len(profile)), layout, shape.d_model) == \
            tuple(b.shard_numel for b in buckets), (shape.name, stage, parts)
