"""The top level of a ds_config: which DeepSpeed 0.19.8 keys pipezero reads, ignores or refuses.

DeepSpeed reads its top level key by key and ignores names it does not know, so here too a
name of no DeepSpeed version only warns (a near miss of a real key is a typo error). Keys that
change nothing for pipezero are silent at their no-op value (DeepSpeed's default, or a section
that is not enabled) and warn once otherwise; DeepSpeed features pipezero lacks are refused
with what they do and the fix. The sections owned by precision/ and zero/ carry their own rules.
"""

from __future__ import annotations

from typing import Any, Mapping

from pipezero.config_fields import Ignored, Unsupported, as_bool

__all__ = ["TOP_KEYS", "TOP_RULES"]

TOP_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "fp16", "bf16", "bfloat16",
            "zero_optimization", "optimizer", "scheduler", "tensorboard", "pipeline", "compile",  # compile: compile.py
            "wandb",  # monitor.py
            "data_types", "communication_data_type",  # data_types.py
            "sequence_parallel_size",  # the grid's sequence axis (pipe/sequence/)
            "expert_parallel",  # the grid's expert axis (pipe/expert/): expert.py
            "activation_checkpointing")  # recompute.py


def _off(value: Any) -> bool:
    """A section that asks for nothing: empty, null, false or {"enabled": false}."""
    if value is None or value == {} or as_bool(value) is False:
        return True
    return isinstance(value, Mapping) and as_bool(value.get("enabled", False)) is False


def _anything(value: Any) -> bool:
    return True


_KNOB = "a DeepSpeed setting with no counterpart here"
_REMOVED = "removed from DeepSpeed too; 0.19.8 refuses it as well"
TOP_RULES = {
    "memory_breakdown": Ignored("peak memory is logged to TensorBoard", noop=False),
    "dump_state": Ignored("print the TrainConfig instead", noop=False),
    "flops_profiler": Ignored("MFU is logged from examples/gpt.py's FLOPs count", noop=_off),
    "comms_logger": Ignored("bytes moved per collective are always counted (pipezero.comm.TRAFFIC)", noop=_off),
    **{k: Ignored("TensorBoard and W&B are written", noop=_off) for k in ("csv_monitor", "comet")},
    "zero_allow_untested_optimizer": Ignored("any torch optimizer may be wrapped", noop=_anything),
    "zero_force_ds_cpu_optimizer": Ignored("CPU offload steps torch's own optimizer", noop=_anything),
    "prescale_gradients": Ignored("gradients are averaged by the reduction itself", noop=False),
    "gradient_predivide_factor": Ignored("gradients are averaged by the reduction itself", noop=1.0),
    "seq_parallel_communication_data_type": Ignored(_KNOB, noop=_anything),
    "gradient_allreduce_op": Unsupported("summing data-parallel gradients instead of averaging them",
                                         'set it to "mean"', noop="mean"),
    "disable_allgather": Ignored("updated partitions are always all-gathered", noop=False),
    "disable_python_gc": Ignored(_KNOB, noop=False),
    "managed_gradient_accumulation": Ignored(_KNOB, noop=True),
    "dataloader_drop_last": Ignored("pipezero builds no data loader; keep your own", noop=False),
    "aio": Ignored("only for NVMe offload, which pipezero does not offer", noop=_anything),
    "checkpoint": Ignored("pipezero's checkpoints have their own manifest", noop=_off),
    "datastates_ckpt": Ignored("pipezero's checkpoints are written by train/checkpoint/files.py", noop=_off),
    "model_info": Ignored("only DeepSpeed's autotuner reads it", noop=_anything),
    "log_level": Ignored(_KNOB, noop=_anything),
    "timers": Ignored(_KNOB, noop=_anything),
    "vocabulary_size": Ignored(_KNOB, noop=_anything),
    "use_data_before_expert_parallelism": Ignored(_KNOB, noop=False),
    "torch_autocast": Unsupported("torch.autocast around the forward pass", "use the fp16 or bf16 section",
                                  noop=_off),
    "tensor_parallel": Unsupported("AutoTP tensor parallelism", "shard layers with build(tensor=..., tensor_plan=...)",
                                   noop=lambda v: _off(v) or v.get("autotp_size", 1) in (0, 1)),
    "hybrid_engine": Unsupported("the RLHF hybrid engine", "remove the section", noop=_off),
    "autotuning": Unsupported("the autotuner's search over batch and ZeRO settings", "remove the section",
                              noop=_off),
    "data_efficiency": Unsupported("data sampling and routing curricula", "remove the section", noop=_off),
    "weight_quantization": Unsupported("quantized weights", "remove the section"),
    **{k: Unsupported(f"{what}, {_REMOVED}", fix) for k, what, fix in (
        ("amp", "NVIDIA Apex AMP", "use the fp16 or bf16 section"),
        ("nebula", "Nebula checkpointing", "remove the section"),
        ("compression_training", "the compression library", "remove the section"),
        ("quantize_training", "Mixture-of-Quantization", "remove the section"),
        ("sparse_gradients", "sparse embedding gradients", "remove the key"),
        ("eigenvalue", "eigenvalue-based quantization", "remove the section"),
        ("sparse_attention", "sparse attention kernels", "remove the section"),
        ("elasticity", "elastic batch sizes", "set the batch keys directly"),
        ("graph_harvesting", "CUDA graph harvesting", "remove the key"),
        ("curriculum_learning", "curriculum learning", "remove the section"),
        ("progressive_layer_drop", "progressive layer dropping", "remove the section"))},
}
