"""bench/long_context.py: its ALST runner trains the same model as transformers, and its host-memory guard.

The ALST runner needs a GPU to run whole (DeepSpeed's engine); what CI can check is that its model
(DeepSpeed's TiledMLP in every layer, every layer checkpointed) and its loss (DeepSpeed's
TiledFusedLogitsLoss) give transformers' own loss and gradients on the same packed row, so the bench
compares like with like; and that the 8B runs are refused, with the numbers, where the host could not
hold them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import long_context as lc

pytest.importorskip("deepspeed")


def test_parameter_count_is_transformers_own():
    from transformers import LlamaForCausalLM

    for shape in lc.SHAPES:
        config = lc._config(shape, 4096)
        with torch.device("meta"):
            expected = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
        assert lc.parameter_count(config) == expected, shape
    assert round(lc.parameter_count(lc._config("llama3-8b", 4096)) / 1e9, 2) == 8.03


def test_host_memory_guard_refuses_what_the_host_cannot_hold():
    full = lc._config("llama3-8b", 524288)
    refusal = lc.host_refusal("alst", full, 524288, True, available=120.0)
    assert refusal and "8.03B params x 18 B" in refusal and "32 x 524,288 x 4096" in refusal, refusal
    need, _ = lc.host_need("pipezero-offload", full, 524288, True)
    assert need == pytest.approx(6 + 8.03e9 * 16 / 2**30 + 32 * 524288 * 4096 * 2 / 2**30, rel=1e-3)
    cut = lc._config("llama3-8b", 524288, layers=8)
    assert lc.host_refusal("pipezero-offload", cut, 524288, True, available=120.0) is None
    assert lc.host_refusal("torch", full, 524288, False, available=120.0) is None  # nothing on the host
    assert "fp32 training state 8.03B" in lc.host_refusal("torch", full, 4096, False, 120.0, cuda=False)


def test_alst_model_and_loss_equal_transformers(monkeypatch):
    """fp32 on CPU, 512 tokens: 4 MLP tiles, 3 loss shards, every layer checkpointed."""
    from bench import long_context_alst as alst
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(alst, "_loss_shards", lambda length, vocab: 3)
    config = lc._config("tiny", 512)
    ids, positions = lc._row(512, config.vocab_size, torch.device("cpu"))
    torch.manual_seed(0)
    truth = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
    model = alst.alst_model(config, torch.device("cpu"), torch.float32)
    model.load_state_dict(truth.state_dict())
    logits = truth(input_ids=ids, position_ids=positions, use_cache=False).logits
    want = F.cross_entropy(logits[0, :-1], ids[0, 1:])
    want.backward()
    got = alst.alst_loss(model, ids, positions)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(model.named_parameters(), truth.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
