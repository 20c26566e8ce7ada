"""The GPT example: shapes, causality, attention against a hand-written reference, tying, per-layer init."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402
from gpt import GPT, Block, Embedding, GPTConfig, Head, flops_per_token, gpt_layers  # noqa: E402

CFG = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, seed=3)


def _tokens(b=2, t=16, seed=0):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_short_sequences():
    model = GPT(CFG)
    assert model(_tokens()).shape == (2, 16, 256)
    assert model(_tokens(t=5)).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="17 tokens.*seq_len=16"):
        model(_tokens(t=17))


def test_causal_prefix_is_unchanged_by_later_tokens():
    model = GPT(CFG)
    x = _tokens()
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % 256
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def _reference_block(block, h):
    """Pre-LN block written out with explicit heads and a -inf mask (independent of einops / SDPA)."""
    b, t, d = h.shape
    nh, hd = block.n_head, d // block.n_head
    x = F.layer_norm(h, (d,), block.ln1.weight, block.ln1.bias)
    qkv = x @ block.qkv.weight.t() + block.qkv.bias
    per_head = qkv.reshape(b, t, nh, 3, hd)  # features laid out (head, q|k|v, head_dim)
    q, k, v = (per_head[..., i, :].transpose(1, 2) for i in range(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
    h = h + att @ block.proj.weight.t() + block.proj.bias
    x = F.layer_norm(h, (d,), block.ln2.weight, block.ln2.bias)
    return h + F.gelu(x @ block.fc.weight.t() + block.fc.bias) @ block.out.weight.t() + block.out.bias


def test_block_matches_hand_written_attention():
    block = Block(CFG, 1)
    h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(block(h), _reference_block(block, h), rtol=1e-5, atol=1e-5)


def test_head_is_tied_to_embedding_and_gets_both_gradients():
    model = GPT(CFG)
    emb, head = model.layers[0], model.layers[-1]
    assert emb.weight is head.weight and getattr(emb, gpt.TIED_WEIGHT_ATTR) is emb.weight
    x = _tokens()
    gpt.gpt_loss(model(x), _tokens(seed=1)).backward()
    tied_grad = emb.weight.grad.clone()
    # the same model with the tie cut: its two weights' gradients must add up to the tied one
    untied = GPT(CFG)
    untied.layers[-1].weight = torch.nn.Parameter(untied.layers[0].weight.detach().clone())
    gpt.gpt_loss(untied(x), _tokens(seed=1)).backward()
    torch.testing.assert_close(tied_grad, untied.layers[0].weight.grad + untied.layers[-1].weight.grad)


def test_layers_built_alone_equal_the_single_process_model():
    """Each stage of a pipeline builds only its layers, in any order, after any RNG use."""
    model = GPT(CFG)
    recipes = gpt_layers(CFG)
    assert [r.cls for r in recipes] == [Embedding, Block, Block, gpt.FinalNorm, Head]
    assert [r.tied_key for r in recipes] == [gpt.TIED_KEY, None, None, None, gpt.TIED_KEY]
    for index in reversed(range(len(recipes))):
        torch.rand(index + 1)  # disturb the global RNG: layers must not use it
        alone = recipes[index].cls(*recipes[index].args)
        for (name, a), b in zip(alone.state_dict().items(), model.layers[index].state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"layer {index} {name}")
    other = GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=16, seed=4))
    assert not torch.equal(other.layers[1].qkv.weight, model.layers[1].qkv.weight)


def test_specs_tie_and_head_forward_on_the_embedding_module():
    specs = gpt.gpt_specs(CFG)
    assert [getattr(s, "key", None) for s in specs] == ["embed", None, None, None, "embed"]
    emb = specs[0].build()
    h = torch.randn(2, 16, 32)
    torch.testing.assert_close(specs[-1].forward_fn(emb, h), specs[-1].build()(h), rtol=0, atol=0)
    assert specs[0].tied_parameters(emb)[0] is emb.weight


def test_flops_per_token_counts_every_multiplying_weight():
    model = GPT(CFG)
    n = sum(p.numel() for p in model.parameters()) - model.layers[0].pos.numel()  # tied counted once
    assert flops_per_token(CFG) == 6 * n + 12 * CFG.n_layer * CFG.d_model * CFG.seq_len


def test_generate_runs_without_cache():
    model = GPT(CFG)
    out = model.generate(_tokens(t=3), 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 23) and int(out.max()) < 256


@pytest.mark.parametrize("kwargs, words", [({"d_model": 30, "n_head": 4}, "multiple of n_head"),
                                           ({"n_layer": 0}, "n_layer=0")])
def test_config_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        GPTConfig(**kwargs)
