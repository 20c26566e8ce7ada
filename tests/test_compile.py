"""Compiled pipeline layers (pipe/compile.py) train as the eager ones and never recompile per step.

Each case trains the same tiny model three optimizer steps through build() twice, eager and with
PipelineModule(compile=...) under a counting backend (torch's aot_eager: traced, partitioned into
forward and backward graphs, run eagerly; inductor only in the one real-compile case), and must
give the same loss every step and the same final parameters (fp32, a few ulps: aot_eager runs
the same ops). The backend counts each graph it is handed: some in the first step, none after
(no recompilation per micro-batch or per step). Cases: 1F1B with ZeRO-1 (the GPT's tied
embedding and head), ZB-V's split backward with its deferred weight GEMMs and ZeRO-2, ZeRO-3
with activation checkpointing, a Hugging Face Llama's decoder layers with the fused loss, and
DualPipeV (whole and split backwards in one step) with activation checkpointing.
"""

import gc
import sys
from pathlib import Path

import pytest
import torch

from harness import run
from pipezero.pipe.compile import CompileConfig, compile_by_default, compile_layers, repeated_classes
from pipezero.train.config import ConfigError, parse_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

BATCH, SEQ, STEPS = 8, 16, 3


class _Counting:
    """A torch.compile backend: counts the graphs it compiles, then hands them to `inner`."""

    def __init__(self, inner: str = "aot_eager"):
        from torch._dynamo.backends.registry import lookup_backend

        self.inner, self.graphs = lookup_backend(inner), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _specs(kind: str, fused: bool):
    if kind == "gpt":
        from gpt import GPTConfig, gpt_loss, gpt_specs

        return gpt_specs(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=SEQ), fused), gpt_loss, 64
    import transformers

    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return hf_layer_specs(cfg, fused_loss=fused), causal_lm_loss, 64


def _train(kind: str, schedule: str, stage: int, recompute: int, backend, fused: bool = False):
    from pipezero.train.build import build

    torch._dynamo.reset()
    specs, loss_fn, vocab = _specs(kind, fused)
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
              "pipeline": {"schedule": schedule, "activation_checkpoint_interval": recompute}}
    parts = build(config, specs=specs, loss_fn=loss_fn, compile=CompileConfig(backend=backend) if backend else None)
    g = torch.Generator().manual_seed(0)
    losses, graphs = [], []
    for _ in range(STEPS):
        ids, targets = torch.randint(0, vocab, (2, BATCH, SEQ), generator=g)
        losses.append(parts.runner.train_step(ids, targets).item())
        parts.optimizer.step()
        parts.optimizer.zero_grad()
        graphs.append(getattr(backend, "graphs", 0))
    with parts.optimizer.gathered_parameters():
        params = {n: p.detach().clone() for n, p in parts.module.named_parameters()}
    return losses, params, graphs


CASES = {"1f1b-zero1-tied": ("gpt", "1f1b", 1, 0, False), "zbv-split-zero2": ("gpt", "zbv", 2, 0, False),
         "zero3-checkpointing": ("gpt", "1f1b", 3, 1, False), "hf-llama-fused": ("hf", "1f1b", 1, 0, True),
         "dualpipev-checkpointing": ("gpt", "dualpipev", 1, 1, False)}


def _forget_compiled() -> None:
    """The pooled worker runs other tests next: drop dynamo's caches (their fake tensors and graphs)."""
    torch._dynamo.reset()
    gc.collect()


def _cases(names):
    out = {}
    try:
        for name in names:
            kind, schedule, stage, recompute, fused = CASES[name]
            if kind == "hf":
                pytest.importorskip("transformers")
            eager = _train(kind, schedule, stage, recompute, None, fused)
            compiled = _train(kind, schedule, stage, recompute, _Counting(), fused)
            out[name] = eager, compiled
    finally:
        _forget_compiled()
    return out


def test_compiled_equals_eager_without_recompiling():
    for name, ((losses, params, _), (c_losses, c_params, graphs)) in run(_cases, 1, list(CASES),
                                                                          timeout=290)[0].items():
        assert graphs[0] > 0, f"{name}: nothing was compiled"
        assert graphs[-1] == graphs[0], f"{name}: graphs compiled after step 1: {graphs}"
        if CASES[name][1] not in ("zbv", "dualpipev"):  # no split backward: each block one whole graph (its Linears traced,
            # not 5 or 9 pieces), and the loss one more
            assert graphs[0] == 2, f"{name}: {graphs[0]} graphs for one block class and the loss"
        torch.testing.assert_close(c_losses, losses, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} losses: {m}")
        assert c_params.keys() == params.keys()
        for n in params:
            torch.testing.assert_close(c_params[n], params[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")


def _inductor_once():
    torch._dynamo.reset()
    counting = _Counting("inductor")
    try:
        return _train("gpt", "1f1b", 1, 0, None), _train("gpt", "1f1b", 1, 0, counting), counting.graphs
    finally:
        _forget_compiled()


def test_inductor_compiled_gpt_trains_as_eager():
    (losses, params, _), (c_losses, c_params, graphs), total = run(_inductor_once, 1, timeout=290)[0]
    assert graphs[0] > 0 and graphs[-1] == graphs[0] == total
    torch.testing.assert_close(c_losses, losses, rtol=1e-4, atol=1e-5)  # inductor fuses: other rounding


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_graph_backpropagated_whole_then_split():
    """A pipeline backpropagates one compiled graph whole (1F1B's B, DualPipeV's steady state) and
    split (ZB-V's I, which keeps the graph for W); torch compiles the backward at its first use,
    and after a whole one a split one was refused ("compiled with non-empty donated buffers"):
    a ZB-V model after a 1F1B one in the same process failed at its first I (they share graphs)."""
    from pipezero.pipe.compile import compile_loss
    from pipezero.pipe.split_backward import backward_input

    torch._dynamo.reset()
    try:
        loss = compile_loss(_loss, CompileConfig(backend="aot_eager"))
        targets, x = torch.randint(0, 8, (2, 4)), torch.randn(2, 4, 8, requires_grad=True)
        loss(x * 2, targets).backward()  # whole
        y = x.detach().requires_grad_()
        (grad,), _ = backward_input([loss(y * 2, targets)], [None], [y], [])  # split
        torch.testing.assert_close(grad, x.grad)
    finally:
        _forget_compiled()


def test_which_layers_are_compiled():
    from gpt import Block, FinalNorm, GPTConfig, gpt_specs

    specs = gpt_specs(GPTConfig(n_layer=3))
    assert repeated_classes(specs) == {Block}
    assert FinalNorm not in repeated_classes(specs)
    with pytest.raises(ValueError, match="not a regex"):
        CompileConfig(layers="(")
    with pytest.raises(TypeError, match="expected True, False, None or a CompileConfig"):
        CompileConfig.of("yes")
    # the default: on where it measured faster (CUDA, tensor 1), off elsewhere; False always off
    assert compile_by_default(torch.device("cuda")) and not compile_by_default(torch.device("cpu"))
    assert not compile_by_default(torch.device("cuda"), tensor_size=2)
    assert CompileConfig.of(None, torch.device("cpu")) is None and CompileConfig.of(False, torch.device("cuda")) is None
    assert CompileConfig.of(None, torch.device("cuda")) == CompileConfig()


def test_calls_without_gradients_run_eager():
    """Evaluation and generation (no gradients, shapes that change per call) never compile."""
    from gpt import Block, GPTConfig

    torch._dynamo.reset()
    block, counting = Block(GPTConfig(d_model=16, n_head=2, seq_len=8), 0), _Counting()
    compile_layers([block], CompileConfig(backend=counting), {Block})
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        for t in (3, 5, 8):
            block(x[:, :t])
    assert counting.graphs == 0
    block(x).sum().backward()
    assert counting.graphs == 1


def test_variable_widths_compile_twice_not_per_width():
    """Micro-batches of varying width (train/data's pad="microbatch") recompile once, dynamically; with
    dynamic=False each new width would recompile, up to torch's limit, then run eager."""
    from gpt import Block, GPTConfig

    graphs = {}
    for dynamic in (None, False):
        torch._dynamo.reset()
        block, counting = Block(GPTConfig(d_model=16, n_head=2, seq_len=64), 0), _Counting()
        compile_layers([block], CompileConfig(backend=counting, dynamic=dynamic), {Block})
        for width in (8, 12, 16, 20, 9, 33):
            block(torch.randn(2, width, 16)).sum().backward()
        graphs[dynamic] = counting.graphs
    torch._dynamo.reset()
    assert CompileConfig().dynamic is None
    assert graphs == {None: 2, False: 6}, graphs


def test_hf_decoder_layers_make_one_causal_mask_per_micro_batch_outside_the_graph():
    """Compiling an HF stage compiles the transformers layer alone: the stage's layers share one mask
    and one cos/sin per micro-batch, made eagerly, and the mask of unpadded sequences is None (SDPA's
    causal kernel; traced, transformers' checks cannot decide and build a dense mask)."""
    transformers = pytest.importorskip("transformers")
    from pipezero.pipe.compile import compiled_part
    from pipezero.pipe.hf import HFDecoderLayer, hf_layer_specs

    torch._dynamo.reset()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=None, bos_token_id=None, eos_token_id=None, use_cache=False)
    specs = hf_layer_specs(cfg)
    torch.manual_seed(0)
    layers = [spec.build() for spec in specs]
    decoders = [layer for layer in layers if isinstance(layer, HFDecoderLayer)]
    counting = _Counting()
    compile_layers(layers, CompileConfig(backend=counting), repeated_classes(specs))
    assert [compiled_part(d) for d in decoders] == [d.inner for d in decoders]
    masks, rotaries = [], []
    for d in decoders:
        make_mask, rotary = d.make_mask, d.rotary.forward
        d.make_mask = lambda *a, _f=make_mask, **k: masks.append(_f(*a, **k)) or masks[-1]
        d.rotary.forward = lambda *a, _f=rotary, **k: rotaries.append(_f(*a, **k)) or rotaries[-1]
    try:
        for step in range(2):  # two micro-batches
            x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            for layer in layers[:-2]:  # embedding, decoder layers (not the final norm and head)
                x = layer(x)
            x[0].sum().backward()
    finally:
        _forget_compiled()
    assert len(masks) == 2 and masks == [None, None], masks
    assert len(rotaries) == 2
    assert counting.graphs == 1  # one graph for the decoder layer class, reused by all three


def _module_steps(backend) -> tuple[list[float], dict]:
    """The single-process GPT (its Blocks in one ModuleList with the embedding and head) through
    build(model=...): model_blocks finds the Blocks; three steps of four micro-batches."""
    from gpt import GPT, GPTConfig, gpt_loss

    from pipezero.pipe.compile import model_blocks
    from pipezero.train.build import build

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=SEQ))
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": 4, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}}
    parts = build(config, model=model, compile=CompileConfig(backend=backend) if backend else False)
    blocks = model_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["Block", "Block"]
    assert all(getattr(b, "_pipezero_compiled", False) for b in blocks) == (backend is not None)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        ids, targets = torch.randint(0, 64, (2, 4, BATCH // 4, SEQ), generator=g)
        for x, y in zip(ids, targets):
            loss = gpt_loss(parts.module(x), y) / 4
            parts.optimizer.backward(loss)
            losses.append(loss.item())
        parts.optimizer.step()
        parts.optimizer.zero_grad()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _module_cases():
    try:
        counting = _Counting()
        return _module_steps(None), _module_steps(counting), counting.graphs
    finally:
        _forget_compiled()


def test_build_with_a_model_compiles_its_blocks():
    """build(model=...) / initialize compile the model's repeated blocks (model_blocks) as PipelineModule
    compiles a stage's: the same losses and parameters as eager, one graph for the Block class."""
    (losses, params), (c_losses, c_params), graphs = run(_module_cases, 1, timeout=200, discard=True)[0]
    assert graphs == 1
    torch.testing.assert_close(c_losses, losses, rtol=1e-5, atol=1e-6)
    for n in params:
        torch.testing.assert_close(c_params[n], params[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_ds_config_compile_section():
    base = {"train_batch_size": 8}
    assert parse_config(base).compile is None
    assert parse_config({**base, "compile": {}}).compile is None
    assert parse_config({**base, "compile": {"deepcompile": False}}).compile is None
    assert parse_config({**base, "compile": {"deepcompile": True}}).compile == CompileConfig()
    assert parse_config({**base, "compile": {"enabled": False}}).compile is False   # off, also on CUDA
    legacy = parse_config({**base, "compile": {"enabled": True, "backend": "aot_eager", "kwargs": {"mode": None}}})
    assert legacy.compile.backend == "aot_eager"
    with pytest.raises(ConfigError, match="free_activation"):
        parse_config({**base, "compile": {"deepcompile": True, "free_activation": True}})
    with pytest.raises(ConfigError, match="kwargs"):
        parse_config({**base, "compile": {"enabled": True, "kwargs": {"bogus": 1}}})
