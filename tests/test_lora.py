"""LoRA through the pipeline equals the same peft model trained in one process with plain AdamW.

The truth is peft.get_peft_model on transformers' tiny Llama (adapters on attention and MLP
projections), trained on the whole batch with torch.optim.AdamW on its trainable parameters.
Its starting adapters (B made non-zero, so that every adapter moves from the first step) are
saved as a peft adapter directory; each grid builds the pipeline from the base checkpoint,
adapts it with lora_specs, loads that directory and trains through ZeroOptimizer: the losses
and adapters must equal the truth's, the base must be bit-identical afterwards, frozen weights
must never get a gradient, and under ZB-V the W steps must hold adapter GEMMs only. The
exported adapter directory must load with PeftModel.from_pretrained and give the pipeline's
logits; the merged export must load with from_pretrained and give them too.
"""

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from harness import run  # noqa: E402
from peft_start import peft_start, peft_train  # noqa: E402
from pipezero.pipe import Interleaved1F1B, OneFOneB, PipelineModule, PipelineRunner, ZeroBubbleV  # noqa: E402
from pipezero.pipe import deferred_linear  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs, hf_state_dict, hf_tensor_plan  # noqa: E402
from pipezero.pipe.lora import (LoraConfig, adapter_state_dict, apply_lora, lora_specs,  # noqa: E402
                                trainable_parameters)
from pipezero.pipe.lora_tensor import lora_tensor_plan  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.train.checkpoint.lora_export import export_merged_hf, export_peft_adapter, load_peft_adapter  # noqa: E402
from pipezero.zero import ZeroOptimizer  # noqa: E402
from pipezero.zero.config import ZeroConfig  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 8, 3, 1e-2
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
SCHEDULES = {"1f1b": (lambda: OneFOneB(num_microbatches=4), 1, "looped"),
             "interleaved": (lambda: Interleaved1F1B(num_microbatches=4), 2, "looped"),
             "zbv": (lambda: ZeroBubbleV(num_microbatches=4), 2, "v")}


def _peft_config():
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)


def _base(tied: bool = False):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_LLAMA, tie_word_embeddings=tied))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


@functools.cache
def _truth(root: str, tied: bool = False) -> dict:
    """Base checkpoint and starting adapters on disk; the one-process peft run's losses and adapters."""
    root = f"{root}/tied" if tied else root
    model = peft_start(_base(tied), _peft_config(), root)
    losses, adapters = peft_train(model, (_batch(step) for step in range(STEPS)), lr=LR)
    return {"base": f"{root}/base", "start": f"{root}/start", "losses": losses, "adapters": adapters}


def _mine(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    share = x.shape[0] // grid.data_size
    return x[grid.data_rank * share:(grid.data_rank + 1) * share]


def _keep_recorder(names: dict[int, str], seen: set[str]):
    """WeightSink.keep, recording which parameters a W step computes."""
    keep = deferred_linear.WeightSink.keep

    def recording(self, weight, bias, x, grad):
        seen.add(names[id(weight)])
        return keep(self, weight, bias, x, grad)
    return recording


def _train_pipe(truth: dict, schedule: str, stage: int, export_to: str | None, tensor: int = 1,
                costs: list | None = None) -> dict:
    make, chunks, placement = SCHEDULES[schedule]
    grid = Grid(pipe=2, tensor=tensor)
    specs = lora_specs(hf_layer_specs(truth["base"]), _peft_config())
    model = PipelineModule(specs, grid=grid, loss_fn=causal_lm_loss, num_chunks=chunks, placement=placement,
                           partition_method=costs or "uniform",
                           tensor_plan=lora_tensor_plan(hf_tensor_plan()) if tensor > 1 else None)
    if tensor > 1:
        _check_split(model, tensor)
    assert load_peft_adapter(model, truth["start"]) or costs  # with costs: the last stage holds the head only
    base = {n: t.clone() for n, t in hf_state_dict(model).items() if ".lora_" not in n}
    config = ZeroConfig(stage=stage, stage3_param_persistence_threshold=0)
    trainable = [{"params": trainable_parameters(model)}]  # a group may be empty, a parameter list may not
    opt = ZeroOptimizer(torch.optim.AdamW(trainable, lr=LR), group=grid.data_group,
                        module=model if stage == 3 else None, config=config)
    runner = PipelineRunner(model, make(), optimizer=opt)
    names, in_w, keep = {id(p): n for n, p in model.named_parameters()}, set(), deferred_linear.WeightSink.keep
    deferred_linear.WeightSink.keep = _keep_recorder(names, in_w)
    try:
        losses = []
        for step in range(STEPS):
            ids, targets = _batch(step)
            losses.append(runner.train_step(_mine(ids, grid), _mine(targets, grid)).item())
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
            assert opt.step() is True
            opt.zero_grad()
    finally:
        deferred_linear.WeightSink.keep = keep
    out = {"losses": losses, "in_w": in_w, "logits": None}
    if export_to is not None:
        out["logits"] = runner.eval_step(_batch(STEPS)[0][:4])
    with (opt.gathered_parameters() if stage == 3 else _nothing()):  # ZeRO-3: the adapters whole
        out["adapters"] = {n: t.clone() for n, t in adapter_state_dict(model).items()}
        out["base_same"] = all(torch.equal(t, base[n]) for n, t in hf_state_dict(model).items() if n in base)
        if export_to is not None:
            export_peft_adapter(model, f"{export_to}/adapter", _peft_config(), base_model_name_or_path=truth["base"])
            export_merged_hf(model, f"{export_to}/merged")
    return out


def _check_split(model: PipelineModule, tensor: int) -> None:
    """The adapted projections' base weights hold 1/tensor of their values; the adapters are whole."""
    from torch.distributed.tensor import DTensor

    from pipezero.pipe.lora import LoraLinear

    adapted = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert adapted
    for m in adapted:
        assert isinstance(m.weight, DTensor) and m.weight.to_local().numel() * tensor == m.weight.numel()
        for w in (m.lora_A.weight, m.lora_B.weight):
            assert isinstance(w, DTensor) and w.to_local().numel() == w.numel()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _check(truth: dict, results: list[dict], split: bool) -> None:
    seen = set()
    for r in results:
        torch.testing.assert_close(r["losses"], truth["losses"], rtol=1e-5, atol=1e-5)
        assert r["base_same"]
        for name, value in r["adapters"].items():
            torch.testing.assert_close(value, truth["adapters"][name], rtol=1e-5, atol=1e-5, msg=name)
            seen.add(name)
        assert all(".lora_" in n for n in r["in_w"]), r["in_w"]  # W covers adapters only
    assert seen == set(truth["adapters"]), set(truth["adapters"]) - seen
    assert not split or any(r["in_w"] for r in results)


def _check_export(truth: dict, out: str, results: list[dict]) -> None:
    logits = next(r["logits"] for r in results if r["logits"] is not None)
    ids = _batch(STEPS)[0][:4]
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(truth["base"]),
                                            f"{out}/adapter")
    merged = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/merged")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(merged(ids).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule, stage, export, tied", [
    ("1f1b", 1, True, False),
    ("zbv", 2, False, False),
    ("interleaved", 0, False, False),
    ("1f1b", 3, False, True),     # a frozen embedding tied to the head across the two stages; ZeRO-3
    ("zbv", 3, True, True),       # tied on one rank (V placement)
])
def test_pipe2_data2_lora_equals_peft(schedule, stage, export, tied, tmp_path_factory):
    truth = _truth(str(tmp_path_factory.getbasetemp()), tied)
    out = str(tmp_path_factory.mktemp(f"export-{schedule}")) if export else None
    results = run(_train_pipe, 4, truth, schedule, stage, out, timeout=300)
    _check(truth, results, split=schedule == "zbv")
    if export:
        _check_export(truth, out, results)


def test_stage_without_adapters_trains_and_exports(tmp_path_factory):
    """The last stage holds the LM head only: no trainable parameter there, an empty param group."""
    truth = _truth(str(tmp_path_factory.getbasetemp()))
    out = str(tmp_path_factory.mktemp("export-head-stage"))
    results = run(_train_pipe, 4, truth, "1f1b", 2, out, 1, [1, 1, 1, 1, 50, 50], timeout=300)
    assert [bool(r["adapters"]) for r in results] == [True, True, False, False]
    _check(truth, results, split=False)
    _check_export(truth, out, results)


def test_pipe2_tensor2_lora_equals_peft_and_exports(tmp_path_factory):
    truth = _truth(str(tmp_path_factory.getbasetemp()))
    out = str(tmp_path_factory.mktemp("export-tensor"))
    results = run(_train_pipe, 4, truth, "1f1b", 1, out, 2, timeout=300)
    _check(truth, results, split=False)
    _check_export(truth, out, results)


# -- bad input: the same ValueError on every rank, before any collective ---------------------------
def _specs():
    return hf_layer_specs(transformers.LlamaConfig(**_LLAMA))


def test_target_that_matches_nothing_is_named():
    with pytest.raises(ValueError, match="matches no nn.Linear.*model.layers.0.self_attn.q_proj"):
        lora_specs(_specs(), LoraConfig(target_modules=["qkv"]))


def test_rank_larger_than_layer_is_named():
    with pytest.raises(ValueError, match=r"r=64\) is larger than 'model.layers.0.self_attn.q_proj'"):
        lora_specs(_specs(), LoraConfig(r=64, target_modules=["q_proj"]))


def test_unsupported_family_and_options_are_named():
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    with pytest.raises(ValueError, match="Conv1D.*nn.Linear layers only"):
        lora_specs(hf_layer_specs(gpt2), LoraConfig(target_modules=["c_attn"]))
    with pytest.raises(ValueError, match="use_dora"):
        LoraConfig.of(peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    for option in [dict(target_parameters=["mlp.gate_proj.weight"]), dict(trainable_token_indices=[3, 4]),
                   dict(layer_replication=[[0, 1], [0, 1]]), dict(alora_invocation_tokens=[5])]:  # peft adapts more
        with pytest.raises(ValueError, match=f"peft.LoraConfig with {{'{next(iter(option))}'"):
            lora_specs(_specs(), peft.LoraConfig(r=4, target_modules=["q_proj"], **option))
    with pytest.raises(ValueError, match="r=0"):
        LoraConfig(r=0)


def test_layer_forward_equals_peft_and_regex_targets():
    """One process: the adapted layers in sequence give peft's logits; a regex selects as peft's does."""
    base = _base()
    specs = lora_specs(hf_layer_specs(base), LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.(q|v)_proj"))
    layers = torch.nn.Sequential(*(s.build() for s in specs))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.(q|v)_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    state = {k.removeprefix("base_model.model."): v for k, v in peft.get_peft_model_state_dict(model).items()}
    from pipezero.pipe.lora import load_adapter_state_dict
    assert len(load_adapter_state_dict(layers, state)) == len(state) == 12
    ids = _batch(0)[0]
    with torch.no_grad():
        torch.testing.assert_close(layers(ids), model(ids).logits, rtol=0, atol=0)
    trainable = sum(p.numel() for p in trainable_parameters(layers))
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_frozen_base_gets_no_master_and_no_state_in_the_chain():
    """Handed every parameter, MasterWeights copies only what trains, and Adam holds state for it only."""
    from pipezero.precision import LossScaler, MasterWeights

    specs = lora_specs(_specs(), LoraConfig(r=4, target_modules=["q_proj"]))
    layers = torch.nn.Sequential(*(s.build() for s in specs)).to(torch.bfloat16)
    opt = LossScaler(MasterWeights(torch.optim.AdamW(layers.parameters(), lr=1e-3)), init_scale=2.0 ** 8)
    ids, targets = _batch(0)
    opt.scale(causal_lm_loss(layers(ids).float(), targets)).backward()
    assert opt.step() is not False
    trainable = trainable_parameters(layers)
    masters = opt.inner._pairs
    assert len(masters) == len(trainable) == 6 and all(p.requires_grad for p, _ in masters)
    frozen = [p for p in layers.parameters() if not p.requires_grad]
    assert all(p.grad is None for p in frozen)
    assert len(opt.inner.inner.state) == len(trainable)


def test_merged_forward_equals_adapters_and_restores_them():
    """Generation may run merged (one GEMM a projection): same logits, and the adapters come back untouched."""
    from pipezero.pipe.lora import merged

    specs = lora_specs(_specs(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    layers = torch.nn.Sequential(*(s.build() for s in specs))
    with torch.no_grad():
        for p in trainable_parameters(layers):
            p.normal_(0, 0.1)
    before = {n: p.clone() for n, p in layers.named_parameters()}
    ids = _batch(0)[0]
    with torch.no_grad():
        want = layers(ids)
        with merged(layers):
            assert not trainable_parameters(layers)
            got = layers(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    after = dict(layers.named_parameters())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert all(after[n] is not None and after[n].requires_grad == (".lora_" in n) for n in after)


def test_export_hf_of_an_adapted_model_is_refused(tmp_path):
    """export_hf writes transformers' tensors: with adapters it wrote them beside the base weights, and
    from_pretrained skipped them as unexpected and loaded the untrained base."""
    from pipezero.train.checkpoint.hf_export import export_hf

    layers = torch.nn.Sequential(*(s.build() for s in lora_specs(_specs(), LoraConfig(target_modules=["q_proj"]))))
    with pytest.raises(ValueError, match=r"6 tensors are not the model's, e.g. \['model.layers.0.self_attn.q_proj"
                                         r".lora_A.weight'.*export_merged_hf\(model, dir\)"):
        export_hf(layers, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_merged_hf(layers, tmp_path / "merged")  # adapters folded in: transformers' tensors only
    assert (tmp_path / "merged" / "model.safetensors").exists()


def test_peft_directory_with_more_than_the_models_adapters_is_refused(tmp_path_factory, tmp_path):
    """A directory adapting modules the model holds without adapters, or holding peft's modules_to_save,
    loaded with those tensors silently dropped: a model other than peft's PeftModel.from_pretrained."""
    truth = _truth(str(tmp_path_factory.getbasetemp()))  # adapters on TARGETS
    fewer = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    layers = torch.nn.Sequential(*(s.build() for s in lora_specs(hf_layer_specs(truth["base"]), fewer)))
    with pytest.raises(ValueError, match=r"adapts 18 tensors of modules this rank holds without adapters, e.g. "
                                         r"\['model.layers.0.mlp.down_proj.lora_A.weight'"):
        load_peft_adapter(layers, truth["start"])
    saved = peft.get_peft_model(_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         modules_to_save=["lm_head"]))
    saved.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"1 tensors are not LoRA adapters, e.g. \['lm_head.weight'\]"):
        load_peft_adapter(layers, tmp_path)


def test_peft_directory_config_round_trip_and_scaling_check(tmp_path_factory):
    """A peft directory's own config builds the model that loads it; another lora_alpha is refused."""
    truth = _truth(str(tmp_path_factory.getbasetemp()))
    config = LoraConfig.of(peft.LoraConfig.from_pretrained(truth["start"]))
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 8, set(TARGETS))
    layers = torch.nn.Sequential(*(s.build() for s in lora_specs(hf_layer_specs(truth["base"]), config)))
    assert len(load_peft_adapter(layers, truth["start"])) == len(truth["adapters"])
    other = LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS)
    layers = torch.nn.Sequential(*(s.build() for s in lora_specs(hf_layer_specs(truth["base"]), other)))
    with pytest.raises(ValueError, match="r=4, lora_alpha=8 scale the update by 2.*by \\[4.0\\]"):
        load_peft_adapter(layers, truth["start"])
    patterned = tmp_path_factory.mktemp("patterned")  # per-module alpha: refused, not loaded at one scale
    theirs = peft.get_peft_model(_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                          alpha_pattern={"v_proj": 32}))
    theirs.save_pretrained(patterned)
    layers = torch.nn.Sequential(*(s.build() for s in lora_specs(hf_layer_specs(truth["base"]), config)))
    with pytest.raises(ValueError, match=r"scales some modules apart \({'alpha_pattern': {'v_proj': 32}}\)"):
        load_peft_adapter(layers, patterned)


def _load_fewer_on_pipe2(truth: dict) -> str | None:
    grid = Grid(pipe=2)
    fewer = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = PipelineModule(lora_specs(hf_layer_specs(truth["base"]), fewer), grid=grid, loss_fn=causal_lm_loss,
                           partition_method=[1, 1, 1, 1, 50, 50])  # the last stage: no decoder layer
    try:
        load_peft_adapter(model, truth["start"])
    except ValueError as err:
        return str(err)
    return None


def test_a_peft_directory_refused_on_one_stage_is_refused_on_every_rank(tmp_path_factory):
    """Only the stage holding decoder layers finds the dropped adapters; the other stage used to load and
    go on to its next collective, where it waited for a peer that had raised."""
    truth = _truth(str(tmp_path_factory.getbasetemp()))
    first, last = run(_load_fewer_on_pipe2, 2, truth)
    assert first is not None and "holds without adapters" in first, first
    assert last is not None and "holds without adapters" in last and "rank(s) [0]" in last, last


def test_all_linear_targets_what_peft_targets():
    """peft's target_modules="all-linear" (every linear layer but the output layer) was read as a regular
    expression and matched nothing; lora_specs now adapts exactly the modules peft's get_peft_model does."""
    base = _base()
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    wanted = {k.removeprefix("base_model.model.") for k in peft.get_peft_model_state_dict(theirs)}
    specs = lora_specs(hf_layer_specs(base.config), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    mine = set(adapter_state_dict(torch.nn.Sequential(*(s.build() for s in specs))))
    assert mine == wanted and "lm_head.lora_A.weight" not in mine and len(mine) == 2 * 7 * _LLAMA["num_hidden_layers"]
    with pytest.raises(ValueError, match="one module does not say which layer is the output layer"):
        apply_lora(torch.nn.Linear(4, 4), LoraConfig(target_modules="all-linear"))


def test_targets_peft_puts_on_fused_experts_are_refused():
    """peft (0.21, 0.22) adapts the fused experts' parameters a target names on a Qwen3-MoE (a bare down_proj,
    a pattern, all-linear) and those transformers v4's names stand for (Mixtral's w2, a Qwen-MoE's gate_proj
    and up_proj, which name no module now); the pipeline's LoRA adapts nn.Linear only, so such a config is
    refused, not trained with fewer adapters than peft's. A name qualified to the dense projections is taken."""
    from test_hf_router import _model

    specs = hf_layer_specs(_model("qwen3_moe").config)
    for targets in (["q_proj", "down_proj"], r".*\.(q_proj|down_proj)", "all-linear"):
        theirs = peft.get_peft_model(_model("qwen3_moe"), peft.LoraConfig(r=2, target_modules=targets))
        assert any(k.endswith("mlp.experts.lora_A.weight") for k in peft.get_peft_model_state_dict(theirs))
        with pytest.raises(ValueError, match="fused experts.*nn.Linear layers only"):
            lora_specs(specs, LoraConfig(r=2, target_modules=targets))
    for family, targets in (("mixtral", ["q_proj", "w2"]), ("qwen3_moe", ["q_proj", "gate_proj", "up_proj"])):
        theirs = peft.get_peft_model(_model(family), peft.LoraConfig(r=2, target_modules=targets))
        assert any(k.endswith("mlp.experts.lora_A.weight") for k in peft.get_peft_model_state_dict(theirs))
        with pytest.raises(ValueError, match=r"match no module of this model with fused experts"):
            lora_specs(hf_layer_specs(_model(family).config), LoraConfig(r=2, target_modules=targets))
    moe2 = hf_layer_specs(_model("qwen2_moe").config)
    assert lora_specs(moe2, LoraConfig(r=2, target_modules=["q_proj", "shared_expert.down_proj"]))
