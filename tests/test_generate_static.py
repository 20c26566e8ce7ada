"""The static-shape decode step of examples/generate.py against the dynamic KV-cache loop it replaced.

The truth is the dynamic loop (written out here as it was in examples/gpt.py: the cache
grows by one position per token, the mask is rebuilt for the keys so far). The static step
(whole-capacity buffers written at a device-tensor index, a mask over every position) must
give its tokens exactly, greedy and sampled with the same generator; every decode step must
see the same shapes (what a CUDA graph needs); the warm-up run before a capture must leave
the tokens unchanged. CUDA graphs themselves are tested only where a GPU is present.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import generate as generation  # noqa: E402
from gpt import GPT, Block, GPTConfig  # noqa: E402

CFG = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=32, seed=5)
NEW = 14


def _model() -> GPT:
    """Weights scaled up (x20) so greedy decoding does not collapse to one repeated token."""
    model = GPT(CFG)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(20.0)
    return model


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of lengths 7, 5, 2 and 7, left-padded to 7."""
    idx = torch.randint(0, 256, (4, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(idx)
    mask[1, :2] = 0
    mask[2, :5] = 0
    return idx, mask


@torch.no_grad()
def _dynamic(layers, idx, new_tokens, mask, temperature=0.0, top_k=None, generator=None) -> torch.Tensor:
    """The KV-cache loop as it was before the static step: the reference."""
    valid, blocks = mask.bool(), sum(isinstance(m, Block) for m in layers)
    ones, cache = torch.ones_like(valid[:, :1]), generation.KVCache(blocks, idx.size(1) + new_tokens)
    out, start = idx, 0
    for _ in range(new_tokens):
        fresh, pos = out[:, start:], generation._positions(valid)[:, start:]
        logits = generation._logits(layers, fresh, pos, generation._attention_mask(valid, start, fresh.size(1)),
                                    cache)
        start = out.size(1)
        out = torch.cat([out, generation._pick(logits, temperature, top_k, generator)], dim=1)
        valid = torch.cat([valid, ones], dim=1)
    return out


def test_static_decode_equals_dynamic_greedy_with_left_padding():
    model = _model()
    idx, mask = _prompts()
    truth = _dynamic(model.layers, idx, NEW, mask)
    assert len(set(truth[:, 7:].flatten().tolist())) > 10  # not one repeated token
    static = generation.generate(model.layers, idx, NEW, temperature=0, attention_mask=mask)
    torch.testing.assert_close(static, truth, rtol=0, atol=0)
    no_mask = generation.generate(model.layers, idx, NEW, temperature=0)
    torch.testing.assert_close(no_mask, _dynamic(model.layers, idx, NEW, torch.ones_like(mask)), rtol=0, atol=0)
    assert not torch.equal(no_mask, static)  # the mask matters: rows 1 and 2 differ


def test_static_decode_equals_dynamic_sampled_with_the_same_generator():
    model = _model()
    idx, mask = _prompts()
    sample = dict(temperature=0.9, top_k=6)
    truth = _dynamic(model.layers, idx, NEW, mask, generator=torch.Generator().manual_seed(4), **sample)
    static = model.generate(idx, NEW, attention_mask=mask, generator=torch.Generator().manual_seed(4), **sample)
    torch.testing.assert_close(static, truth, rtol=0, atol=0)
    other = model.generate(idx, NEW, attention_mask=mask, generator=torch.Generator().manual_seed(5), **sample)
    assert not torch.equal(other, truth)  # the seed matters: the comparison could fail


def test_every_decode_step_sees_the_same_shapes():
    model = _model()
    idx, mask = _prompts()
    seen = []
    hook = model.layers[1].register_forward_pre_hook(lambda m, args: seen.append([tuple(a.shape) for a in args[:2]]))
    model.generate(idx, NEW, temperature=0, attention_mask=mask)
    hook.remove()
    prefill, *steps = seen
    assert prefill == [(4, 7, 32), (4, 1, 7, 7)]
    assert len(steps) == NEW - 1 and all(s == [(4, 1, 32), (4, 1, 1, 7 + NEW)] for s in steps), steps


def test_warm_up_before_capture_leaves_the_tokens_unchanged(monkeypatch):
    """A stand-in for capture_step: the warm-up run, then the step for every token, as a replay would."""
    calls = []

    def fake_capture(step, layers, device, required):
        calls.append(required)
        step()  # the warm-up: a real run of the first step
        return step
    monkeypatch.setattr(generation, "capture_step", fake_capture)
    model = _model()
    idx, mask = _prompts()
    out = generation._generate_cached(model.layers, idx, mask.bool(), NEW, CFG.n_layer,
                                      lambda logits: logits.argmax(-1, keepdim=True), cuda_graph=True)
    assert calls == [True]
    torch.testing.assert_close(out, _dynamic(model.layers, idx, NEW, mask), rtol=0, atol=0)


def test_cuda_graph_needs_cuda_tensors_and_the_cache():
    model = _model()
    idx, mask = _prompts()
    with pytest.raises(ValueError, match=r"cuda_graph=True\): idx is on cpu.*move the model and prompts to a GPU"):
        model.generate(idx, 3, temperature=0, cuda_graph=True)
    with pytest.raises(ValueError, match=r"cuda_graph=True\) replays the KV-cache decode step.*use_cache=False"):
        model.generate(idx, 3, temperature=0, use_cache=False, cuda_graph=True)
    torch.testing.assert_close(model.generate(idx, 3, temperature=0, use_cache=False, cuda_graph=False),
                               model.generate(idx, 3, temperature=0, cuda_graph=None), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_gives_the_eager_tokens_and_frees_its_memory():
    model = _model().cuda()
    idx, mask = (t.cuda() for t in _prompts())
    eager = model.generate(idx, NEW, temperature=0, attention_mask=mask, cuda_graph=False)
    torch.testing.assert_close(eager, _dynamic(model.layers, idx, NEW, mask), rtol=0, atol=0)
    model.generate(idx, NEW, temperature=0, attention_mask=mask, cuda_graph=True)  # lazy init (side stream)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphed = model.generate(idx, NEW, temperature=0, attention_mask=mask).cpu()  # None: on for CUDA
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # no cache, graph pool or static buffer left
    torch.testing.assert_close(graphed, eager.cpu(), rtol=0, atol=0)
    sample = dict(temperature=0.9, top_k=6, attention_mask=mask)
    a = model.generate(idx, NEW, generator=torch.Generator("cuda").manual_seed(1), cuda_graph=False, **sample)
    b = model.generate(idx, NEW, generator=torch.Generator("cuda").manual_seed(1), cuda_graph=True, **sample)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
