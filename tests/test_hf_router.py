"""The experts' load-balancing loss (config.output_router_logits=True) through the pipeline equals transformers'.

transformers' MoE forward adds router_aux_loss_coef x a loss over every layer's router logits
at once (not a per-layer sum); pipe/hf/router.py carries the layers' sums with the activations.
The truth is transformers' own `model(ids, attention_mask=mask, labels=labels).loss` and its
backward, per microbatch (as gradient accumulation computes it), for tiny Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE and gpt-oss (whose coefficient is raised so the term weighs), and DeepSeek-V3, which
adds no term. pipe 1 (one microbatch, with and without a padding mask) and pipe 2 under 1F1B
(Qwen3-MoE and Mixtral, two microbatches, masked, two MoE layers per stage), and the same at sequence 2
(each rank one slice of every row, the gradients' mean over the two): loss and every gradient by Hugging
Face name, fp32, 1e-5. Each fails with the term left out of the loss; the sequence case with the sums
left per slice, or added over the slices without the backward's sum. And the fused head with its loss
compiled (aot_eager), the term added by WithRouterLoss (finetune's way), against the same truth.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402

VOCAB, SEQ, BATCH = 64, 8, 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, output_router_logits=True, router_aux_loss_coef=0.5, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"] * 2),  # attention sinks, biased router
    "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                        n_group=1, topk_group=1, num_key_value_heads=4, head_dim=None),
}
PIPE2 = ["qwen3_moe", "mixtral"]


def _model(family: str):
    kwargs = {k: v for k, v in {**_COMMON, **FAMILIES[family]}.items() if v is not None}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(family, **kwargs))
    with torch.no_grad():
        for p in model.parameters():  # no router all zeros, no norm one
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _batch(masked: bool, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=gen)
    labels = torch.randint(3, VOCAB, (rows, SEQ), generator=gen)
    if not masked:
        return ids, None, labels
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[2, :1] = 0  # left padding, in each microbatch of two rows
    return ids, mask, labels.masked_fill(mask == 0, -100)


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """transformers' labels as causal_lm_loss' targets: shifted left, the last position ignored."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _truth(family: str, masked: bool, microbatches: int, rows: int = BATCH) -> tuple[torch.Tensor, dict]:
    """transformers' loss and gradients, the batch (of `rows` rows) split into microbatches (the mean of their
    losses)."""
    model = _model(family)
    ids, mask, labels = _batch(masked, rows)
    losses = []
    for i in range(microbatches):
        part = slice(i * rows // microbatches, (i + 1) * rows // microbatches)
        out = model(ids[part], attention_mask=None if mask is None else mask[part], labels=labels[part])
        if family != "deepseek_v3":
            assert out.aux_loss is not None and out.aux_loss > 0  # the term is there and weighs
        (out.loss / microbatches).backward()
        losses.append(out.loss.detach())
    return torch.stack(losses).mean(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _holding(family: str, grads: dict) -> torch.nn.Module:
    """A fresh transformers model of `family` whose parameters hold `grads` (by name) as their .grad."""
    model = _model(family)
    for name, p in model.named_parameters():
        p.grad = grads.get(name)
    return model


def _clipped_to_half(family: str, grads: dict) -> tuple[dict, float]:
    """`grads` clipped by torch.nn.utils.clip_grad_norm_ to half their global norm, and that max norm."""
    model = _holding(family, grads)
    max_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])) / 2
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, max_norm


def _adam_updates(family: str, grads: dict, clip: float, lr: float, eps: float) -> dict:
    """Each parameter's update (before - after) by torch's own clip_grad_norm_ and one Adam step on `grads`."""
    model = _holding(family, grads)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    torch.optim.Adam(model.parameters(), lr=lr, eps=eps).step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters() if p.grad is not None}


def _pipeline(families: list[str], masked: bool, microbatches: int, experts: str | None = None,
              recompute: int = 0, sequence: int = 1) -> dict:
    """Each family's loss and gradients (by Hugging Face name) through PipelineRunner on grid pipe=world, or
    pipe=world / sequence x sequence (each rank a slice of every row; its gradients averaged over the
    sequence group, as ZeRO averages them)."""
    import torch.distributed as dist

    from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner
    from pipezero.pipe.hf import causal_lm_loss, hf_config, hf_layer_specs
    from pipezero.pipe.hf.layers import _HFLayer
    from pipezero.pipe.sequence import shard_batch, whole_positions
    from pipezero.topology import Grid

    out = {}
    for family in families:
        grid = Grid(pipe=dist.get_world_size() // sequence, sequence=sequence)
        specs = hf_layer_specs(_model(family), experts=experts)
        assert hf_config(specs)._experts_implementation == (experts or "grouped_mm")  # transformers' default
        module = PipelineModule(specs, grid=grid, loss_fn=causal_lm_loss, partition_method="uniform",
                                activation_checkpoint_interval=recompute)
        runner = PipelineRunner(module, OneFOneB(num_microbatches=microbatches))
        ids, mask, labels = _batch(masked)
        if sequence > 1:  # positions of the whole rows, then each rank's slice
            batch = shard_batch((ids, mask, whole_positions(ids)), _targets(labels), grid)
            loss = runner.train_step(*batch)
        else:
            loss = runner.train_step(ids if mask is None else (ids, mask), _targets(labels))
        if microbatches > 1 and sequence == 1:  # without targets: the logits and each microbatch's term
            evaluated = runner.eval_step(ids)
            if evaluated is not None:
                assert evaluated[0].shape == (*ids.shape, VOCAB) and evaluated[1].shape == (microbatches,)
        grads = {n: p.grad for layer in module.modules() if isinstance(layer, _HFLayer)
                 for n, p in layer.hf_parameters() if p.grad is not None}
        for g in grads.values() if sequence > 1 else ():
            dist.all_reduce(g, group=grid.sequence_group)
            g /= sequence
        out[family] = loss, grads
    return out


def _check(results: list[dict], masked: bool, microbatches: int) -> None:
    for family in results[0]:
        want_loss, want_grads = _truth(family, masked, microbatches)
        grads = {}
        for rank_out in results:
            loss, rank_grads = rank_out[family]
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5, msg=lambda m: f"{family} loss: {m}")
            grads.update(rank_grads)
        assert set(grads) == set(want_grads), (family, set(grads) ^ set(want_grads))
        for name, want in want_grads.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{family} gradient of {name}: {m}")


def test_router_loss_pipe1_equals_transformers():
    """Without a padding mask (T counted by histc) and with one (T and P weighed by it)."""
    for families, masked in ((["qwen3_moe", "qwen2_moe"], False), (["mixtral", "olmoe", "gpt_oss", "deepseek_v3"], True)):
        _check(run(_pipeline, 1, families, masked, 1, timeout=180), masked, 1)


def test_router_loss_pipe2_1f1b_equals_transformers():
    """The layers' sums cross the stage boundary forward and their gradient comes back; with activation
    checkpointing each recomputed layer adds its sums again."""
    _check(run(_pipeline, 2, PIPE2, True, 2, timeout=240), True, 2)
    _check(run(_pipeline, 2, ["mixtral"], True, 2, None, 1, timeout=240), True, 2)


def test_router_loss_over_a_sequence_split_equals_transformers():
    """Sequence 2: each rank routes its slice of every row, and the term is transformers' over all the rows'
    tokens (the layers' sums added over the sequence group before the product: per slice it is not)."""
    _check(run(_pipeline, 2, PIPE2, True, 2, None, 0, 2, timeout=240), True, 2)


def _compiled_loss(family: str) -> dict:
    """The routed model through PipelineModule with the fused head and its loss compiled (aot_eager: traced as
    inductor would trace it on a GPU, where compiling is the default), the term added by WithRouterLoss."""
    from pipezero.pipe import PipelineModule
    from pipezero.pipe.compile import CompileConfig
    from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs
    from pipezero.pipe.hf.router import WithRouterLoss
    from pipezero.pipe.hf.layers import _HFLayer
    from pipezero.topology import Grid

    module = PipelineModule(hf_layer_specs(_model(family), fused_loss=True), grid=Grid(pipe=1),
                            loss_fn=WithRouterLoss(causal_lm_loss), compile=CompileConfig(backend="aot_eager"))
    ids, _, labels = _batch(False)
    loss = module.loss(module(ids), _targets(labels))
    loss.backward()
    grads = {n: p.grad.clone() for layer in module.modules() if isinstance(layer, _HFLayer)
             for n, p in layer.hf_parameters() if p.grad is not None}
    return {family: (loss.detach(), grads)}


def test_a_compiled_loss_adds_the_router_term_as_transformers():
    _check(run(_compiled_loss, 1, "qwen3_moe", timeout=240), False, 1)


def test_unchecked_router_loss_is_named():
    from pipezero.pipe.hf import hf_layer_specs

    config = transformers.AutoConfig.for_model("phimoe", **{**_COMMON, "num_local_experts": 4,
                                                             "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match=r"output_router_logits=True, and its router loss is checked against "
                                         r"transformers only for \['gpt_oss'"):
        hf_layer_specs(config)


def test_grouped_mm_experts_equal_the_loop():
    """transformers' experts switch through hf_layer_specs(experts=): one grouped GEMM over the tokens sorted by
    expert (torch's grouped_mm, on CPU too) gives the loop over experts' loss and gradients."""
    families = ["qwen3_moe", "mixtral"]
    grouped, loop = (run(_pipeline, 1, families, True, 1, experts, timeout=180)[0] for experts in ("grouped_mm", "eager"))
    for family in families:
        torch.testing.assert_close(grouped[family][0], loop[family][0], rtol=1e-5, atol=1e-6)
        for name, want in loop[family][1].items():
            torch.testing.assert_close(grouped[family][1][name], want, rtol=1e-5, atol=1e-6, msg=name)
