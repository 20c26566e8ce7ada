"""Hugging Face families beyond test_hf.py's four, through hf_layer_specs, equal transformers' own model.

Each family shares the decoder structure (embedding, decoder layers, final norm, LM head)
but its forward adds something around the layers that the pipeline must reproduce:
Gemma's sqrt(hidden) embedding scale, Gemma 2/3's logit soft cap, Granite's embedding and
logit multipliers, Cohere's logit scale, Gemma 3 / OLMo 3's per-layer-kind rotary, Llama 4's
chunked attention mask, OLMo's norm without parameters, Falcon's alibi=None argument,
Apertus' persistent buffers, Phi's LM-head bias beside a tied weight, MoE experts. The truth
is transformers' model itself (tiny random config, every weight perturbed so no norm is one
and no bias zero): the pipeline (pipe=1, built from the save_pretrained directory, where
transformers renames GPT-NeoX's head and stores MoE experts one by one) must give its logits,
with and without a padding mask, its loss and gradients for one step and its parameters after
an AdamW step, under the model's own names (fp32, ~1e-5); the exported directory must load with
from_pretrained and give the pipeline's logits. Structures it does not read are a ValueError
from hf_layer_specs itself, before any process group is touched.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs  # noqa: E402

VOCAB, SEQ, BATCH, LR = 96, 8, 3, 1e-2
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
_MIXED = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])  # window shorter than SEQ
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
FAMILIES = {  # model_type: (config fields, tie_word_embeddings)
    "gemma": ({}, True),                                     # embedding * sqrt(hidden)
    "gemma2": (dict(sliding_window=4, final_logit_softcapping=3.0), True),
    "gemma3_text": (dict(_MIXED, final_logit_softcapping=3.0), False),  # rotary per layer kind
    "granite": (dict(embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5,
                     attention_multiplier=0.3), False),
    "cohere": (dict(logit_scale=0.5), True),
    "olmo": ({}, False),                                     # final LayerNorm without parameters
    "olmo3": (_MIXED, False),
    "falcon": (dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None), False),  # alibi=None
    "llama4_text": (dict(_MOE, attention_chunk_size=4, intermediate_size_mlp=64), False),  # chunked mask
    "apertus": ({}, False),                                  # xIELU's persistent buffers
    "phi": (dict(partial_rotary_factor=0.5), True),          # lm_head.bias beside the tied weight
    "qwen3": ({}, True),
    "phi3": ({}, False),
    "gpt_neox": (dict(rotary_pct=0.5), False),
    "starcoder2": (dict(sliding_window=4), True),
    "mixtral": (_MOE, False),                                # experts stored one by one
    "gpt_oss": (dict(_MIXED, num_local_experts=4, num_experts_per_tok=2), False),
    "deepseek_v3": (dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_group=1, topk_group=1, num_key_value_heads=4, head_dim=None), False),
}


def _config(family: str, fields: dict, tie: bool):
    kwargs = {k: v for k, v in {**_COMMON, **fields}.items() if v is not None}
    config = transformers.AutoConfig.for_model(family, **kwargs)
    for name, value in vars(config).items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(config, name, 0.0)
    config.tie_word_embeddings = tie
    return config


def _model(family: str):
    fields, tie = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, fields, tie))
    with torch.no_grad():
        for p in model.parameters():  # no norm weight one, no bias zero
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    return ids, mask, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _pipeline(family: str, root: str):
    """Logits (plain, masked), loss, gradients and stepped parameters by Hugging Face name; exported logits."""
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf.layers import _HFLayer
    from pipezero.topology import Grid
    from pipezero.train.checkpoint.hf_export import export_hf

    model = _model(family)
    model.save_pretrained(f"{root}/{family}")
    pipe = PipelineModule(hf_layer_specs(f"{root}/{family}"), grid=Grid(pipe=1), loss_fn=causal_lm_loss)
    ids, mask, targets = _batch()
    with torch.no_grad():
        logits, masked = pipe(ids), pipe((ids, mask))
    loss = pipe.loss(pipe(ids), targets)
    loss.backward()
    named = {n: p for layer in pipe.modules() if isinstance(layer, _HFLayer) for n, p in layer.hf_parameters()}
    grads = {n: p.grad.clone() for n, p in named.items()}
    torch.optim.AdamW(pipe.parameters(), lr=LR).step()
    export_hf(pipe, f"{root}/{family}-export")
    with torch.no_grad():
        return logits, masked, loss.detach(), grads, {n: p.detach() for n, p in named.items()}, pipe(ids)


def _truth(family: str, microbatches: int = 1):
    """The same of transformers' model: logits, masked logits, loss, gradients, parameters after the step.

    With microbatches > 1 the step's gradients accumulate over the batch split by examples:
    the same arithmetic in another reduction order, whose distance is the parameters' yardstick.
    """
    model = _model(family)
    ids, mask, targets = _batch()
    with torch.no_grad():
        logits, masked = model(ids).logits, model(ids, attention_mask=mask).logits
    loss = causal_lm_loss(model(ids).logits, targets)
    if microbatches == 1:
        loss.backward()
    else:  # equal parts: the mean of their means is the batch's mean
        for part_ids, part_targets in zip(ids.chunk(microbatches), targets.chunk(microbatches)):
            (causal_lm_loss(model(part_ids).logits, part_targets) / microbatches).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    return logits, masked, loss.detach(), grads, {n: p.detach() for n, p in model.named_parameters()}


def _close(a, b, what: str, atol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _step_spread(want_params: dict, split_params: dict) -> dict[str, float]:
    """Per parameter, twice the reference's own distance between two reduction orders, plus 1e-5.

    AdamW's first step moves each element by about lr * sign(gradient): a near-zero gradient
    whose rounding differs between two correct reductions moves by up to 2 lr. One element of
    Mixtral's experts did so between two CPUs at a fixed 1e-5; gradients stay compared at 1e-5.
    """
    return {n: 1e-5 + 2 * (want_params[n] - split_params[n]).abs().max().item() for n in want_params}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_equals_transformers(family, tmp_path):
    logits, masked, loss, grads, params, exported = run(_pipeline, 1, family, str(tmp_path))[0]
    want_logits, want_masked, want_loss, want_grads, want_params = _truth(family)
    atol = _step_spread(want_params, _truth(family, microbatches=BATCH)[4])
    keep = _batch()[1].bool()  # padded positions' outputs are not defined
    _close(logits, want_logits, "logits")
    _close(masked[keep], want_masked[keep], "logits under a padding mask")
    _close(loss, want_loss, "loss")
    assert set(grads) == set(want_grads), set(grads) ^ set(want_grads)
    for name in want_grads:
        _close(grads[name], want_grads[name], f"gradient of {name}")
        _close(params[name], want_params[name], f"{name} after one AdamW step", atol[name])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{family}-export"))
    with torch.no_grad():
        _close(loaded(_batch()[0]).logits, exported, "from_pretrained of the export")


UNSUPPORTED = {  # model_type: (config fields, what the error must name)
    "opt": (dict(ffn_dim=64, word_embed_proj_dim=32), r"OPTDecoder.*learned positions \(a plain nn.Embedding\).*"
                                                      r"unrecognised .*OPTLearnedPositionalEmbedding"),
    "bloom": (dict(n_layer=2, n_head=4), r"one final norm.*found 1 layer lists, norms "
                                         r"\['word_embeddings_layernorm', 'ln_f'\]"),
    "falcon": (dict(alibi=True, head_dim=None), r"FalconForCausalLM has config.alibi=True: its ALiBi position bias"),
    "qwen3_next": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32), r"layer_types has \['linear_attention'\]; expected"),
}


@pytest.mark.parametrize("family", list(UNSUPPORTED))
def test_unsupported_structure_is_named(family):
    fields, pattern = UNSUPPORTED[family]
    with pytest.raises(ValueError, match=pattern):
        hf_layer_specs(_config(family, fields, False))


def test_checkpoint_without_the_models_tensors_is_named(tmp_path):
    _model("mixtral").save_pretrained(tmp_path)
    qwen3 = _config("qwen3", {}, False)  # a config whose model holds other tensors than the checkpoint
    qwen3.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"lacks \d+ tensors .*q_norm.*do not map onto them; expected a directory"):
        hf_layer_specs(str(tmp_path))


# -- tensor parallelism ------------------------------------------------------------------------
def _tensor_grads(families: list[str]) -> dict:
    """Each family at pipe 1 x tensor 2: logits, loss and the whole gradients by Hugging Face name."""
    from pipezero.comm import all_reduce, partial_grad_group
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.hf import hf_tensor_plan
    from pipezero.pipe.hf.layers import _HFLayer
    from pipezero.pipe.tensor_parallel import whole_tensor
    from pipezero.topology import Grid

    out = {}
    for family in families:
        pipe = PipelineModule(hf_layer_specs(_model(family)), grid=Grid(pipe=1, tensor=2), loss_fn=causal_lm_loss,
                              tensor_plan=hf_tensor_plan())
        ids, _, targets = _batch()
        logits = pipe(ids)
        loss = pipe.loss(logits, targets)
        loss.backward()
        for p in pipe.parameters():  # a MoE block's, each tensor rank's share (an optimizer's reduction sums them)
            if partial_grad_group(p) is not None:
                all_reduce(p.grad, group=partial_grad_group(p))
        named = {n: p for layer in pipe.modules() if isinstance(layer, _HFLayer) for n, p in layer.hf_parameters()}
        out[family] = logits.detach(), loss.detach(), {n: whole_tensor(p, p.grad) for n, p in named.items()}
    return out


def test_tensor_2_equals_transformers_with_per_head_norms_and_moe_blocks():
    """Qwen3's and Gemma 3's q_norm / k_norm weigh every head with one replicated weight: each tensor rank
    saw its own heads only, so their gradients were partial (0.01 off) and differed between the ranks. GPT-NeoX's
    fused query_key_value is split by whole heads (its q, k and v together). A MoE block beside a tensor split
    (pipe/tensor_tokens.py): Llama 4's (a shared expert, a sigmoid router that is an nn.Linear of its own, the
    block returning its router logits too) and Mixtral's, each tensor rank routing half the tokens
    (hf_tensor_plan refused both before). Each equals transformers' logits, loss and gradients; one launch."""
    families = ["qwen3", "gemma3_text", "gpt_neox", "llama4_text", "mixtral"]
    for rank_out in run(_tensor_grads, 2, families, timeout=240):
        for family in families:
            logits, loss, grads = rank_out[family]
            want_logits, _, want_loss, want_grads, _ = _truth(family)
            _close(logits, want_logits, f"{family} logits")
            _close(loss, want_loss, f"{family} loss")
            assert set(grads) == set(want_grads)
            for name in want_grads:
                _close(grads[name], want_grads[name], f"{family} gradient of {name}")


@pytest.mark.parametrize("family, pattern", [
    ("olmo3", r"Olmo3DecoderLayer.self_attn.q_norm \(Olmo3RMSNorm, 32 parameters\) normalises across heads "
              r"\(head_dim=8\)"),
    ("phi3", r"Phi3DecoderLayer.self_attn: \['o_proj \(in_features=32\)'\] do not read the width 64 that its "
             r"last projection qkv_proj returns"),
    ("falcon", r"FalconDecoderLayer.self_attention: no projection of \['query_key_value'\] gives dense's "
               r"in_features=32 \(\[64\]\): a fused projection"),
    ("deepseek_v3", r"DeepseekV3DecoderLayer.self_attn: \['q_b_proj \(in_features=16\)', 'kv_b_proj"),
])
def test_tensor_plan_refuses_what_a_split_gets_wrong(family, pattern):
    """Phi-3's o_proj (registered before qkv_proj) became column-parallel and qkv_proj row-parallel, Falcon's
    fused query_key_value was cut across its parts, OLMo 3's q_norm over all heads saw half of them: each
    failed in its first forward with a shape error from inside transformers (or, where shapes fit, would
    compute something else); DeepSeek's latent projections likewise."""
    from pipezero.pipe.hf import HFDecoderLayer, hf_tensor_plan

    fields, tie = FAMILIES[family]
    with torch.device("meta"):
        layer = hf_layer_specs(_config(family, fields, tie))[1].build()  # the first decoder layer
    assert isinstance(layer, HFDecoderLayer)
    with pytest.raises(ValueError, match=pattern):
        hf_tensor_plan()(layer)


def test_gpt_neox_splits_whole_heads_and_refuses_a_degree_that_does_not_divide_them():
    """GPT-NeoX's fused query_key_value (q, k, v head by head) was split by its width alone: a tensor degree
    dividing 3 x heads but not the heads cut a head's q, k and v apart, and one dividing neither crashed in the
    forward. Its heads are the unit now, checked before any collective."""
    from pipezero.pipe.hf import hf_tensor_plan
    from pipezero.pipe.tensor_parallel import check_tensor_plan

    fields, tie = FAMILIES["gpt_neox"]
    with torch.device("meta"):
        layer = hf_layer_specs(_config("gpt_neox", fields, tie))[1].build()
    plan = hf_tensor_plan()(layer)
    fused = next(path for path in plan if path.endswith("query_key_value"))
    heads = layer.get_submodule(fused).out_features // 3 // layer.inner.attention.head_size
    assert plan[fused].heads == heads
    check_tensor_plan(layer, plan, heads)
    with pytest.raises(ValueError, match=rf"splits heads={heads} over tensor degree {heads + 1}"):
        check_tensor_plan(layer, plan, heads + 1)


def test_tensor_plan_sums_the_gradients_of_a_per_head_layer_norm():
    """Phi's qk_layernorm is a LayerNorm of head_dim with a bias: a weight and a bias per head, not a norm
    across heads (their sum of sizes was compared with head_dim and the family refused)."""
    from pipezero.pipe.hf import HFDecoderLayer, hf_tensor_plan
    from pipezero.pipe.tensor_parallel import ReplicateOnShards

    fields, tie = FAMILIES["phi"]
    with torch.device("meta"):
        layer = hf_layer_specs(_config("phi", dict(fields, qk_layernorm=True), tie))[1].build()
    assert isinstance(layer, HFDecoderLayer)
    plan = hf_tensor_plan()(layer)
    assert {k for k, v in plan.items() if isinstance(v, ReplicateOnShards)} == {
        "inner.self_attn.q_layernorm", "inner.self_attn.k_layernorm"}
