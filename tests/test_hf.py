"""Hugging Face causal LMs through hf_layer_specs equal the same model trained in one process.

The truth is transformers' own model (Llama, Mistral, Qwen2, GPT-2; tiny random configs,
tied and untied embeddings) trained on the whole batch with plain AdamW. Each grid builds
the pipeline from the saved checkpoint directory (every stage reads only its own tensors,
by name) and must give the same loss every step and the same final parameters under the
model's own names; the exported directory must load with from_pretrained and give the
pipeline's logits. With activation checkpointing each decoder layer must really run its
forward again in backward, with tensor=2 its projections must really be split (torch's
parallelize_module), and both must train the same. ZeRO-3 on the model itself (module=) must
train the same and, under `gathered`, its own generate() must give one process's greedy tokens.
"""

import functools
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import Interleaved1F1B, OneFOneB, PipelineModule, PipelineRunner, ZeroBubbleV  # noqa: E402
from pipezero.pipe.hf import HFDecoderLayer, causal_lm_loss, hf_layer_specs, hf_state_dict, hf_tensor_plan  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.train.checkpoint.hf_export import export_hf  # noqa: E402
from pipezero.zero import ZeroOptimizer, gathered  # noqa: E402
from pipezero.zero.config import ZeroConfig  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 8, 3, 1e-3
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=4),      # sliding mask shorter than SEQ
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=1, eos_token_id=2),
}
SCHEDULES = {"1f1b": (lambda: OneFOneB(num_microbatches=4), 1, "looped"),
             "interleaved": (lambda: Interleaved1F1B(num_microbatches=4), 2, "looped"),
             "zbv": (lambda: ZeroBubbleV(num_microbatches=4), 2, "v")}


def _model(family: str, scale: float = 1.0):
    """The family's tiny model; scale > 1 multiplies its matrices so greedy decoding does not repeat one token."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model


@functools.cache
def _checkpoint(family: str, root: str) -> str:
    path = f"{root}/{family}"
    _model(family).save_pretrained(path)
    return path


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


@functools.cache
def _truth(family: str, scale: float = 1.0) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    model = _model(family, scale)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        loss = causal_lm_loss(model(ids).logits, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}, model


def _mine(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    share = x.shape[0] // grid.data_size
    return x[grid.data_rank * share:(grid.data_rank + 1) * share]


def _train_pipe(path: str, pipe: int, tensor: int, schedule: str, stage: int, export_to: str | None,
                recompute: int = 0):
    make, chunks, placement = SCHEDULES[schedule]
    grid = Grid(pipe=pipe, tensor=tensor)
    model = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=causal_lm_loss, num_chunks=chunks,
                           placement=placement, partition_method="uniform", activation_checkpoint_interval=recompute,
                           tensor_plan=hf_tensor_plan() if tensor > 1 else None)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), stage=stage, group=grid.data_group)
    runner = PipelineRunner(model, make(), optimizer=opt)
    if tensor > 1:
        _check_sharded(model, tensor)
    calls = _count_decoder_forwards(model)
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        losses.append(runner.train_step(_mine(ids, grid), _mine(targets, grid)).item())
        assert opt.step() is True
        opt.zero_grad()
    passes = 2 if recompute else 1  # activation checkpointing runs each forward again in backward
    assert all(n == passes * STEPS * make().num_microbatches for n in calls.values()), calls
    logits = None
    if export_to is not None:
        logits = runner.eval_step(_batch(STEPS)[0][:4])
        export_hf(model, export_to)
    return losses, hf_state_dict(model), logits


def _check_sharded(model: PipelineModule, tensor: int) -> None:
    """Every projection of the local decoder layers holds 1/tensor of its weight, a plain local tensor
    marked with its shard (pipe/tensor_linear.py)."""
    from pipezero.comm import tensor_shard

    for layer in model.modules():
        if isinstance(layer, HFDecoderLayer):
            for name, m in layer.named_modules():
                if isinstance(m, torch.nn.Linear):
                    w, shard = m.weight, tensor_shard(m.weight)
                    assert type(w) is torch.nn.Parameter and shard is not None, name
                    assert w.numel() * tensor == shard.full_shape.numel(), name


def _count_decoder_forwards(model: PipelineModule) -> dict[int, int]:
    """Forward calls of each local decoder layer, by index, counted from now on.

    A pre-hook: torch's recomputation stops as soon as backward has the tensors it needs, so
    a recomputed forward may never reach the forward hooks that run after it.
    """
    calls: dict[int, int] = {}
    for layer in model.modules():
        if isinstance(layer, HFDecoderLayer):
            calls[layer.index] = 0
            layer.register_forward_pre_hook(lambda m, args: calls.__setitem__(m.index, calls[m.index] + 1))
    return calls


def _check_training(family: str, results) -> None:
    losses, params, _ = _truth(family)
    seen = set()
    for rank_losses, state, _ in results:
        torch.testing.assert_close(rank_losses, losses, rtol=1e-5, atol=1e-5)
        for name, value in state.items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-5, msg=name)
            seen.add(name)
    tied = {"lm_head.weight"} if _model(family).config.tie_word_embeddings else set()
    assert seen == set(params) - tied, set(params) - seen


def _check_export(path: str, results) -> None:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = _batch(STEPS)[0][:4]
    logits = [r[2] for r in results if r[2] is not None]
    assert logits
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family, schedule, stage, export, recompute", [
    ("llama", "1f1b", 1, False, 0),          # untied
    ("mistral", "interleaved", 2, False, 1),  # untied, sliding-window mask, activation checkpointing
    ("qwen2", "zbv", 1, False, 0),           # tied embedding and head on one rank (V placement)
    ("gpt2", "1f1b", 2, True, 0),            # tied across stages, learned positions; exported
])
def test_pipe2_data2_parity(family, schedule, stage, export, recompute, tmp_path_factory):
    root = str(tmp_path_factory.getbasetemp())
    out = f"{root}/export-{family}" if export else None
    results = run(_train_pipe, 4, _checkpoint(family, root), 2, 1, schedule, stage, out, recompute, timeout=300)
    _check_training(family, results)
    if export:
        _check_export(out, results)


def test_pipe2_data2_tensor2_parity_and_export(tmp_path_factory):
    root = str(tmp_path_factory.getbasetemp())
    out = f"{root}/export-llama-3d"
    results = run(_train_pipe, 8, _checkpoint("llama", root), 2, 2, "1f1b", 1, out, timeout=300)
    _check_training("llama", results)
    _check_export(out, results)


SHARP = 10.0  # greedy tokens of the scaled model vary (checked: no row repeats one token)


def _zero3_then_generate(family: str, prompt: torch.Tensor):
    grid = Grid(pipe=1)
    model = _model(family, SHARP)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), group=grid.data_group, module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=64))
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        loss = causal_lm_loss(model(_mine(ids, grid)).logits, _mine(targets, grid))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    torch.distributed.all_reduce(losses, group=grid.data_group)
    with gathered(opt):
        tokens = model.generate(prompt, max_new_tokens=10, do_sample=False)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (losses / grid.data_size).tolist(), state, tokens


@pytest.mark.parametrize("family", ["qwen2"])
def test_zero3_module_and_generate_under_gathered(family):
    losses_1p, params, truth = _truth(family, SHARP)
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    want = truth.generate(prompt, max_new_tokens=10, do_sample=False)
    assert all(len(set(row)) > 3 for row in want[:, 5:].tolist()), want
    results = run(_zero3_then_generate, 2, family, prompt, timeout=300)
    for losses, state, tokens in results:
        torch.testing.assert_close(losses, losses_1p, rtol=1e-5, atol=1e-5)
        for name, value in state.items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(tokens, want)


def test_unsupported_architecture_is_named():
    opt = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                 num_attention_heads=4, word_embed_proj_dim=32)
    with pytest.raises(ValueError, match="expected the module holding its token embedding .*ModuleList of num_hidden"):
        hf_layer_specs(opt)
    with pytest.raises(TypeError, match="checkpoint directory, a PreTrainedModel or a PretrainedConfig"):
        hf_layer_specs({"hidden_size": 32})


def test_an_older_transformers_is_named_with_the_fix():
    """transformers 5.17 (a GPU image's) failed in a layer's first call with "unexpected keyword argument
    'cache'"; now the layer's construction names the version and the upgrade."""
    from pipezero.pipe.hf.layer_inputs import check_transformers

    with pytest.raises(ImportError, match=r"transformers 5\.17\.0 is older .*\(5\.24\): pip install -U"):
        check_transformers("5.17.0")
    for fine in (transformers.__version__, "5.24.0", "6.0.0.dev0", "git-main"):
        check_transformers(fine)


def _gpt2_tensor_plan() -> str:
    grid = Grid(pipe=1, tensor=2)
    try:
        PipelineModule(hf_layer_specs(CONFIGS["gpt2"]()), grid=grid, tensor_plan=hf_tensor_plan())
    except ValueError as e:
        return str(e)
    return "no error"


def test_tensor_plan_of_conv1d_family_fails_on_every_rank():
    for message in run(_gpt2_tensor_plan, 2):
        assert "Conv1D" in message and "tensor=1" in message


def _export_zero3_then_other_layouts(path: str, out: str) -> tuple:
    """ZeRO-3 (pipe 1 x data 2) exported without its optimizer, then with it; then pipe 2 and pipe 1
    again into the same folder, each export's weights changed, so a stale file would show."""
    from pipezero.pipe.hf import hf_shapes
    grid = Grid(pipe=1)
    model = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=causal_lm_loss)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), group=grid.data_group, module=model,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=64))
    try:
        export_hf(model, out)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    export_hf(model, out, optimizer=opt)
    files = [sorted(p.name for p in Path(out).iterdir())]
    with gathered(opt):
        whole = {n: t.clone() for n, t in hf_state_dict(model).items()}
    assert all(t.shape == hf_shapes(model)[n] for n, t in whole.items())
    states = [whole]
    for pipe in (2, 1):
        model = PipelineModule(hf_layer_specs(path), grid=Grid(pipe=pipe), loss_fn=causal_lm_loss)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(pipe)
        every = [None] * 2
        torch.distributed.all_gather_object(every, hf_state_dict(model))
        states.append({k: v for part in every for k, v in part.items()})
        export_hf(model, out)
        files.append(sorted(p.name for p in Path(out).iterdir()))
        if pipe == 2 and torch.distributed.get_rank() == 0:
            states.append(transformers.AutoModelForCausalLM.from_pretrained(out).state_dict())
        torch.distributed.barrier()
    return refused, files, states


def test_export_refuses_released_zero3_parameters_and_replaces_another_layout(tmp_path_factory):
    """Issue 28 items 4 and 5: no [0]-shaped tensors written; no stale model.safetensors read instead of shards."""
    root = str(tmp_path_factory.getbasetemp())
    out = f"{root}/export-layouts"
    (refused, files, states), _ = run(_export_zero3_then_other_layouts, 2, _checkpoint("llama", root), out,
                                      timeout=300)
    assert "not whole" in refused and "optimizer=opt" in refused and "gathered(opt)" in refused, refused
    zero3, sharded, loaded_sharded, single = states
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    one_file = ["config.json", "model.safetensors"]
    assert files == [one_file, ["config.json", *shards], one_file]
    for name, value in sharded.items():
        torch.testing.assert_close(loaded_sharded[name], value, rtol=0, atol=0, msg=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, value in single.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    assert set(zero3) == set(single) and all(zero3[n].shape == single[n].shape for n in zero3)


def _export_after_delayed_update(path: str, out: str) -> dict[str, torch.Tensor]:
    """ZeRO-2 with a delayed (DPU) offloaded update, STEPS steps, exported with its optimizer; then the
    trained weights: the last step's update applied, as save_state's checkpoint holds them."""
    grid = Grid(pipe=1)
    model = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=causal_lm_loss)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), group=grid.data_group,
                        config=ZeroConfig(stage=2, offload_optimizer=True, delayed_param_update=True))
    runner = PipelineRunner(model, OneFOneB(num_microbatches=2), optimizer=opt)
    for step in range(STEPS):
        ids, targets = _batch(step)
        runner.train_step(_mine(ids, grid), _mine(targets, grid))
        opt.step()
        opt.zero_grad()
    export_hf(model, out, optimizer=opt)
    opt.apply_delayed_update()
    return {n: t.clone() for n, t in hf_state_dict(model).items()}


def test_export_with_the_optimizer_holds_a_delayed_update(tmp_path):
    """delayed_param_update: the last step's CPU update reaches the model only at the next step() (or
    apply_delayed_update); export_hf(optimizer=opt) wrote the weights without it, one step behind the
    trained ones, while save_state's checkpoint of the same step holds them."""
    trained = run(_export_after_delayed_update, 2, _checkpoint("qwen2", str(tmp_path)), str(tmp_path / "out"))[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def test_trained_head_is_not_tied_and_unused_tensors_are_reported(tmp_path, caplog):
    """Issue 28 item 6, as transformers 5 loads it: config.json says tie_word_embeddings, the checkpoint
    holds its own, different lm_head.weight: untied, with a warning; a tensor the model does not use is
    reported; a checkpoint holding only the head ties the embedding to it."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    edit = {**json.loads((tmp_path / "config.json").read_text()), "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(edit))
    state = load_file(tmp_path / "model.safetensors")
    save_file({**state, "model.extra.weight": torch.ones(3)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    ids = _batch(0)[0][:2]
    with caplog.at_level("WARNING"):
        model = PipelineModule(hf_layer_specs(str(tmp_path)), grid=Grid(pipe=1), loss_fn=causal_lm_loss)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight  # transformers 5 refused the tie
    with torch.no_grad():
        torch.testing.assert_close(model(ids), loaded(ids).logits, rtol=1e-6, atol=1e-6)
    assert "NOT tied" in caplog.text and "model.extra.weight" in caplog.text, caplog.text
    del state["model.embed_tokens.weight"]  # only the head stored: both are the head's tensor
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = PipelineModule(hf_layer_specs(str(tmp_path)), grid=Grid(pipe=1), loss_fn=causal_lm_loss)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids), loaded(ids).logits, rtol=1e-6, atol=1e-6)
