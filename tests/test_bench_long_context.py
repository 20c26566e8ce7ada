"""bench/long_context.py: its ALST runner trains the same model as transformers, and its host-memory guard.

The ALST runner needs a GPU to run whole (DeepSpeed's engine); what CI can check is that its model
(DeepSpeed's TiledMLP in every layer, every layer checkpointed) and its loss (DeepSpeed's
TiledFusedLogitsLoss) give transformers' own loss and gradients on the same packed row, so the bench
compares like with like, also at sequence degree 2 (bench/sequence_scaling.py's ALST rows: DeepSpeed's
Ulysses on 2 gloo ranks); and that the 8B runs are refused, with the numbers, where the host could not
hold them.
"""

from __future__ import annotations

import sys

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
    need, _ = lc.host_need("pipezero-offload", full, 524288, True)  # 32 layers', the final norm's, the head's
    assert need == pytest.approx(6 + 8.03e9 * 16 / 2**30 + 34 * 524288 * 4096 * 2 / 2**30, rel=1e-3)
    cut = lc._config("llama3-8b", 524288, layers=8)
    assert lc.host_refusal("pipezero-offload", cut, 524288, True, available=120.0) is None
    assert lc.host_refusal("torch", full, 524288, False, available=120.0) is None  # nothing on the host
    assert "fp32 training state 8.03B" in lc.host_refusal("torch", full, 4096, False, 120.0, cuda=False)
    # the whole 8B at 512K with its optimizer on the GPU: the pipeline's first 26 layers are the embedding
    # (token ids) and 25 decoder layers, whose inputs fit 120 GiB
    need, parts = lc.host_need("pipezero-offload", full, 524288, False, offload_layers=26)
    assert need == pytest.approx(6 + 25 * 524288 * 4096 * 2 / 2**30) and "25 x 524,288" in parts, parts
    assert lc.host_refusal("pipezero-offload", full, 524288, False, available=120.0, offload_layers=26) is None


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


def _alst_sequence_2(state, ids):
    """On 2 gloo ranks: DeepSpeed's Ulysses registered around the ALST model's SDPA, each rank its
    alst_slice of the row; (the loss, every gradient) summed over the ranks."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from bench import long_context_alst as alst

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo: no shm kernel to compile (~2 min)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    model = alst.alst_model(lc._config("tiny", ids.shape[1]), torch.device("cpu"), torch.float32)
    model.load_state_dict(state)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, micro_batch_size=1)
    positions = torch.arange(ids.shape[1])[None]
    mine, count = alst.alst_slice(ids, positions, dist.get_rank(mpu.get_sequence_parallel_group()), 2)
    loss = alst.alst_loss(model, *mine, count=count)
    loss.backward()
    sums = [loss.detach()] + [p.grad for p in model.parameters()]
    for t in sums:
        dist.all_reduce(t)
    return sums[0], {n: g for (n, _), g in zip(model.named_parameters(), sums[1:])}


def test_alst_at_sequence_2_equals_transformers():
    """bench/sequence_scaling.py's ALST rows (alst_sp_step): DeepSpeed's own Ulysses (register_with_transformers)
    around the model, each rank the slice alst_slice cuts, its loss alst_loss over the row's count: the ranks'
    losses and gradients add up to transformers' on the whole row (one document: DeepSpeed's SDPA path drops
    the mask for plain causal attention; on a GPU flash / flex attend the packed documents)."""
    from harness import run
    from transformers import AutoModelForCausalLM

    config = lc._config("tiny", 256)
    ids = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    truth = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
    want = F.cross_entropy(truth(input_ids=ids, use_cache=False).logits[0, :-1], ids[0, 1:])
    want.backward()
    state = {k: v.clone() for k, v in truth.state_dict().items()}
    # discard: DeepSpeed's Ulysses replaced transformers' "sdpa" function and set its groups in these workers
    (loss, grads), _ = run(_alst_sequence_2, 2, state, ids, timeout=240, discard=True)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for name, p in truth.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_measure_times_a_selective_run_and_profiles_one_more_step(tmp_path, monkeypatch):
    """A worker's measure() as `bash bench/gpu.sh long-kit` runs it (--profile), tiny and on CPU: the numbers,
    and the profiled step's table."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(lc.__file__).parent))  # the worker imports bench/profiling.py by name
    done = lc.measure("pipezero-selective", "tiny", 512, 1, profile=str(tmp_path))
    assert done["tokens_per_s"] > 0 and done["peak_gb"] > 0, done
    assert (tmp_path / "pipezero-selective-512.txt").read_text().startswith("pipezero-selective-512: wall")
