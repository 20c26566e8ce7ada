"""Sequence parallelism (pipe/sequence/) equals transformers' model on the whole sequence in one process.

The truth: the tiny model's loss and gradients on whole rows (packed documents through position ids
that restart, as transformers reads them), one row per microbatch. Each grid splits every row in
`sequence` slices (shard_batch), runs Ulysses attention around the model's own SDPA, and takes one
SGD step of lr 1 through ZeroOptimizer, so each parameter's change is its averaged gradient: the
loss and every gradient must equal the truth's within 1e-5 (fp32). Documents cross the slice
boundaries; key/value heads (2) are fewer than the degree 4 (replicated) and as many as 2 (split).
The GPT of pipezero.train.gpt (its packed rows: ids, positions, segment ids) against its one-process
GPT the same way, pipe 2 x sequence 2 (the tied embedding and head on two stages); tensor 2 x sequence 2
(hf_tensor_plan / gpt_tensor_plan split the heads first, Ulysses exchanges each tensor rank's); Gemma 2
on its eager kernel (soft-capped logits, a sliding window across the slices, as transformers' model
computes them in one process); LoRA adapters (lora_specs, also at tensor 2 x sequence 2) against peft's
model on the same base and starting adapters. Packed rows must take the mask-free path
(pipe/document_attention.py) inside Ulysses: each rank's calls attend whole rows.
"""

import contextlib
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import Interleaved1F1B, OneFOneB, PipelineModule, PipelineRunner, ZeroBubbleV  # noqa: E402
from pipezero.pipe.compile import CompileConfig  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs, hf_tensor_plan  # noqa: E402
from pipezero.pipe.hf.layers import _HFLayer  # noqa: E402
from pipezero.pipe.sequence import check_heads, next_token_labels, shard_batch, whole_positions  # noqa: E402
from pipezero.comm import tensor_shard  # noqa: E402
from pipezero.pipe.tensor_parallel import whole_tensor  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroOptimizer  # noqa: E402

VOCAB, SEQ, ROWS = 64, 16, 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
CONFIGS = {"llama": lambda: transformers.LlamaConfig(**_COMMON),
           "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=8),
           # alternating sliding (window 4 < the row's 16 and the 7-token document) and full layers; weights
           # large enough (initializer_range) that the soft caps bend the logits (the loss moves by 1e-3 without)
           "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=8, sliding_window=4, initializer_range=0.3,
                                                       attn_logit_softcapping=1.0, final_logit_softcapping=3.0)}
KERNELS = {"gemma2": "eager"}  # what transformers loads Gemma 2 with (its SDPA cannot soft-cap); else sdpa
SCHEDULES = {"1f1b": (OneFOneB, 1, "looped"), "interleaved": (Interleaved1F1B, 2, "looped"),
             "zbv": (ZeroBubbleV, 2, "v")}
DOCS = [5, 7, 4]  # packed: documents of 5, 7 and 4 tokens cross the slice boundaries at 4, 8 and 12


def _gpt_config():
    from pipezero.train.gpt.model import GPTConfig

    return GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, seq_len=SEQ)


GPT_CONFIG = _gpt_config()


def _model(family):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[family](),
                                                         attn_implementation=KERNELS.get(family, "sdpa"))


def _batch(packed):
    """(ids, positions, labels) of ROWS whole rows: labels shifted on the whole row, none across documents."""
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))
    positions, labels = whole_positions(ids), next_token_labels(ids)
    if packed:
        positions = torch.cat([torch.arange(n) for n in DOCS]).expand(ROWS, SEQ).contiguous()
        ends = torch.tensor(DOCS).cumsum(0) - 1
        labels[:, ends] = -100  # a document's last token does not predict the next document's first
    return ids, positions, labels


def _truth(family, packed):
    """Loss (mean over rows of each row's token mean) and gradients by Hugging Face name, in one process."""
    model = _model(family)
    ids, positions, labels = _batch(packed)
    losses = [causal_lm_loss(model(ids[i:i + 1], position_ids=positions[i:i + 1], use_cache=False).logits,
                             labels[i:i + 1])
              for i in range(ROWS)]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _mask_free_calls(module_name):
    """The (documents' [B, T], queries' T) of each document_attention call that `module_name` makes."""
    module, seen = importlib.import_module(module_name), []
    attend = module.document_attention

    @torch.compiler.disable
    def recording(q, k, v, docs, **kwargs):
        seen.append((docs.shape, q.shape[2]))
        return attend(q, k, v, docs, **kwargs)

    module.document_attention = recording
    try:
        yield seen
    finally:
        module.document_attention = attend


def _whole_rows(seen):
    """(how many mask-free calls, whether each attended the whole sequence, not a rank's slice)."""
    return len(seen), all(docs == (1, SEQ) and tokens == SEQ for docs, tokens in seen)


def _run(family, pipe, sequence, schedule, stage, packed, compiled=False, tensor=1):
    make, chunks, placement = SCHEDULES[schedule]
    grid = Grid(pipe=pipe, sequence=sequence, tensor=tensor)
    model = PipelineModule(hf_layer_specs(_model(family)), grid=grid, loss_fn=causal_lm_loss, num_chunks=chunks,
                           placement=placement, partition_method="uniform",
                           compile=CompileConfig(backend="aot_eager") if compiled else False,
                           tensor_plan=hf_tensor_plan() if tensor > 1 else None)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), stage=stage, group=grid.data_sequence_group,
                        module=model if stage == 3 else None)
    assert any(tensor_shard(p) is not None for p in model.parameters()) == (tensor > 1)  # heads split first
    before = _by_name(model, opt)
    m = ROWS // grid.data_size
    runner = PipelineRunner(model, make(num_microbatches=m), optimizer=opt)
    ids, positions, labels = _batch(packed)
    rows = slice(grid.data_rank * m, (grid.data_rank + 1) * m)
    inputs, targets = shard_batch((ids[rows], None, positions[rows]), labels[rows], grid)
    with _mask_free_calls("pipezero.pipe.hf.document_attention") as seen:
        loss = runner.train_step(inputs, targets).item()
    opt.step()
    after = _by_name(model, opt)
    return loss, {n: before[n] - after[n] for n in after}, _whole_rows(seen)  # SGD of lr 1: the gradient


def _by_name(model, opt):
    names = {id(p): n for layer in model.modules() if isinstance(layer, _HFLayer) for n, p in layer.hf_parameters()}
    return {names[id(p)]: whole_tensor(p, full).clone() for p, full in opt.full_parameters()}  # tensor: gathered


CASES = [  # (family, pipe, sequence, schedule, ZeRO stage, packed) on 4 ranks: data = 4 / (pipe x sequence)
    ("llama", 1, 4, "1f1b", 0, True),          # 2 key/value heads < degree 4: replicated
    ("llama", 1, 2, "1f1b", 1, True),          # data 2 x sequence 2, ZeRO-1
    ("llama", 2, 2, "1f1b", 0, True),          # the slices flow between stages
    ("llama", 2, 2, "interleaved", 1, True),  # two chunks per rank
    ("llama", 2, 2, "zbv", 0, False),         # a V of chunks, split backward
    ("qwen3", 1, 2, "1f1b", 3, True),          # ZeRO-3 over data x sequence; Qwen3's per-head norms
    ("llama", 1, 2, "1f1b", 0, True, True),    # compiled layers and loss (CUDA's default; traced on CPU)
    ("llama", 1, 2, "1f1b", 1, True, False, 2),  # tensor 2 x sequence 2: 2 heads, 1 key/value head per tensor rank
    ("gemma2", 1, 2, "1f1b", 0, True),         # soft caps, a sliding window across the slices: its eager kernel
]


GPT_CASES = [(2, 2, 1), (1, 2, 0, 2)]  # the GPT's blocks: (pipe, sequence, ZeRO stage[, tensor]), packed rows, 1F1B


def _gpt_batch():
    """(ids, positions, segments) and the next-token targets of packed rows (train/data's GPT inputs)."""
    ids, positions, labels = _batch(packed=True)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)]).expand(ROWS, SEQ).contiguous()
    return (ids, positions, segments), labels.clamp(min=0)  # the GPT's loss trains every position


def _gpt_truth():
    from pipezero.train.gpt.model import GPT, gpt_loss

    model = GPT(GPT_CONFIG)
    inputs, targets = _gpt_batch()
    loss = torch.stack([gpt_loss(model(tuple(t[i:i + 1] for t in inputs)), targets[i:i + 1])
                        for i in range(ROWS)]).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_run(pipe, sequence, stage, tensor=1):
    from pipezero.train.gpt.model import gpt_loss, gpt_specs, gpt_tensor_plan

    grid = Grid(pipe=pipe, sequence=sequence, tensor=tensor)
    model = PipelineModule(gpt_specs(GPT_CONFIG), grid=grid, loss_fn=gpt_loss, partition_method="uniform",
                           tensor_plan=gpt_tensor_plan() if tensor > 1 else None)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), stage=stage, group=grid.data_sequence_group)
    names = {id(p): _gpt_name(n) for n, p in model.named_parameters()}
    before = {names[id(p)]: whole_tensor(p, full).clone() for p, full in opt.full_parameters()}
    m = ROWS // grid.data_size
    runner = PipelineRunner(model, OneFOneB(num_microbatches=m), optimizer=opt)
    inputs, targets = _gpt_batch()
    rows = slice(grid.data_rank * m, (grid.data_rank + 1) * m)
    inputs, targets = shard_batch(tuple(t[rows] for t in inputs), targets[rows], grid)
    with _mask_free_calls("pipezero.train.gpt.model") as seen:
        loss = runner.train_step(inputs, targets).item()
    opt.step()
    grads = {names[id(p)]: before[names[id(p)]] - whole_tensor(p, full) for p, full in opt.full_parameters()}
    return loss, grads, _whole_rows(seen)


def _gpt_name(name):
    """The pipeline's parameter name as the one-process GPT names it (the tied embedding is its layer 0)."""
    return "layers.0." + name.split(".", 2)[2] if name.startswith("tied.") else name


def _peft_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _lora_truth(root):
    """peft's model on the base (adapters' B made non-zero, saved as its starting adapter directory)."""
    from peft_start import peft_start

    model = peft_start(_model("llama"), _peft_config(), root)
    ids, positions, labels = _batch(packed=True)
    loss = torch.stack([causal_lm_loss(model(ids[i:i + 1], position_ids=positions[i:i + 1], use_cache=False).logits,
                                       labels[i:i + 1]) for i in range(ROWS)]).mean()
    loss.backward()
    grads = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def _lora_run(root, tensor=1):
    """Data 2 x sequence 2 (or tensor 2 x sequence 2: lora_tensor_plan), ZeRO-1 over the adapters: one SGD
    step of lr 1 gives their gradients."""
    from pipezero.pipe.lora import adapter_state_dict, lora_specs, trainable_parameters
    from pipezero.pipe.lora_tensor import lora_tensor_plan
    from pipezero.train.checkpoint.lora_export import load_peft_adapter

    grid = Grid(sequence=2, tensor=tensor)
    plan = lora_tensor_plan(hf_tensor_plan()) if tensor > 1 else None  # the adapters split with their Linears
    model = PipelineModule(lora_specs(hf_layer_specs(f"{root}/base"), _peft_config()), grid=grid,
                           loss_fn=causal_lm_loss, tensor_plan=plan)
    load_peft_adapter(model, f"{root}/start")
    opt = ZeroOptimizer(torch.optim.SGD(trainable_parameters(model), lr=1.0), stage=1, group=grid.data_sequence_group)
    before = {n: t.clone() for n, t in adapter_state_dict(model).items()}
    m = ROWS // grid.data_size
    runner = PipelineRunner(model, OneFOneB(num_microbatches=m), optimizer=opt)
    ids, positions, labels = _batch(packed=True)
    rows = slice(grid.data_rank * m, (grid.data_rank + 1) * m)
    loss = runner.train_step(*shard_batch((ids[rows], None, positions[rows]), labels[rows], grid)).item()
    opt.step()
    return loss, {n: before[n] - t for n, t in adapter_state_dict(model).items()}, None


def _all_cases(root):
    out = []
    for case in CASES:
        out.append(_run(*case))
    return out, [_gpt_run(*case) for case in GPT_CASES], [_lora_run(root), _lora_run(root, tensor=2)]


def test_sequence_parallel_equals_one_process(tmp_path):
    lora = _lora_truth(tmp_path)
    results = run(_all_cases, 4, str(tmp_path), timeout=600)
    truths = [_truth(case[0], case[5]) for case in CASES]
    for cases, truths, index in ((CASES, truths, 0), (GPT_CASES, [_gpt_truth()] * len(GPT_CASES), 1),
                                 (["lora", "lora, tensor 2"], [lora, lora], 2)):
        for i, case in enumerate(cases):
            want_loss, want = truths[i]
            for rank, got in enumerate(results):
                loss, grads, mask_free = got[index][i]
                where = f"{case} rank {rank}"
                if index < 2:  # packed rows: per document, on whole rows after the exchange; else no call
                    assert mask_free[1], where
                assert loss == pytest.approx(want_loss, abs=1e-5), where
                assert grads, where
                for name, g in grads.items():
                    torch.testing.assert_close(g, want[name], atol=1e-5, rtol=1e-4,
                                               msg=lambda m: f"{where} {name}: {m}")
            if index < 2:  # some stage's layers (not every stage holds one) took the mask-free path
                calls = sum(got[index][i][2][0] for got in results)
                mask_free = index == 1 or (case[5] and KERNELS.get(case[0], "sdpa") == "sdpa")  # eager: the mask
                assert (calls > 0) == mask_free, f"{case}: {calls} mask-free calls"


def test_heads_the_degree_cannot_split_are_refused_naming_both():
    check_heads(4, 2, 4, "m")  # replicated key/value heads
    check_heads(8, 4, 2, "m")  # split
    with pytest.raises(ValueError, match="6 heads do not divide by 4"):
        check_heads(6, 6, 4, "m")
    with pytest.raises(ValueError, match="sequence degree 4 and 6 key/value heads"):
        check_heads(12, 6, 4, "m")
    check_heads(8, 2, 2, "m", tensor=2)  # 4 heads and 1 key/value head per tensor rank: replicated
    with pytest.raises(ValueError, match=r"2 heads \(4 / tensor degree 2 per tensor rank\) do not divide by 4"):
        check_heads(4, 4, 4, "m", tensor=2)
    with pytest.raises(ValueError, match="6 key/value heads do not both divide by 4"):
        check_heads(8, 6, 2, "m", tensor=4)


def _refusals():
    """6 heads at sequence 4 (whole heads), and at tensor 2 x sequence 2 (3 heads per tensor rank)."""
    config = _model("llama").config
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 6, 6, 4
    out = []
    for grid, plan in ((Grid(sequence=4), None), (Grid(sequence=2, tensor=2), hf_tensor_plan())):
        try:
            PipelineModule(hf_layer_specs(config), grid=grid, loss_fn=causal_lm_loss, tensor_plan=plan)
        except ValueError as err:
            out.append(str(err))
    return out


def test_refusals_come_on_every_rank_before_any_collective():
    for heads, tensor in run(_refusals, 4, timeout=300):
        assert "6 heads do not divide by 4" in heads
        assert "3 heads (6 / tensor degree 2 per tensor rank) do not divide by 2" in tensor


# -- a checkpoint across sequence degrees, and the optimizer over the data axis alone (2 ranks) --------------

def _gpt_job(grid, group):
    """The GPT on `grid`, Adam through ZeroOptimizer(stage=1) over `group`, its runner (or the runner's refusal)."""
    from pipezero.train.gpt.model import gpt_loss, gpt_specs

    torch.manual_seed(0)
    model = PipelineModule(gpt_specs(GPT_CONFIG), grid=grid, loss_fn=gpt_loss, partition_method="uniform")
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), stage=1, group=group)
    return model, opt, PipelineRunner(model, OneFOneB(num_microbatches=ROWS // grid.data_size), optimizer=opt)


def _gpt_step(grid, runner, opt):
    inputs, targets = _gpt_batch()
    m = ROWS // grid.data_size
    rows = slice(grid.data_rank * m, (grid.data_rank + 1) * m)
    loss = runner.train_step(*shard_batch(tuple(t[rows] for t in inputs), targets[rows], grid)).item()
    opt.step()
    opt.zero_grad()
    return loss


def _resume_and_guard(root):
    """Sequence 2: two steps, saved after the first; the save resumed at data 2 (sequence 1) for the second.
    Then ZeroOptimizer over the data axis alone on a sequence 2 grid, which the runner must refuse."""
    from pipezero.train import HandParts, load_state, save_state

    grid = Grid(sequence=2)
    model, opt, runner = _gpt_job(grid, grid.data_sequence_group)
    first = _gpt_step(grid, runner, opt)
    save_state(HandParts(model, opt, grid=grid), root, 1)
    second = _gpt_step(grid, runner, opt)
    other = Grid(data=2)
    model, opt, runner = _gpt_job(other, other.data_group)
    load_state(HandParts(model, opt, grid=other), root)
    resumed = _gpt_step(other, runner, opt)
    try:
        _gpt_job(grid, grid.data_group)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    return first, second, resumed, refusal


def test_a_sequence_2_checkpoint_resumes_at_data_2_and_a_data_only_optimizer_is_refused(tmp_path):
    for rank, (first, second, resumed, refusal) in enumerate(run(_resume_and_guard, 2, str(tmp_path), timeout=300)):
        assert second != pytest.approx(first, abs=1e-3)  # the step changed the model: the resume has work to do
        assert resumed == pytest.approx(second, abs=1e-5), rank
        assert refusal is not None and f"reduces gradients over ranks [{rank}]" in refusal, refusal
        assert "data x sequence group is [0, 1]" in refusal and "group=grid.data_sequence_group" in refusal


class _NoEagerModel:
    """A model whose module (this test file) defines no eager_attention_forward."""

    def __init__(self, config):
        self.config = config


def test_an_eager_model_is_served_by_its_own_eager_function_or_refused():
    from pipezero.pipe.sequence.hf_attention import check_hf_sequence

    check_hf_sequence(_model("gemma2"), 2, "m")  # modeling_gemma2's eager_attention_forward
    config = CONFIGS["llama"]()
    config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="test_sequence defines no eager_attention_forward to call"):
        check_hf_sequence(_NoEagerModel(config), 2, "m")
