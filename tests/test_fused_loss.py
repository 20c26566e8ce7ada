"""The fused, chunked head + cross-entropy equals the unfused loss, and never makes the logits whole.

Truth: F.cross_entropy over the whole logits (HeadLogits.logits(), the unfused head), in fp32;
the fused loss must give the same value and the same gradients of the hidden states, the head's
weight and bias, over ragged chunks, with ignored targets, a logit scale and a soft cap. The
tolerance is a small multiple of the truth's own spread (the same loss in float64 vs fp32).
Memory: a dispatch mode records every tensor any op makes; the largest must stay below one
[tokens, vocab] logits tensor for the fused loss (and reach it for the unfused one, so the check
can fail). Then the GPT's and a Hugging Face Llama's pipeline layers (tied and untied heads)
give the same loss and gradients with fused_loss=True as without.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness import run
from pipezero.pipe.fused_loss import (CHUNK_ELEMENTS, HeadLogits, fused_cross_entropy, hf_head_logits,
                                      rows_per_chunk)

N_BATCH, SEQ, D, VOCAB = 3, 7, 16, 50


def _inputs(bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N_BATCH, SEQ, D, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, D, generator=g).mul_(0.5).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, VOCAB, (N_BATCH, SEQ), generator=g)
    targets[0, :3] = -100
    targets[2, -1] = -100
    return hidden, weight, b, targets


def _loss_and_grads(fused: bool, bias: bool, scale: float, softcap, dtype=torch.float32, chunk_rows=4):
    hidden, weight, b, targets = _inputs(bias, dtype)
    head = HeadLogits(hidden, weight, b, scale, softcap)
    loss = fused_cross_entropy(head, targets, chunk_rows=chunk_rows) if fused else \
        F.cross_entropy(head.logits().flatten(0, -2), targets.flatten(), ignore_index=-100)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    return [loss, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("bias, scale, softcap", [(False, 1.0, None), (True, 1.0, None), (False, 0.25, None),
                                                  (False, 1.0, 2.0), (True, 0.5, 3.0)])
def test_values_and_grads_equal_unfused(bias, scale, softcap):
    truth = _loss_and_grads(False, bias, scale, softcap)
    wide = _loss_and_grads(False, bias, scale, softcap, dtype=torch.float64)
    for chunk_rows in (4, 5, 1000):  # ragged chunks, and one chunk of every row
        got = _loss_and_grads(True, bias, scale, softcap, chunk_rows=chunk_rows)
        for name, g, t, w in zip(("loss", "hidden", "weight", "bias"), got, truth, wide):
            spread = (t.double() - w).abs().max().item()
            torch.testing.assert_close(g, t, rtol=0, atol=max(1e-6, 10 * spread), msg=lambda m: f"{name}: {m}")


def test_no_grad_and_all_ignored():
    hidden, weight, _, targets = _inputs(False)
    with torch.no_grad():
        got = fused_cross_entropy(HeadLogits(hidden, weight), targets, chunk_rows=4)
        want = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.isnan(fused_cross_entropy(HeadLogits(hidden, weight), torch.full_like(targets, -100)))


def test_bad_shapes_are_named():
    hidden, weight, _, targets = _inputs(False)
    with pytest.raises(ValueError, match="does not fit hidden"):
        fused_cross_entropy(HeadLogits(hidden, weight.t()), targets)
    with pytest.raises(ValueError, match="do not fit hidden"):
        fused_cross_entropy(HeadLogits(hidden, weight), targets[:, :-1])


class _Largest(TorchDispatchMode):
    """Records the most elements of any tensor an op produced."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("fused", [True, False])
def test_logits_never_whole(fused):
    g = torch.Generator().manual_seed(0)
    tokens, vocab = 4 * 64, 512  # logits: 131,072 elements, 4x any other tensor
    hidden = torch.randn(4, 64, 32, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 32, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (4, 64), generator=g)
    with _Largest() as mode:
        head = HeadLogits(hidden, weight, softcap=5.0)
        loss = fused_cross_entropy(head if fused else head.logits(), targets, chunk_rows=32)
        loss.backward()
    if fused:
        assert mode.largest <= 32 * vocab, (mode.largest, tokens * vocab)
    else:
        assert mode.largest >= tokens * vocab   # the check sees whole logits when they are made


def test_rows_per_chunk_grow_with_the_head_weight():
    assert rows_per_chunk(32000, 2048) == CHUNK_ELEMENTS // 32000 == 1048   # a Llama-2 vocabulary
    assert rows_per_chunk(151936, 2048) == 1024    # Qwen's: d / 2 rows, not 220 (38 chunks of 8,192 rows)
    assert rows_per_chunk(10**9, 1) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_loss_equals_eager(dtype):
    """Traced (aot_eager: functionalized as inductor sees it), the weight gradient's chain of in-place sums
    over chunks gives what eager gives."""
    def loss_and_grads(fn):
        hidden, weight, b, targets = _inputs(True, dtype)
        loss = fn(HeadLogits(hidden, weight, b, 0.5, 3.0), targets)
        return [loss, *torch.autograd.grad(loss, [hidden, weight, b])]

    eager = loss_and_grads(lambda h, t: fused_cross_entropy(h, t, chunk_rows=4))
    traced_fn = torch.compile(lambda h, t: fused_cross_entropy(h, t, chunk_rows=4), backend="aot_eager",
                              fullgraph=True)
    traced = loss_and_grads(traced_fn)
    for got, want in zip(traced, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (inductor on CUDA)")
def test_cuda_half_loss_compiled_is_right_and_its_memory_bounded():
    """bf16 on CUDA, eager and compiled, equals fp32's loss over the same bf16 values; compiled at Qwen3's
    vocabulary (151,936, d 2,048, 8,192 rows), the loss holds the weight gradient, one [vocab, d] product a
    chunk (inductor sums them in one kernel) and a few chunks' logits: 8 chunks of 1,024 rows, 8.7 GiB at
    most, where 38 chunks of 220 rows held 21.5 GiB of products alone (one H100, bench/RESULTS.md)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(512, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(3000, 256, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
    targets = torch.randint(0, 3000, (512,), device="cuda", generator=g)
    wide = [t.detach().float().requires_grad_() for t in (hidden, weight)]
    truth = F.cross_entropy(wide[0] @ wide[1].t(), targets)
    want = [truth, *torch.autograd.grad(truth, wide)]
    for fn in (fused_cross_entropy, torch.compile(fused_cross_entropy)):
        loss = fn(HeadLogits(hidden, weight), targets, chunk_rows=100)
        got = [loss, *torch.autograd.grad(loss, [hidden, weight])]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), b, rtol=2e-2, atol=2e-3)
    rows, d, vocab = 8192, 2048, 151936
    hidden = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    fn = torch.compile(fused_cross_entropy)
    fn(HeadLogits(hidden, weight), targets).backward()  # compiles
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(HeadLogits(hidden, weight), targets).backward()
    extra = torch.cuda.max_memory_allocated() - base
    rows_each = rows_per_chunk(vocab, d)
    products = -(-rows // rows_each) * vocab * d * 2
    bound = vocab * d * (4 + 2) + products + 4 * rows_each * vocab * 4  # fp32 sum, weight.grad, products, logits
    assert extra < bound, (extra / 2**30, bound / 2**30)


def test_hf_head_logits_reads_scale_and_cap():
    class Cfg:
        logit_scale, logits_scaling, final_logit_softcapping = 0.5, 4.0, 30.0
    head = hf_head_logits(Cfg(), torch.zeros(1, 2), torch.zeros(3, 2))
    assert (head.scale, head.softcap) == (0.125, 30.0)


# -- the pipeline layers ----------------------------------------------------------------------
def _pipeline_grads(specs, fused_specs, loss_fn, ids, targets) -> list:
    from pipezero.pipe import PipelineModule
    from pipezero.topology import Grid

    out = []
    for s in (specs, fused_specs):
        model = PipelineModule(s, grid=Grid(pipe=1), loss_fn=loss_fn)
        loss = model.loss(model(ids), targets)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    return out


def _gpt_pair():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from gpt import GPTConfig, gpt_loss, gpt_specs

    cfg = GPTConfig(vocab_size=97, n_layer=2, n_head=2, d_model=16, seq_len=12)
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, 97, (3, 12), generator=g), torch.randint(0, 97, (3, 12), generator=g)
    return _pipeline_grads(gpt_specs(cfg), gpt_specs(cfg, fused_loss=True), gpt_loss, ids, targets)


def _hf_pair(tied: bool, softcap):
    import transformers

    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs

    cfg = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tied, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if softcap:
        cfg.final_logit_softcapping, cfg.logit_scale = softcap, 0.5
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, 80, (2, 10), generator=g), torch.randint(0, 80, (2, 10), generator=g)
    targets[0, :4] = -100
    return _pipeline_grads(hf_layer_specs(cfg), hf_layer_specs(cfg, fused_loss=True), causal_lm_loss, ids, targets)


def _layers_all():
    results = {"gpt": _gpt_pair()}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return results
    for tied, cap in ((False, None), (True, None), (False, 3.0)):
        results[f"llama tied={tied} softcap={cap}"] = _hf_pair(tied, cap)
    return results


def test_gpt_and_hf_layers_fused_equal_unfused():
    for name, ((loss, grads), (f_loss, f_grads)) in run(_layers_all, 1, timeout=240)[0].items():
        torch.testing.assert_close(f_loss, loss, rtol=0, atol=1e-6, msg=lambda m: f"{name} loss: {m}")
        assert f_grads.keys() == grads.keys()
        for n in grads:
            torch.testing.assert_close(f_grads[n], grads[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")


def test_split_backward_runs_the_fused_node_twice():
    """A zero-bubble schedule's last chunk without Linear layers (the final norm and the head: pipe 4,
    or ZB-V's last chunk) splits the graph: I runs the fused node for the hidden gradient, W runs it
    again for the weight's (torch's stage_backward_input / stage_backward_weight); both must equal
    one plain backward."""
    from pipezero.pipe.split_backward import backward_input

    got = []
    for split in (False, True):
        hidden, weight, _, targets = _inputs(False)
        x = hidden.detach().requires_grad_()
        norm = torch.nn.LayerNorm(D)
        loss = fused_cross_entropy(HeadLogits(norm(x), weight), targets, chunk_rows=4)
        weights = [weight, *norm.parameters()]
        if split:
            (x_grad,), w = backward_input([loss], [None], [x], weights)
            w.run()
        else:
            loss.backward()
            x_grad = x.grad
        got.append([x_grad, *(p.grad for p in weights)])
    for g, want in zip(*reversed(got), strict=True):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
