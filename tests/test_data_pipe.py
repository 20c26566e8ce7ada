"""Real data through the pipeline against one process that runs every document on its own.

Packed rows (documents end to end, SFT masks on some) through pipe 2 x data 2 under 1F1B
(ZeRO-1), interleaved 1F1B (ZeRO-2) and ZB-V (ZeRO-3), and pipe 2 x tensor 2: the loss per trained token, and
the parameters after SGD steps (SGD: the update is the gradient, so the parameters compare
the gradients too) equal examples/gpt.py's GPT run on each document alone (positions from 0,
no other document in view). Unpacked rows of different lengths, padded per micro-batch (one
shape per micro-batch through the pipeline), equal the same truth under four schedules and
ZeRO 0-3. Killing the job after
step 2 and resuming from the data position on another data degree gives the uninterrupted
losses exactly.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from harness import run
from pipezero.pipe import PipelineModule, PipelineRunner, make_schedule
from pipezero.pipe.tensor_parallel import whole_tensor
from pipezero.topology import Grid
from pipezero.train.data import IGNORE, MemoryCorpus, PackedBatches, pack, token_mean_loss
from pipezero.train.checkpoint.state import single_process_names
from pipezero.zero import ZeroConfig, ZeroOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, gpt_specs, gpt_tensor_plan  # noqa: E402

CFG = GPTConfig(vocab_size=40, n_layer=4, n_head=2, d_model=16, seq_len=16, seed=2)
SEQ, PER_RANK, STEPS, LR = 16, 4, 3, 0.5


def _corpus() -> MemoryCorpus:
    gen = np.random.default_rng(0)
    docs = []
    for i in range(40):
        n = int(gen.integers(3, 15))
        ids = gen.integers(0, CFG.vocab_size, n)
        mask = None if i % 3 else (np.arange(n) >= n // 2).astype(np.uint8)  # SFT: loss on the second half
        docs.append((ids, mask))
    return MemoryCorpus(docs)


def _batches(packing: bool, m: int, data_rank: int, degree: int) -> PackedBatches:
    corpus = _corpus()
    layout = pack(corpus, SEQ, packing=packing)
    return PackedBatches(layout, corpus, PER_RANK * 2 // degree, m, data_rank, degree, seed=5)


def _each_document_alone(model: torch.nn.Module, logits_of, packing: bool) -> list[float]:
    """SGD steps of `model` in one process, every document (segment) alone: sum of CE over trained
    tokens / their count. `logits_of(model, ids)` gives a [1, T, vocab] tensor."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    order = _batches(packing, 1, 0, 1)
    layout, corpus, losses = order.layout, order.corpus, []
    for _ in range(STEPS):
        total, count = 0.0, 0
        for r in order.order.next_rows():
            for s in range(layout.row_start[r], layout.row_start[r + 1]):
                ids, mask = corpus.doc(int(layout.seg_doc[s]))
                a, n = int(layout.seg_from[s]), int(layout.seg_len[s])
                ids, mask = torch.as_tensor(ids[a:a + n]), torch.as_tensor(mask[a:a + n])
                labels = torch.where(mask[1:] > 0, ids[1:], IGNORE)
                logits = logits_of(model, ids[None, :-1])[0]
                total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
                count += int((labels != IGNORE).sum())
        loss = total / count
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@functools.cache
def _truth(packing: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The project's GPT on every document alone."""
    model = GPT(CFG)
    losses = _each_document_alone(model, lambda m, ids: m(ids), packing)
    return losses, {n: t.clone() for n, t in model.state_dict().items()}


def _train(schedule: str, stage: int, packing: bool, m: int, steps: range, state: dict | None = None,
           params: list | None = None, tensor: int = 1):
    grid = Grid(pipe=2, tensor=tensor)
    sched = make_schedule(schedule, m)
    model = PipelineModule(gpt_specs(CFG), grid=grid, loss_fn=token_mean_loss, num_chunks=sched.num_chunks,
                           placement=sched.placement, tensor_plan=gpt_tensor_plan() if tensor > 1 else None)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=LR), group=grid.data_group,
                        module=model if stage == 3 else None,
                        config=ZeroConfig(stage=stage, stage3_param_persistence_threshold=0))
    runner = PipelineRunner(model, sched, optimizer=opt, variable_shapes=not packing)
    if params is not None:  # the weights of the run that was killed, by pipe stage
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[grid.pipe_rank][name])
    data = _batches(packing, m, grid.data_rank, grid.data_size)
    if state is not None:
        data.load_state_dict(state)
    losses = []
    for _ in steps:
        inputs, targets = data.next_batch()
        losses.append(runner.train_step(inputs, targets).item())
        opt.step()
        opt.zero_grad()
    with opt.gathered_parameters() if stage == 3 else _nothing():
        params = {n: whole_tensor(p).detach().clone() for n, p in model.named_parameters()}
    return losses, params, data.state_dict(), data.efficiency()


def _by_stage(mine: dict) -> list:
    """Every rank's parameters, indexed by pipe stage (an all-gather: data rank 0 of each stage)."""
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [everyone[r] for r in (0, dist.get_world_size() // 2)]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _check(results, packing: bool, tol: float = 1e-5) -> None:
    losses, params = _truth(packing)
    mapping = single_process_names(gpt_specs(CFG))
    seen = set()
    for rank_losses, rank_params, _, _ in results:
        torch.testing.assert_close(rank_losses, losses, rtol=tol, atol=tol)
        for name, value in rank_params.items():
            for single in mapping(name):
                torch.testing.assert_close(value, params[single], rtol=tol, atol=tol, msg=name)
                seen.add(single)
    assert seen == set(params), set(params) - seen


def _schedules(packing: bool):
    """Every schedule of the test in one world: 1F1B / ZeRO-1, interleaved / ZeRO-2, ZB-V / ZeRO-3, and
    1F1B over pipe 2 x tensor 2 (the segment ids beside each Block's sharded heads)."""
    return [_train(name, stage, packing, 4, range(STEPS), tensor=tensor)
            for name, stage, tensor in (("1f1b", 1, 1), ("interleaved_1f1b", 2, 1), ("zbv", 3, 1), ("1f1b", 1, 2))]


def _hf_model():
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=CFG.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _hf_truth() -> list[float]:
    """transformers' own model on every document alone."""
    return _each_document_alone(_hf_model(), lambda m, ids: m(input_ids=ids).logits, True)


def _hf_packed(path: str) -> list[float]:
    """The same packed rows through pipe/hf/layers.py's layers (transformers builds the block-diagonal
    mask from position ids that restart), pipe 2 x data 2, 1F1B, ZeRO-1."""
    from pipezero.pipe.hf import hf_layer_specs
    grid = Grid(pipe=2)
    sched = make_schedule("1f1b", 4)
    model = PipelineModule(hf_layer_specs(path), grid=grid, loss_fn=token_mean_loss)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=LR), group=grid.data_group, stage=1)
    runner = PipelineRunner(model, sched, optimizer=opt)
    corpus = _corpus()
    data = PackedBatches(pack(corpus, SEQ), corpus, PER_RANK * 2 // grid.data_size, 4, grid.data_rank,
                         grid.data_size, seed=5, hf_inputs=True)
    losses = []
    for _ in range(STEPS):
        losses.append(runner.train_step(*data.next_batch()).item())
        opt.step()
        opt.zero_grad()
    return losses


def test_packed_rows_through_pipe2_data2_equal_each_document_alone(tmp_path):
    per_schedule = list(zip(*run(_schedules, 4, True, timeout=300)))
    for results in per_schedule:
        _check(results, packing=True)
    assert 0.5 < per_schedule[0][0][3] < 1.0  # packing efficiency reported
    _hf_model().save_pretrained(tmp_path / "llama")
    truth = _hf_truth()
    for losses in run(_hf_packed, 4, str(tmp_path / "llama"), timeout=300):
        torch.testing.assert_close(losses, truth, rtol=1e-5, atol=1e-5)


def _variable_and_resume():
    varying = [_train(name, stage, False, 2, range(STEPS), tensor=tensor) for name, stage, tensor in
               (("1f1b", 0, 1), ("interleaved_1f1b", 1, 1), ("zb_h1", 2, 1), ("zbv", 3, 1), ("1f1b", 1, 2))]
    whole = _train("1f1b", 1, True, 4, range(STEPS))
    first = _train("1f1b", 1, True, 4, range(2))       # killed after step 2, then resumed
    again = _train("1f1b", 1, True, 4, range(2, STEPS), state=first[2], params=_by_stage(first[1]))
    return varying, whole, first, again


def _resume_on_one_replica(state: dict, params: list):
    return _train("1f1b", 1, True, 4, range(2, STEPS), state=state, params=params)


def test_variable_lengths_and_resume_on_another_data_degree():
    """Unpacked rows padded per micro-batch (shapes change every micro-batch) under 1F1B / ZeRO-0,
    interleaved / ZeRO-1, ZB-H1 / ZeRO-2, ZB-V / ZeRO-3 and 1F1B over pipe 2 x tensor 2; kill after step 2 and resume from the saved position on pipe 2 x data 2 (bitwise
    the uninterrupted losses) and on pipe 2 x data 1 (the same rows: the truth's losses)."""
    results = run(_variable_and_resume, 4, timeout=300)
    for results_of in zip(*[r[0] for r in results]):
        _check(results_of, packing=False)
    for _, whole, first, again in results:
        assert whole[0] == first[0] + again[0], (whole[0], first[0], again[0])
        assert first[2] == {"epoch": 0, "step": 2, "seed": 5, "global_batch": 8, "rows": first[2]["rows"]}
    state, by_stage = results[0][2][2], [results[0][2][1], results[2][2][1]]  # ranks 0, 2: pipe stages 0, 1
    resumed = run(_resume_on_one_replica, 2, state, by_stage, timeout=300)
    losses, _ = _truth(True)
    for rank in resumed:
        torch.testing.assert_close(rank[0], losses[2:], rtol=1e-5, atol=1e-5)
        assert rank[2]["step"] == STEPS
