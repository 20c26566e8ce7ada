"""LoRA's model state per rank: the frozen base once, in its own dtype, plus 16 bytes per trainable parameter.

Byte model (Hu et al. 2021's point: the optimizer holds only the adapters): a bf16 base
(2 bytes a parameter, no gradient, no master, no optimizer state) and fp32 adapters (the
parameter is its own master, 4; its gradient, 4; Adam's m and v, 8). Counted as
tests/test_zero_memory.py counts: the unique storages alive after a pipeline step whose
gradients are kept, with optimizer state from a previous step, less what lived before the
model was built; on pipe 2 x data 1, so each rank holds its own stages' base.
"""

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harness import run  # noqa: E402
from pipezero.pipe import OneFOneB, PipelineModule, PipelineRunner  # noqa: E402
from pipezero.pipe.hf import causal_lm_loss, hf_layer_specs  # noqa: E402
from pipezero.pipe.lora import LoraConfig, lora_specs, trainable_parameters  # noqa: E402
from pipezero.topology import Grid  # noqa: E402
from pipezero.zero import ZeroOptimizer  # noqa: E402
from pipezero.zero.config import ZeroConfig  # noqa: E402

_LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)


def _storages() -> dict[int, int]:
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            for t in (obj, obj.grad):
                if t is not None and t.numel():
                    s = t.untyped_storage()
                    found[s.data_ptr()] = s.nbytes()
    return found


def _measure(stage: int) -> tuple[int, int, int, int]:
    grid = Grid(pipe=2)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], base_dtype=torch.bfloat16)
    specs = lora_specs(hf_layer_specs(transformers.LlamaConfig(**_LLAMA)), config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 16), generator=gen)
    before = _storages()
    model = PipelineModule(specs, grid=grid, loss_fn=causal_lm_loss, partition_method="uniform")
    opt = ZeroOptimizer(torch.optim.AdamW(trainable_parameters(model), lr=1e-3), group=grid.data_group,
                        config=ZeroConfig(stage=stage))
    runner = PipelineRunner(model, OneFOneB(num_microbatches=2), optimizer=opt)
    for step in range(2):                      # the first step creates the optimizer state
        opt.zero_grad()
        runner.train_step(ids, ids)
        opt.wait_grad_sync()
        if step == 0:
            opt.step()
    del runner
    live = sum(n for ptr, n in _storages().items() if ptr not in before)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    base = sum(p.numel() * p.element_size() for p in frozen)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() for p in trainable_parameters(model))
    assert {p.dtype for p in frozen} == {torch.bfloat16} and all(p.grad is None for p in frozen)
    state = [s for p in frozen for s in opt.inner.state.get(p, {}).values()]
    assert not state
    return live, base + buffers, trainable, sum(p.numel() for p in frozen)


def test_model_state_is_base_plus_16_bytes_per_trainable():
    results = run(_measure, 2, 1)
    total_base = sum(r[3] for r in results)
    for rank, (live, base, trainable, base_numel) in enumerate(results):
        want = base + 16 * trainable
        assert abs(live - want) <= 0.05 * want, (rank, live, want, base, trainable)
        assert base_numel < 0.75 * total_base        # each rank holds its own stages' base only
