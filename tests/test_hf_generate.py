"""Generation from the training weights of hf_layer_specs pipelines equals transformers' model.generate.

The truth is transformers' own greedy `generate` on the same tiny model (left-padded prompts,
a stop token that ends one row early): pipe 1 x data 2 under ZeRO-3 inside `gathered` (and
then with ZeRO-2's whole weights, and with the stage-3 hooks alone), and a pipeline of 2
stages (each stage its own layers and KV cache, prompts in 2 microbatches), for Llama
(untied), Qwen2 (tied embedding and head on different stages) and GPT-2 (learned positions).
With LoRA adapters (peft's, loaded into lora_specs) the pipeline gives peft's generate.
Each runs the static-cache decode step (pipe/hf/static_cache.py, the default) and transformers'
DynamicCache; sampled tokens equal transformers' sampled generate from the same global seed,
and after a training step the gathered phase generates the new weights' tokens.
Weights are scaled so greedy decoding does not repeat one token, which would hide a wrong
cache or mask. A generation phase must leave parameter memory and every live tensor where
they were (the KV caches freed) and the optimizer state untouched.
"""

import functools
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import GPipe, PipelineModule, PipelineRunner  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_config, hf_layer_specs, hf_state_dict  # noqa: E402
from pipezero.pipe.hf.generate import Sampling, hf_generate  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroConfig, ZeroOptimizer, gathered  # noqa: E402
from pipezero.zero.gathered import parameter_bytes  # noqa: E402

VOCAB, NEW = 64, 8
SHARP = {"llama": 20.0, "mistral": 10.0, "qwen2": 20.0, "gpt2": 40.0}  # checked: no greedy row repeats one token
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=4),  # window < prompt + new tokens
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=1, eos_token_id=2),
}
PAD = 0


def _model(family: str, weights: dict[str, torch.Tensor] | None = None):
    """The family's tiny model, its weights sharpened; or with `weights` (Hugging Face names) loaded."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(SHARP[family])
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied: one copy
    return model.eval()


def _greedy(model, prompts) -> torch.Tensor:
    ids, mask = prompts
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          eos_token_id=None)


@functools.cache
def _sampled_truth(family: str) -> torch.Tensor:
    """transformers' sampled tokens (temperature, top-k, top-p) from global seed 3."""
    (ids, mask), model = _prompts(), _model(family)
    torch.manual_seed(3)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, pad_token_id=PAD,
                          eos_token_id=None, **SAMPLE)


@functools.cache
def _checkpoint(family: str, root: str) -> str:
    path = f"{root}/gen-{family}"
    _model(family).save_pretrained(path)
    return path


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Four prompts of lengths 6, 4, 6 and 2, left-padded to 6."""
    ids = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :4] = 0
    return ids.masked_fill(mask == 0, PAD), mask


@functools.cache
def _truth(family: str) -> tuple[torch.Tensor, int]:
    """transformers' greedy tokens, and a stop token that ends one row after 3 new tokens (not the others)."""
    model, (ids, mask) = _model(family), _prompts()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          eos_token_id=None)
    new = free[:, 6:]
    assert all(len(set(row)) > 3 for row in new.tolist()), new
    row = next(r for r in range(len(new)) if int(new[r, 2]) not in new[:, :3].flatten().tolist()[:3 * r] +
               new[r, :2].tolist() + new[r + 1:, :3].flatten().tolist())
    stop = int(new[row, 2])
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          eos_token_id=stop)
    assert (want[row, 9:] == PAD).all() and want.shape[1] > 9, want  # the row stopped and was padded
    return want, stop


@functools.cache
def _truth_all_stop(family: str) -> tuple[torch.Tensor, list[int]]:
    """transformers' greedy tokens with stop tokens that end every row within 3 new tokens (it stops early)."""
    model, (ids, mask) = _model(family), _prompts()
    stops = sorted({int(t) for t in _truth(family)[0][:, 6 + 2]} | {int(t) for t in _truth(family)[0][:1, 6:7]})
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                          eos_token_id=stops)
    assert 6 < want.shape[1] < 6 + NEW, want  # the batch ended early
    return want, stops


def _live_tensor_bytes() -> int:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


# -- pipe 1 x data 2: ZeRO-3 inside gathered, the stage-3 hooks alone, ZeRO-2 ------------------------
SAMPLE = dict(temperature=0.9, top_k=8, top_p=0.9)
STATIC = [True, False]  # hf_generate(static_cache=): the static decode step, transformers' DynamicCache


def _both(module, ids, mask, stop):
    """Greedy tokens with the static cache and with the DynamicCache."""
    return [hf_generate(module, ids, NEW, mask, stop_tokens=[stop], pad_token_id=PAD, static_cache=static)
            for static in STATIC]


def _sampled(module, ids, mask):
    """Sampled tokens, static and dynamic, each from global seed 3 (transformers' generate samples so)."""
    out = []
    for static in STATIC:
        torch.manual_seed(3)
        out.append(hf_generate(module, ids, NEW, mask, Sampling(**SAMPLE), static_cache=static))
    return out


def _data2(path: str, stop: int):
    grid = Grid(pipe=1)
    ids, mask = _prompts()
    module = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=causal_lm_loss)
    opt = ZeroOptimizer(torch.optim.AdamW(module.parameters(), lr=1e-3), group=grid.data_group, module=module,
                        config=ZeroConfig(stage=3, stage3_param_persistence_threshold=64))
    _train_once(module, opt)
    state = _optimizer_state(opt)
    before, live_before = parameter_bytes(module, opt), _live_tensor_bytes()
    with gathered(opt):
        during = parameter_bytes(module, opt)
        out = _both(module, ids, mask, stop)
        sampled = _sampled(module, ids, mask)
    after = parameter_bytes(module, opt)
    live_after = _live_tensor_bytes() - sum(t.untyped_storage().nbytes() for t in out + sampled)
    hooks = None
    if not module.tied:  # see _train_once
        hooks = _both(module, ids, mask, stop)  # no gathered: the stage-3 hooks gather per layer
    unchanged = all(torch.equal(a, b) for a, b in zip(state, _optimizer_state(opt)))
    _train_once(module, opt, lr=0.05)  # new weights: the next phase must generate with them
    with gathered(opt):
        trained = hf_generate(module, ids, NEW, mask, pad_token_id=PAD)
        weights = {name: t.clone() for name, t in hf_state_dict(module).items()}
    zero2 = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=causal_lm_loss)
    ZeroOptimizer(torch.optim.AdamW(zero2.parameters(), lr=1e-3), group=grid.data_group, stage=2)
    whole = _both(zero2, ids, mask, stop)
    return out, sampled, hooks, whole, (before, during, after), (live_before, live_after), unchanged, (trained, weights)


def _train_once(module: PipelineModule, opt: ZeroOptimizer, lr: float = 0.0) -> None:
    """One step (AdamW's decay off); at lr 0 optimizer state exists and the weights stay the checkpoint's."""
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = lr, 0.0
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    if module.tied:  # ZeRO-3 gathers a tied head's weight only through the runner (which then drives gathering)
        PipelineRunner(module, GPipe(num_microbatches=1), optimizer=opt).train_step(ids, ids)
    else:
        opt.backward(causal_lm_loss(module(ids), ids))
    opt.step()
    opt.zero_grad()


def _optimizer_state(opt: ZeroOptimizer) -> list[torch.Tensor]:
    return [t.clone() for b in opt.buckets for t in [b.master, *opt.state[b.master].values()]
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])  # untied, sliding window, tied + positions
def test_data2_zero3_gathered_hooks_and_zero2_equal_transformers_generate(family, tmp_path_factory):
    want, stop = _truth(family)
    sampled_want = _sampled_truth(family)
    path = _checkpoint(family, str(tmp_path_factory.getbasetemp()))
    for rank, (out, sampled, hooks, whole, (before, during, after), (live_b, live_a), unchanged, trained) in (
            enumerate(run(_data2, 2, path, stop, timeout=300))):
        for static, o, s, w in zip(STATIC, out, sampled, whole):
            assert torch.equal(o, want), (rank, static, o, want)
            assert torch.equal(s, sampled_want), (rank, static, "sampled", s, sampled_want)
            assert torch.equal(w, want), (rank, static, "ZeRO-2")
        assert hooks is None or all(torch.equal(h, want) for h in hooks), (rank, "stage-3 hooks, no gathered()")
        new_tokens, weights = trained
        new_want = _greedy(_model(family, weights), _prompts())
        assert not torch.equal(new_want, _greedy(_model(family), _prompts())), "the training step changed no token"
        assert torch.equal(new_tokens, new_want), (rank, "after a training step", new_tokens, new_want)
        assert during > before, "the phase gathered nothing: the test would pass without ZeRO-3"
        assert after == before, (rank, before, during, after)
        assert abs(live_a - live_b) < 1024, (rank, live_b, live_a)  # KV caches and gathered copies freed
        assert unchanged, "the optimizer state changed during generation"


# -- pipe 2: each stage its own layers and KV cache ------------------------------------------------
def _pipe2(path: str, stop: int, microbatches: int, all_stops: list[int]):
    ids, mask = _prompts()
    module = PipelineModule(hf_layer_specs(path), grid=Grid(pipe=2), loss_fn=causal_lm_loss,
                            partition_method="uniform")
    out = [hf_generate(module, ids, NEW, mask, stop_tokens=[stop], pad_token_id=PAD, microbatches=microbatches,
                       static_cache=static) for static in STATIC]
    sampled = [hf_generate(module, ids, NEW, mask, Sampling(**SAMPLE), generator=torch.Generator().manual_seed(5),
                           microbatches=microbatches, static_cache=static) for static in STATIC]
    with pytest.raises(ValueError, match=r"cuda_graph=True\): input_ids are on cpu"):
        hf_generate(module, ids, NEW, mask, cuda_graph=True)
    with pytest.raises(ValueError, match=r"cuda_graph=True\) replays the static decode step.*static_cache=False"):
        hf_generate(module, ids, NEW, mask, static_cache=False, cuda_graph=True)
    with pytest.raises(ValueError, match=r"rows \[1, 3\] have padding after a token .*pad the prompts on the left"):
        hf_generate(module, ids, NEW, mask.flip(-1))  # right padding: transformers gives other tokens, with a warning
    ended = [hf_generate(module, ids, NEW, mask, stop_tokens=all_stops, pad_token_id=PAD, microbatches=microbatches,
                         static_cache=static) for static in STATIC]
    config = hf_config(module)
    config._attn_implementation = "eager"  # the static cache's additive float mask
    out.append(hf_generate(module, ids, NEW, mask, stop_tokens=[stop], pad_token_id=PAD, microbatches=microbatches,
                           static_cache=True))
    config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"static_cache=True\): config._attn_implementation='flex_attention'"):
        hf_generate(module, ids, NEW, mask, static_cache=True)
    config._attn_implementation = "sdpa"
    return out, sampled, len(list(module.parameters())), ended


@pytest.mark.parametrize("family, microbatches", [("llama", 2), ("qwen2", None), ("gpt2", 1)])
def test_pipe2_equals_transformers_generate(family, microbatches, tmp_path_factory):
    want, stop = _truth(family)
    path = _checkpoint(family, str(tmp_path_factory.getbasetemp()))
    ended_want, all_stops = _truth_all_stop(family)
    results = run(_pipe2, 2, path, stop, microbatches, all_stops, timeout=300)
    assert results[0][2] != results[1][2] or family != "llama"  # each stage held only its own layers
    for rank, (out, sampled, _, ended) in enumerate(results):
        for static, e in zip(STATIC, ended):
            assert torch.equal(e, ended_want), (rank, static, "every row stopped early", e, ended_want)
        for static, o in zip([*STATIC, "static, eager attention"], out, strict=True):
            assert torch.equal(o, want), (rank, static, o, want)
        assert torch.equal(sampled[0], sampled[1]) and torch.equal(sampled[0], results[0][1][0])
        assert not torch.equal(sampled[0][:, 6:], want[:, 6:])


def test_sampling_top_k_one_is_greedy_and_bad_input_is_named():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(Sampling(temperature=1.3, top_k=1).choose(logits, gen), logits.argmax(-1))
    assert torch.equal(Sampling(temperature=1.0, top_p=1e-6).choose(logits, gen), logits.argmax(-1))
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1.0)
    with pytest.raises(TypeError, match="PipelineModule of hf_layer_specs"):
        hf_generate(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long), 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_decode_equals_transformers_and_follows_new_weights():
    """ZeRO-3 on one GPU: each gathered phase captures its own graph, so after a training step the
    tokens are the new weights' (a graph kept from the last phase would replay freed weights)."""
    from pipezero.topology.env import init_distributed

    init_distributed()  # a world of one
    device = torch.device("cuda", torch.cuda.current_device())
    grid = Grid(pipe=1)
    module = PipelineModule(hf_layer_specs(_model("llama")), grid=grid, loss_fn=causal_lm_loss, device=device)
    opt = ZeroOptimizer(torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.0), group=grid.data_group,
                        module=module, config=ZeroConfig(stage=3))
    ids, mask = (t.to(device) for t in _prompts())
    with gathered(opt):  # lazy state that stays: the side stream's cuBLAS workspace
        hf_generate(module, ids, NEW, mask, pad_token_id=PAD, cuda_graph=True)
    tokens = []
    for _ in range(2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with gathered(opt):
            out = hf_generate(module, ids, NEW, mask, pad_token_id=PAD, cuda_graph=True)
            weights = {name: t.cpu() for name, t in hf_state_dict(module).items()}
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < 8192, "KV caches or the graph's pool left behind"
        want = _greedy(_model("llama", weights), _prompts())  # transformers on the CPU, the same weights
        assert torch.equal(out.cpu(), want), ("stale or wrong graph", out, want)
        tokens.append(out)
        opt.backward(causal_lm_loss(module(ids), ids))
        opt.step()
        opt.zero_grad()
    assert not torch.equal(tokens[0], tokens[1]), "the training step changed no token: the test shows nothing"


# -- LoRA adapters applied: the policy RL trains is usually base + adapters ---------------------------
_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


@functools.cache
def _lora_truth(root: str) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    """The base checkpoint and a peft adapter directory; peft's greedy tokens and the base's."""
    peft = pytest.importorskip("peft")
    base_tokens = _greedy(_model("llama"), _prompts())
    base = _model("llama")
    base.save_pretrained(f"{root}/lora-base")
    model = peft.get_peft_model(base, peft.LoraConfig(**_LORA))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 2.0, generator=torch.Generator().manual_seed(7))
    model.save_pretrained(f"{root}/lora-adapter")
    return f"{root}/lora-base", f"{root}/lora-adapter", _greedy(model.eval(), _prompts()), base_tokens


def _pipe2_lora(base: str, adapter: str):
    from pipezero.pipe.lora import LoraConfig, lora_specs
    from pipezero.train.checkpoint.lora_export import load_peft_adapter

    module = PipelineModule(lora_specs(hf_layer_specs(base), LoraConfig(**_LORA)), grid=Grid(pipe=2),
                            loss_fn=causal_lm_loss, partition_method="uniform")
    loaded = load_peft_adapter(module, adapter)
    ids, mask = _prompts()
    return loaded, [hf_generate(module, ids, NEW, mask, pad_token_id=PAD, microbatches=2, static_cache=static)
                    for static in STATIC]


def test_pipe2_with_lora_adapters_equals_peft_generate(tmp_path_factory):
    base, adapter, want, base_tokens = _lora_truth(str(tmp_path_factory.getbasetemp()))
    assert not torch.equal(want, base_tokens), "the adapters change no token: the test would pass without them"
    results = run(_pipe2_lora, 2, base, adapter, timeout=300)
    loaded = [name for names, _ in results for name in names]
    assert len(loaded) == len(set(loaded)) == 2 * 3 * 2, loaded  # 2 layers x 3 targets x (A, B), once each
    for rank, (_, outs) in enumerate(results):
        for static, out in zip(STATIC, outs, strict=True):
            assert torch.equal(out, want), (rank, static, out, want)
