"""Long sequences in linear memory: packed documents without an s x s mask, the MLP and the loss in tiles.

Each against the masked / untiled truth (fp32, losses and gradients): pipe/document_attention.py
against SDPA with the block-diagonal mask; the GPT's packed rows against its masked Block; tiny
Llama, Qwen3 and Gemma 2 packed rows against transformers' own forward on the same packed
position ids (Gemma 2's soft-capped eager attention falls back to transformers' masks, and so
does a sliding-window layer whose window is shorter than a document), the MLP and the norms
tiled throughout; the Llama again checkpointed with its inputs offloaded, and under pipe 2 (1F1B) on
gloo. And the memory: the bytes autograd keeps for backward grow linearly with the packed row's length
(quadratically before), and the checkpointed, offloaded path's peak (every allocation tracked).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import run
from pipezero.pipe import tiled_mlp
from pipezero.pipe.document_attention import document_attention, documents_from_positions, documents_from_segments

transformers = pytest.importorskip("transformers")

VOCAB, TOL = 64, 1e-6
SEGMENTS = [[0] * 9 + [1] * 17 + [2] * 6, [3] * 20 + [4] * 12]  # two packed rows of 32 tokens


def _segments() -> torch.Tensor:
    return torch.tensor(SEGMENTS)


def _positions(segments: torch.Tensor) -> torch.Tensor:
    """Positions restarting at every document."""
    pos = torch.zeros_like(segments)
    for t in range(1, segments.shape[1]):
        pos[:, t] = torch.where(segments[:, t] == segments[:, t - 1], pos[:, t - 1] + 1, 0)
    return pos


def _masked_sdpa(q, k, v, segments):
    same = segments[:, None, :, None] == segments[:, None, None, :]
    causal = torch.ones(same.shape[-2:], dtype=torch.bool).tril()
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=same & causal)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def test_document_attention_equals_the_masked_attention():
    torch.manual_seed(0)
    seg = _segments()
    q = torch.randn(2, 4, 32, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(2))  # grouped-query
    docs = documents_from_segments(seg)
    assert docs.spans == ((0, 0, 9), (0, 9, 26), (0, 26, 32), (1, 0, 20), (1, 20, 32)) and docs.longest == 20
    assert documents_from_positions(_positions(seg)).spans == docs.spans
    out, ref = document_attention(q, k, v, docs), _masked_sdpa(q, k, v, seg)
    _close(out, ref, "attention")
    g = torch.randn_like(out)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        _close(a, b, f"d{name}")
    with pytest.raises(ValueError, match="of a 2 x 32 micro-batch, q of 1 x 32"):
        document_attention(q[:1], k[:1], v[:1], docs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flash varlen)")
@pytest.mark.parametrize("kv_heads", [4, 32])
def test_one_varlen_call_equals_one_sdpa_call_per_document_on_cuda(kv_heads):
    from pipezero.pipe import document_attention as module

    if not module._VARLEN_TORCH:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no causal window or grouped heads")
    torch.manual_seed(0)
    lengths = [300, 1, 2500, 1000, 296]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    docs = documents_from_positions(positions)
    q = torch.randn(1, 32, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    assert module._varlen_fits(q)
    out = document_attention(q, k, v, docs)
    ref = torch.cat([F.scaled_dot_product_attention(a.float(), b.float(), c.float(), is_causal=True,
                                                    enable_gqa=True)
                     for a, b, c in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))], dim=2)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(out)
    grads = zip("qkv", torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g.float()))
    for name, a, b in grads:
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2, msg=lambda m: f"d{name}: {m}")


def test_the_varlen_call_is_for_cuda_in_half_precision_only():
    from pipezero.pipe import document_attention as module

    assert not module._varlen_fits(torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16))  # CPU: the loop
    if torch.cuda.is_available():
        assert not module._varlen_fits(torch.zeros(1, 2, 8, 64, device="cuda"))  # fp32: the loop
        assert not module._varlen_fits(torch.zeros(1, 2, 8, 320, device="cuda", dtype=torch.bfloat16))


@pytest.fixture
def tiles(monkeypatch):
    """The MLP and the norms in tiles of 5 rows from any size (by default from 8,192 and 65,536 rows)."""
    for name, value in (("TILE_FROM_ROWS", 1), ("TILE_ROWS", 5), ("NORM_TILE_FROM_ROWS", 1), ("NORM_TILE_ROWS", 5)):
        monkeypatch.setattr(tiled_mlp, name, value)


def _gpt_loss_and_grads(model, ids, targets, segments, masked: bool):
    from pipezero.train.gpt.model import Block, gpt_loss

    model.zero_grad()
    layers = list(model.layers)
    hidden, seg = layers[0]((ids, _positions(segments), segments))
    same = seg[:, None, :, None] == seg[:, None, None, :]
    mask = same & torch.ones(same.shape[-2:], dtype=torch.bool).tril()
    for layer in layers[1:-2]:
        assert isinstance(layer, Block)
        hidden = layer(hidden, mask) if masked else layer((hidden, seg))[0]
    loss = gpt_loss(layers[-1](layers[-2](hidden)), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gpt_packed_rows_without_a_mask_equal_the_masked_block(tiles):
    from pipezero.train.gpt.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, d_model=16, seq_len=32, seed=3))
    gen = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, VOCAB, (2, 32), generator=gen), torch.randint(0, VOCAB, (2, 32), generator=gen)
    loss, grads = _gpt_loss_and_grads(model, ids, targets, _segments(), masked=False)
    tiled_mlp.TILE_FROM_ROWS = tiled_mlp.NORM_TILE_FROM_ROWS = 10**9  # the truth: masked, untiled
    ref_loss, ref_grads = _gpt_loss_and_grads(model, ids, targets, _segments(), masked=True)
    _close(loss, ref_loss, "loss")
    for name in ref_grads:
        _close(grads[name], ref_grads[name], name)


_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False)
FAMILIES = {  # name: (model_type, config fields, attention implementation, mask-free layers)
    "llama": ("llama", {}, "sdpa", [True, True]),
    "qwen3": ("qwen3", {}, "sdpa", [True, True]),
    "gemma2": ("gemma2", dict(sliding_window=8, final_logit_softcapping=3.0), None, [False, False]),  # soft caps
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=8,  # layer 0: window < documents
                                    layer_types=["sliding_attention", "full_attention"]), "sdpa", [True, True]),
}


def _hf_model(family: str):
    model_type, fields, attention, _ = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **_COMMON, **fields)
    torch.manual_seed(0)
    kwargs = {} if attention is None else {"attn_implementation": attention}
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _hf_inputs():
    gen = torch.Generator().manual_seed(1)
    seg = _segments()
    return (torch.randint(3, VOCAB, seg.shape, generator=gen), _positions(seg),
            torch.randint(0, VOCAB, seg.shape, generator=gen))


def _hf_truth(family: str):
    """transformers' own forward on the packed position ids (without a cache: with one it does not look
    for packed documents), which builds the block-diagonal mask from them."""
    model = _hf_model(family)
    ids, positions, targets = _hf_inputs()
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _hf_pipeline(family: str, pipe: int = 1, recompute: str | None = None):
    """The same through hf_layer_specs(fused_loss=True) (MLP and norms in tiles of 5 rows; recompute "offload":
    every layer checkpointed, its inputs offloaded): (loss, grads by HF name)."""

    names = ("TILE_FROM_ROWS", "TILE_ROWS", "NORM_TILE_FROM_ROWS", "NORM_TILE_ROWS")
    saved = {name: getattr(tiled_mlp, name) for name in names}
    for name in names:  # restored after: a gloo worker runs the next tests too
        setattr(tiled_mlp, name, 1 if "FROM" in name else 5)
    try:
        return _hf_pipeline_tiled(family, pipe, recompute)
    finally:
        for name, value in saved.items():
            setattr(tiled_mlp, name, value)


def _hf_pipeline_tiled(family: str, pipe: int, recompute: str | None):
    from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.hf.layers import HFDecoderLayer, _HFLayer
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid

    checkpointing = RecomputeConfig(mode="full", offload=True) if recompute == "offload" else None
    module = PipelineModule(hf_layer_specs(_hf_model(family), fused_loss=True), grid=Grid(pipe=pipe),
                            loss_fn=causal_lm_loss, recompute=checkpointing)
    layers = [m for m in module.modules() if isinstance(m, HFDecoderLayer)]
    for layer in layers:
        assert layer.documents == FAMILIES[family][3][layer.index], (family, layer.index)
        if layer.documents and layer.window is None:  # a mask-free layer builds no mask
            layer.make_mask = None
    ids, positions, targets = _hf_inputs()
    if pipe == 1:
        loss = module.loss(module((ids, None, positions)), targets)
        loss.backward()
    else:
        runner = PipelineRunner(module, make_schedule("1f1b", 2))
        loss = runner.train_step((ids, None, positions), targets)
    named = {n: p for layer in module.modules() if isinstance(layer, _HFLayer) for n, p in layer.hf_parameters()}
    return loss.detach(), {n: p.grad.clone() for n, p in named.items() if p.grad is not None}


@pytest.mark.parametrize("family, recompute", [(f, None) for f in sorted(FAMILIES)] + [("llama", "offload")])
def test_hf_packed_rows_equal_transformers(family, recompute, tiles):
    loss, grads = _hf_pipeline(family, recompute=recompute)
    ref_loss, ref_grads = _hf_truth(family)
    _close(loss, ref_loss, f"{family} loss")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        _close(grads[name], ref_grads[name], f"{family} {name}")


def test_hf_packed_rows_under_pipe2_1f1b_equal_transformers():
    """pipe 2, 1F1B over two micro-batches (one packed row each) on gloo: the mean of their losses and the
    summed gradients of both stages equal transformers' forward of each row, averaged."""
    ranks = run(_hf_pipeline, 2, "llama", 2, timeout=180)
    model = _hf_model("llama")
    ids, positions, targets = _hf_inputs()
    from pipezero.pipe.hf import causal_lm_loss
    losses = [causal_lm_loss(model(input_ids=ids[i:i + 1], position_ids=positions[i:i + 1], use_cache=False).logits,
                             targets[i:i + 1]) for i in range(2)]
    (sum(losses) / 2).backward()
    _close(ranks[1][0], (sum(losses) / 2).detach(), "loss")
    grads = {**ranks[0][1], **ranks[1][1]}
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        _close(grads[name], p.grad, name)


def _saved_bytes(module: torch.nn.Module, seq: int) -> int:
    """Bytes of the distinct storages autograd keeps for backward of one packed row of four documents."""
    ids = torch.randint(0, 256, (1, seq))
    positions = torch.arange(seq).remainder(seq // 4)[None]
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        module.loss(module((ids, None, positions)), ids)
    return sum(storages.values())


def test_saved_activations_grow_linearly_with_the_packed_length(monkeypatch):
    """finetune's default Llama: twice the tokens keep twice the bytes (1.89x here; the masked attention's
    [T, T] scores made it 2.18x from 512 to 1,024 tokens and 2.47x from 1,024 to 2,048), and the tiled MLP
    keeps less than the whole one."""
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.topology import Grid
    from pipezero.train.finetune import default_config

    module = PipelineModule(hf_layer_specs(default_config(), fused_loss=True), grid=Grid(pipe=1),
                            loss_fn=causal_lm_loss)
    small, large = _saved_bytes(module, 512), _saved_bytes(module, 1024)
    assert large / small < 2.05, (small, large)
    monkeypatch.setattr(tiled_mlp, "TILE_FROM_ROWS", 1)
    monkeypatch.setattr(tiled_mlp, "TILE_ROWS", 128)
    assert _saved_bytes(module, 1024) < 0.8 * large


def _long_row_llama(monkeypatch, tokens: int = 2048, hidden: int = 64):
    """A 2-layer Llama for one packed row of `tokens`, its MLP and norms in 256-row tiles from any length."""
    for name, value in (("TILE_FROM_ROWS", 1), ("TILE_ROWS", 256), ("NORM_TILE_FROM_ROWS", 1), ("NORM_TILE_ROWS", 256)):
        monkeypatch.setattr(tiled_mlp, name, value)
    return transformers.LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=176, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=tokens,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def test_checkpointed_offloaded_backward_keeps_one_lean_layer(monkeypatch):
    """The memory kit at its longest (every layer checkpointed, its input offloaded; MLP and norms tiled)
    on a packed row of documents, bf16, every allocation tracked (bench/live_tensors.py, the offload's
    CUDA allocations simulated): no backward makes a whole-row gradient per tile or document (slices did:
    O(T^2 / tile) traffic: 66 of them here), and the peak holds 14.0 [T, hidden] tensors' bytes (24.6
    before: the recomputed layer's RMSNorms in fp32 and their backward, k/v repeated to every head).
    bench/live_tensors.py extrapolates the same path to 100 GiB (before) and 49.7 GiB (now) for TinyLlama
    at 1M tokens."""
    from bench.live_tensors import LiveTensors, simulated_offload
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid

    tokens, hidden = 2048, 64
    config = _long_row_llama(monkeypatch, tokens, hidden)
    module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=Grid(pipe=1), loss_fn=causal_lm_loss,
                            recompute=RecomputeConfig(mode="full", offload=True)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (1, tokens), generator=gen)
    positions = torch.arange(tokens).remainder(300)[None]  # documents of 300 tokens
    tracker = LiveTensors()
    with tracker, simulated_offload(tracker):
        module.loss(module((ids, None, positions)), ids).backward()
    sliced = [a.shape for a in tracker.allocs if a.op == "slice_backward"]
    assert len(sliced) <= 4 * config.num_hidden_layers, sliced  # rotate_half's halves of q and k (66 before)
    peak = tracker.peak()[0] / (tokens * hidden * 2)
    assert peak < 16, f"{peak:.1f} [T, hidden] bf16 tensors alive at the peak (24.6 before)"


def test_selective_checkpointing_keeps_no_mlp_tile_output(monkeypatch):
    """A selectively checkpointed layer keeps its matmuls' outputs, but not those of its MLP's row tiles
    (which recompute themselves): kept, every tile's [rows, intermediate] outputs made the whole
    [T, intermediate] the tiles avoid, and the step's peak was above the unchecked run's (30.8 against
    22.1 [T, hidden] bf16 tensors here)."""
    from bench.live_tensors import LiveTensors
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid

    tokens, hidden = 2048, 64
    config = _long_row_llama(monkeypatch, tokens, hidden)
    ids = torch.randint(0, 32, (1, tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens).remainder(300)[None]
    peaks = {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=Grid(pipe=1), loss_fn=causal_lm_loss,
                                recompute=RecomputeConfig(mode=mode)).to(torch.bfloat16)
        tracker = LiveTensors()
        with tracker:
            module.loss(module((ids, None, positions)), ids).backward()
        peaks[mode] = tracker.peak()[0] / (tokens * hidden * 2)
    assert peaks["selective"] < 0.85 * peaks["none"], peaks


def test_a_checkpointed_layer_recomputes_no_mlp_tile_before_its_backward():
    """A checkpointed layer ending in a tiled MLP: its recompute stops before the tiles (their inputs are
    kept as one tensor, ahead of them), so each tile runs twice (forward, its own recompute), not three
    times but the last (29 calls of 10 tiles before); the gradients equal the untiled layer's, and again
    in a second backward over the retained graph (a split backward's weight pass)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    up, down, norm = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.LayerNorm(8)
    calls = [0]

    def mlp(x):
        calls[0] += 1
        return down(F.gelu(up(x)))

    def layer(h, tiled=True):
        h = h + h.sin()
        return h + (tiled_mlp.tiled_rows(mlp, norm(h), 5, 1) if tiled else mlp(norm(h)))

    x = torch.randn(2, 23, 8, requires_grad=True)  # 46 rows: 10 tiles
    params = [x, *up.parameters(), *down.parameters(), *norm.parameters()]
    ref = torch.autograd.grad(layer(x.cos(), tiled=False).square().sum(), params)
    calls[0] = 0
    loss = checkpoint(layer, x.cos(), use_reentrant=False).square().sum()
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    assert calls[0] == 20, calls[0]
    again = torch.autograd.grad(loss, params)
    for name, a, b, c in zip(["x", "up.w", "up.b", "down.w", "down.b", "norm.w", "norm.b"], grads, again, ref):
        _close(a, c, name)
        _close(b, c, f"{name}, second backward")


def _matmuls_and_grads(config, compile_as, mode: str) -> tuple[int, dict]:
    """The matmuls one step runs (profiled aten::mm) and the gradients, by name."""
    from torch.profiler import profile
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid

    torch.manual_seed(0)
    module = PipelineModule(hf_layer_specs(config, fused_loss=True), grid=Grid(pipe=1), loss_fn=causal_lm_loss,
                            recompute=RecomputeConfig(mode=mode), compile=compile_as)
    ids = torch.randint(0, 32, (1, 1024), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(1024).remainder(300)[None]
    module.loss(module((ids, None, positions)), ids).backward()  # compiles
    module.zero_grad(set_to_none=True)
    with profile() as prof:
        module.loss(module((ids, None, positions)), ids).backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return sum(e.name == "aten::mm" for e in prof.events()), grads


def test_a_compiled_checkpointed_layer_recomputes_no_mlp_tile(monkeypatch):
    """Compiled layers (aot_eager: inductor's graphs, run op by op) under full recomputation: the row
    tiles run outside the layer's graph, so its recompute stops before them, as an eager layer's does:
    the step adds the attention's 4 projections a layer, not the MLP's 3 matmuls a tile too (32 more
    than unchecked here before: 8 + 24, 4 tiles a layer); the gradients equal the eager layers'."""
    from pipezero.pipe.compile import CompileConfig

    config = _long_row_llama(monkeypatch, hidden=32)
    counts, grads = {}, {}
    for compile_as in (False, CompileConfig(backend="aot_eager")):
        for mode in ("none", "full"):
            counts[bool(compile_as), mode], grads[bool(compile_as), mode] = _matmuls_and_grads(config, compile_as,
                                                                                                mode)
    layers = config.num_hidden_layers
    assert counts[False, "full"] - counts[False, "none"] == 4 * layers, counts
    assert counts[True, "full"] - counts[True, "none"] == 4 * layers, counts
    for key, got in grads.items():
        for name, want in grads[False, "none"].items():
            _close(got[name], want, f"{key} {name}")


def test_selective_run_builds_a_micro_batchs_documents_once(monkeypatch):
    """The layers of a selectively checkpointed stage share the micro-batch's documents and cos/sin (each
    build of the documents is a host sync; before, every layer built them in its forward and its recompute:
    8 here), and the recompute still replays the kept outputs: two micro-batches' forwards before either
    backward, so each micro-batch's first recompute misses what its forward shared (built once in the forward
    and once in the recompute: 4); losses and gradients equal the unchecked run's."""
    import pipezero.pipe.hf.layers as layers
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.memory.recompute import RecomputeConfig
    from pipezero.topology import Grid

    config = _long_row_llama(monkeypatch, 512)
    builds = []
    monkeypatch.setattr(layers, "documents_from_positions",
                        lambda p, real=layers.documents_from_positions: builds.append(1) or real(p))
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 32, (1, 512), generator=gen) for _ in range(2)]
    positions = [torch.arange(512).remainder(n)[None] for n in (200, 300)]
    results = {}
    for mode in ("none", "selective"):
        builds.clear()
        torch.manual_seed(0)
        module = PipelineModule(hf_layer_specs(config), grid=Grid(pipe=1), loss_fn=causal_lm_loss,
                                recompute=RecomputeConfig(mode=mode))
        losses = [module.loss(module((ids, None, pos)), ids) for ids, pos in zip(rows, positions)]
        for loss in losses:
            loss.backward()
        results[mode] = [float(x) for x in losses], {n: p.grad for n, p in module.named_parameters()}, len(builds)
    (want, want_grads, _), (got, grads, built) = results["none"], results["selective"]
    assert got == pytest.approx(want, abs=1e-6) and built == 4, (got, want, built)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
