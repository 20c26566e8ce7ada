"""A model cast to bf16 for training keeps its buffers' dtypes, as transformers' from_pretrained(dtype=) does.

The reference is transformers itself: a Llama saved to disk and loaded with
`from_pretrained(dir, dtype=torch.bfloat16)` (bf16 weights, the rotary frequencies left in fp32).
The same directory through `build()` in bf16 must give its logits over a long sequence; the old
cast (`module.to(torch.bfloat16)`, rotary frequencies rounded to bf16) lands far from them there,
so the check can fail.
"""

import pytest
import torch
from torch import nn

from harness import run
from pipezero.precision import cast_parameters

transformers = pytest.importorskip("transformers")

SEQ = 1024  # rounding the frequencies moves position p by up to 0.004 p radians


def test_parameters_cast_buffers_kept():
    module = nn.BatchNorm1d(4)
    module.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    stats = module.running_mean
    assert cast_parameters(module, torch.bfloat16) is module
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert module.running_mean is stats and stats.dtype == torch.float32
    assert module.mask.dtype == torch.bool and module.num_batches_tracked.dtype == torch.int64


def _save_llama(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def _logits(path: str) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.train.build import build

    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "steps_per_print": 10**9}
    parts = build(config, specs=hf_layer_specs(path), loss_fn=causal_lm_loss, device="cpu")
    rotary = {b.dtype for n, b in parts.module.named_buffers() if n.endswith("inv_freq")}
    with torch.no_grad():
        ours = parts.runner.eval_step(ids).float()
        hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        truth = hf(ids).logits.float()
        hf.to(torch.bfloat16)  # the old cast: the rotary frequencies rounded to bf16 too
        rounded = hf(ids).logits.float()
    return {"ours": ours, "truth": truth, "rounded": rounded, "rotary": rotary}


def test_build_in_bf16_equals_from_pretrained_over_long_sequences(tmp_path):
    _save_llama(str(tmp_path))
    got = run(_logits, 1, str(tmp_path), timeout=180)[0]
    assert got["rotary"] == {torch.float32}
    ours = (got["ours"] - got["truth"]).abs().max().item()
    rounded = (got["rounded"] - got["truth"]).abs().max().item()
    assert ours <= 0.05 * rounded, (ours, rounded)
