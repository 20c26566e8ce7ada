"""DeepSpeed ALST: bench/long_context.py's `alst` runner at sequence degree 1, and
bench/sequence_scaling.py's at degree 2 / 4 / 8 (alst_sp_step).

Arctic Long Sequence Training (Bekman et al. 2025, arXiv 2506.13996; DeepSpeed 0.19.8's
runtime/sequence_parallel/ulysses_sp.py) as ArcticTraining's one-GPU recipe sets it
(projects/sequence-parallelism/run-h100-sp1-llama-8b.yml): sequence_parallel_size 1 (so no Ulysses:
register_with_transformers does nothing at degree 1), `tiled_mlp_compute` (every LlamaMLP through
DeepSpeed's `TiledMLP`, ceil(seq / hidden) shards, each recomputed in backward),
`activation_checkpoint_cpu_offload` (every decoder layer checkpointed, its hidden-state input held on
the host), the logits and loss through DeepSpeed's `TiledFusedLogitsLoss` (shards of ~1 GiB of fp32
logits, the trainer's rule), bf16, ZeRO-3; with `offload_optimizer` the recipe's CPU optimizer and
parameter offload (DeepSpeed's CPU Adam, JIT-built with nvcc / ninja at its first use).

The checkpointed inputs go to pinned host memory through transformers' own
`activation_checkpointing_enable(offload=True)` with reentrant checkpoints: the same tensors ALST's
patch of torch's reentrant checkpoint function moves (each layer's hidden-state input), copied on the
compute stream, as ALST's are. Attention: the model's
`flash_attention_2` when the flash_attn package is present (the recipe's), else `flex_attention`
(transformers' document mask from the packed position ids: ALST's kernels do not include one), so each
document is attended on its own, as pipezero does.

At degree > 1 (alst_sp_step) the recipe's multi-GPU form: DeepSpeed's
`UlyssesSPAttentionHF.register_with_transformers` puts its Ulysses all-to-alls around the model's kernel
and returns its mpu (sequence groups of consecutive ranks, data parallel over the rest), which
deepspeed.initialize takes; each rank trains its slice of the row (the slices
`UlyssesSPDataLoaderAdapter` would hand it: ids, position ids and the labels shifted on the whole row),
its loss the slice's sum over the row's trained tokens, which DeepSpeed's gradient averaging over the
data ranks (the sequence ranks' gradients summed) turns into the row's mean.

bench/long_context.py needs an accelerator for it: on CPU `unavailable()` says so and the bench prints it
as the row; bench/sequence_scaling.py --tiny runs it on DeepSpeed's CPU accelerator over gloo.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import sys
import types

import torch

__all__ = ["alst_loss", "alst_model", "alst_slice", "alst_sp_step", "alst_step", "attention", "unavailable"]


def unavailable(need_cuda: bool = True) -> str | None:
    """Why the ALST runner cannot run here, or None (need_cuda=False: DeepSpeed's CPU accelerator will do,
    as for bench/sequence_scaling.py --tiny, whose ALST keeps its checkpointed inputs on the device)."""
    if need_cuda and not torch.cuda.is_available():
        return "not run: DeepSpeed ALST needs a CUDA device"
    if importlib.util.find_spec("deepspeed") is None:
        return "not run: deepspeed is not installed (the README's Long sequences section: the install line)"
    return None


def attention(device: torch.device | None = None) -> str:
    """The attention ALST runs with here: the recipe's flash_attention_2 if present, else flex_attention;
    off CUDA (the CPU tests) sdpa."""
    if device is not None and device.type != "cuda":
        return "sdpa"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"


def _one_process_group() -> None:
    """deepspeed.initialize wants torch.distributed: a group of one on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False, verbose=False)


def _tiled_mlp(mlp: torch.nn.Module) -> None:
    """ALST's tiled_mlp_compute on one LlamaMLP: ceil(seq / hidden) row shards through TiledMLP."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def whole(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(whole, self, x, shards, params)
    mlp.forward = types.MethodType(forward, mlp)


def _ds_config(offload_optimizer: bool, accumulation: int = 1, bf16: bool = True) -> dict:
    zero: dict = {"stage": 3}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
              "bf16": {"enabled": bf16}, "zero_optimization": zero, "steps_per_print": 1 << 30,
              "wall_clock_breakdown": False}
    if offload_optimizer:  # the sp1 recipe: optimizer and parameters on the host, DeepSpeed's CPU Adam
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    return config


def _loss_shards(length: int, vocab: int) -> int:
    """ArcticTraining's rule: about 1 GiB of fp32 logits a shard."""
    return max(1, math.ceil(length * vocab * 4 / 2**30))


def alst_model(config, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The random-weight LlamaForCausalLM with ALST's one-GPU switches: tiled MLPs, every layer
    checkpointed, its input on the host (on a CUDA device: pinned host memory needs one)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention(device), dtype=dtype)
    model.config.use_cache = False
    for layer in model.model.layers:
        _tiled_mlp(layer.mlp)
    # reentrant, as the checkpoint function ALST patches (and ZeRO-3's well-trodden path): the saved
    # inputs are the layer's hidden states alone, which offload moves to pinned host memory
    model.activation_checkpointing_enable({"use_reentrant": True}, offload=device.type == "cuda")
    return model.train()


def alst_loss(model, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None = None,
              count: int | None = None) -> torch.Tensor:
    """The mean next-token loss with ALST's tiled logits + loss: no [seq, vocab] tensor is ever whole.

    TiledFusedLogitsLoss makes the head's gradient in its forward, shard by shard, with an incoming
    gradient of 1 ("sum"); a division of its result afterwards reaches the hidden states' gradient but
    not the head's (it came out count times too large). So each shard divides its own sum by the
    whole row's count of trained tokens, and the shards add up to the mean.
    `labels` / `count`: a sequence rank's slice of the labels shifted on the whole row and the whole
    row's trained tokens (its slice's loss is then its part of the row's mean); default: ids' own.
    """
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    count = ids.shape[1] - 1 if count is None else count

    def logits_loss(self, x, y):
        logits = self.lm_head(x).float()  # x: a shard of the flattened [batch * seq, hidden] rows
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                               reduction="sum") / count

    hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    labels = F.pad(ids[:, 1:], (0, 1), value=-100) if labels is None else labels
    shards = _loss_shards(ids.shape[1], model.config.vocab_size)
    head = [model.lm_head.weight]
    return TiledFusedLogitsLoss.apply(logits_loss, model, hidden, labels, None, shards, head, "sum")


def alst_step(config, device: torch.device, offload_optimizer: bool):
    """A training step (forward, backward, AdamW) of ALST's one-GPU recipe on a random-weight model."""
    import deepspeed

    _one_process_group()
    model = alst_model(config, device)
    client = None if offload_optimizer else torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=_ds_config(offload_optimizer),
                                      model_parameters=model.parameters())

    def step(ids, positions):
        engine.backward(alst_loss(engine.module, ids, positions))
        engine.step()
    return step


def alst_sp_step(config, device: torch.device, degree: int, accumulation: int, offload_optimizer: bool):
    """A training step of ALST's multi-GPU recipe: Ulysses over `degree` consecutive ranks of the running
    process group (data parallel over the rest), ZeRO-3, `accumulation` rows per data rank a step.

    Returns step(rows) for rows = [(ids, positions)] of whole rows [1, T], this data rank's."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    backend = "nccl" if device.type == "cuda" else "gloo"  # the running group's (gloo: the CPU test)
    if backend == "gloo":  # no shared-memory kernel to compile (~2 min), as the tests skip it
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # fp32 on CPU, as pipezero's cases
    model = alst_model(config, device, dtype)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, attention(device), degree, micro_batch_size=1)
    client = None if offload_optimizer else torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, mpu=mpu, model_parameters=model.parameters(),
                                      config=_ds_config(offload_optimizer, accumulation, dtype == torch.bfloat16))
    rank = dist.get_rank(mpu.get_sequence_parallel_group())

    def step(rows):
        for ids, positions in rows:  # DeepSpeed steps the optimizer at the last row's engine.step()
            mine, count = alst_slice(ids, positions, rank, degree)
            engine.backward(alst_loss(engine.module, *mine, count=count))
            engine.step()
    return step


def alst_slice(ids: torch.Tensor, positions: torch.Tensor, rank: int, degree: int) -> tuple[list, int]:
    """Sequence rank `rank`'s slice of a whole row [1, T] as UlyssesSPDataLoaderAdapter cuts it: [ids,
    positions, the labels shifted on the whole row], and the whole row's count of trained tokens."""
    labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    part = ids.shape[1] // degree
    return [t[:, rank * part:(rank + 1) * part] for t in (ids, positions, labels)], ids.shape[1] - 1
