"""Generation from the training weights of hf_layer_specs pipelines equals transformers' model.generate.

The truth is transformers' own greedy `generate` on the same tiny model (left-padded prompts,
a stop token that ends one row early): pipe 1 x data 2 under ZeRO-3 inside `gathered` (and
then with ZeRO-2's whole weights, and with the stage-3 hooks alone), and a pipeline of 2
stages (each stage its own layers and KV cache, prompts in 2 microbatches), for Llama
(untied), Qwen2 (tied embedding and head on different stages) and GPT-2 (learned positions).
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
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs  # noqa: E402
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


def _model(family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(SHARP[family])
    return model.eval()


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


def _live_tensor_bytes() -> int:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


# -- pipe 1 x data 2: ZeRO-3 inside gathered, the stage-3 hooks alone, ZeRO-2 ------------------------
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
        out = hf_generate(module, ids, NEW, mask, stop_tokens=[stop], pad_token_id=PAD)
    after, live_after = parameter_bytes(module, opt), _live_tensor_bytes() - out.untyped_storage().nbytes()
    hooks = None
    if not module.tied:  # see _train_once
        hooks = hf_generate(module, ids, NEW, mask, stop_tokens=[stop], pad_token_id=PAD)  # no gathered: per layer
    unchanged = all(torch.equal(a, b) for a, b in zip(state, _optimizer_state(opt)))
    zero2 = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=causal_lm_loss)
    ZeroOptimizer(torch.optim.AdamW(zero2.parameters(), lr=1e-3), group=grid.data_group, stage=2)
    whole = hf_generate(zero2, ids, NEW, mask, stop_tokens=[stop], pad_token_id=PAD)
    return out, hooks, whole, (before, during, after), (live_before, live_after), unchanged


def _train_once(module: PipelineModule, opt: ZeroOptimizer) -> None:
    """One step at lr 0 (AdamW's decay off): optimizer state exists, the weights stay the checkpoint's."""
    for group in opt.param_groups:
        group["lr"], group["weight_decay"] = 0.0, 0.0
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
    path = _checkpoint(family, str(tmp_path_factory.getbasetemp()))
    for rank, (out, hooks, whole, (before, during, after), (live_b, live_a), unchanged) in enumerate(
            run(_data2, 2, path, stop, timeout=300)):
        assert torch.equal(out, want), (rank, out, want)
        assert hooks is None or torch.equal(hooks, want), (rank, "stage-3 hooks, no gathered()")
        assert torch.equal(whole, want), (rank, "ZeRO-2")
        assert during > before, "the phase gathered nothing: the test would pass without ZeRO-3"
        assert after == before, (rank, before, during, after)
        assert abs(live_a - live_b) < 1024, (rank, live_b, live_a)  # KV caches and gathered copies freed
        assert unchanged, "the optimizer state changed during generation"


# -- pipe 2: each stage its own layers and KV cache ------------------------------------------------
def _pipe2(path: str, stop: int, microbatches: int):
    ids, mask = _prompts()
    module = PipelineModule(hf_layer_specs(path), grid=Grid(pipe=2), loss_fn=causal_lm_loss,
                            partition_method="uniform")
    out = hf_generate(module, ids, NEW, mask, stop_tokens=[stop], pad_token_id=PAD, microbatches=microbatches)
    sampled = [hf_generate(module, ids, NEW, mask, Sampling(temperature=0.9, top_k=8, top_p=0.9),
                           generator=torch.Generator().manual_seed(5), microbatches=microbatches)
               for _ in range(2)]
    return out, sampled, len(list(module.parameters()))


@pytest.mark.parametrize("family, microbatches", [("llama", 2), ("qwen2", None), ("gpt2", 1)])
def test_pipe2_equals_transformers_generate(family, microbatches, tmp_path_factory):
    want, stop = _truth(family)
    path = _checkpoint(family, str(tmp_path_factory.getbasetemp()))
    results = run(_pipe2, 2, path, stop, microbatches, timeout=300)
    assert results[0][2] != results[1][2] or family != "llama"  # each stage held only its own layers
    for rank, (out, sampled, _) in enumerate(results):
        assert torch.equal(out, want), (rank, out, want)
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
