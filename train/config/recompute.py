"""ds_config["activation_checkpointing"] with DeepSpeed 0.19.8's meaning, and the pipeline's checkpointing.

In DeepSpeed the section configures the `deepspeed.checkpointing.checkpoint` calls that model code
makes; here the layers are checkpointed by pipezero (pipe/memory/recompute.py), so the section
applies to them. Its keys, as DeepSpeed reads them (`DeepSpeedActivationCheckpointingConfig`):

* `cpu_checkpointing`: the checkpointed inputs wait in (pinned) host memory -> `offload`; asking for
  it turns checkpointing on (full, every layer) unless the pipeline section says otherwise, since a
  DeepSpeed user who writes it has checkpoint calls in the model.
* `partition_activations`: the checkpointed inputs split over the model-parallel group. At tensor
  degree 1 there is nothing to split: accepted as it is in DeepSpeed with one rank (a no-op, and it
  turns checkpointing on like cpu_checkpointing). Above 1 it is refused: the split is not built yet.
* `contiguous_memory_optimization`, `number_checkpoints` (the size of those contiguous buffers),
  `synchronize_checkpoint_boundary` (a device synchronize around each checkpoint, for debugging),
  `profile` (timers around each): nothing to act on; warned when set, silent at their defaults.

The mode lives in pipezero's own pipeline section: `"activation_checkpointing": "none" | "full" |
"selective"` beside DeepSpeed's `activation_checkpoint_interval` (layers per checkpointed run), and
`"offload_activation_layers": N` (with cpu_checkpointing: only a forward's first N layers offload their
inputs, the rest keep them on the device) and `"activation_checkpoint_layers": N` (only a forward's
first N layers are checkpointed, the rest keep every activation).
"""

from __future__ import annotations

import argparse
from typing import Any

from pipezero.config_fields import ConfigError, Ignored, Section
from pipezero.pipe.memory.recompute import MODES, RecomputeConfig

__all__ = ["SECTION_KEYS", "apply_recompute_flags", "read_recompute"]

SECTION_KEYS = ("partition_activations", "cpu_checkpointing")
_RULES = {
    "contiguous_memory_optimization": Ignored(
        "checkpointed inputs are separate tensors that torch's caching allocator reuses (DeepSpeed copies "
        "them into one buffer, only with partition_activations over several ranks)", noop=False),
    "number_checkpoints": Ignored("it sizes DeepSpeed's contiguous buffers; pipezero checkpoints every "
                                  'pipeline.activation_checkpoint_interval layers', noop=lambda v: True),
    "synchronize_checkpoint_boundary": Ignored("a debugging device synchronize around each checkpoint; the "
                                               "pipeline runs its own timeline (pipe/schedule/timeline.py)",
                                               noop=False),
    "profile": Ignored("the runner's timeline times every forward and backward, recompute included "
                       "(pipe/schedule/timeline.py)", noop=False),
}


def read_recompute(raw: Any, pipeline: Section, tensor: int = 1) -> RecomputeConfig:
    """ds_config["activation_checkpointing"] (raw) and the pipeline section's keys -> a RecomputeConfig."""
    sec = Section(raw, ("activation_checkpointing",))
    sec.check(SECTION_KEYS, _RULES)
    offload = sec.bool("cpu_checkpointing", False)
    partition = sec.bool("partition_activations", False)
    if partition and tensor > 1:
        raise ConfigError(f'{sec.where("partition_activations")} = true with tensor degree {tensor}: splitting '
                          "the checkpointed inputs over the tensor group is not built yet; set it to false "
                          "(each tensor rank keeps the whole input) or use cpu_checkpointing")
    interval = pipeline.int("activation_checkpoint_interval", 0, lo=0)
    where = pipeline.where("activation_checkpointing")
    counted = pipeline.int("activation_checkpoint_layers", None, lo=1)
    mode = pipeline.raw("activation_checkpointing")
    if mode is None:
        mode = "full" if interval or offload or partition or counted else "none"
    elif not isinstance(mode, str) or mode.lower() not in MODES:
        raise ConfigError(f"{where} = {mode!r}: expected one of {', '.join(repr(m) for m in MODES)}")
    mode = mode.lower()
    if mode == "none" and (interval or offload or counted):
        asked = (f'{pipeline.where("activation_checkpoint_interval")} = {interval}' if interval
                 else f'{pipeline.where("activation_checkpoint_layers")} = {counted}' if counted
                 else f'{sec.where("cpu_checkpointing")} = true')
        raise ConfigError(f'{where} = "none" but {asked} asks for checkpointed layers: remove one, or set '
                          f'{where} to "full" or "selective"')
    layers = _offload_layers(pipeline, sec, offload)
    if mode == "none":
        return RecomputeConfig()
    if layers is not None and counted is not None and layers > counted:
        raise ConfigError(f'{pipeline.where("offload_activation_layers")} = {layers} exceeds '
                          f'{pipeline.where("activation_checkpoint_layers")} = {counted}: only checkpointed layers '
                          f"keep inputs to offload; set it to {counted} or less")
    return RecomputeConfig(mode=mode, interval=interval or 1, offload=offload, offload_layers=layers,
                           checkpoint_layers=counted)


def _offload_layers(pipeline: Section, sec: Section, offload: bool) -> int | None:
    layers = pipeline.int("offload_activation_layers", None, lo=1)
    if layers is not None and not offload:
        raise ConfigError(f'{pipeline.where("offload_activation_layers")} = {layers} without '
                          f'{sec.where("cpu_checkpointing")} = true: it says how many layers offload their '
                          "inputs; set cpu_checkpointing too (--offload-activations), or remove it")
    return layers


def apply_recompute_flags(raw: dict, args: argparse.Namespace) -> dict:
    """The ds_config `raw` with the four flags written into its keys (edited in place, and returned)."""
    if args.activation_checkpointing is not None:
        raw["pipeline"] = {**raw.get("pipeline", {}), "activation_checkpointing": args.activation_checkpointing}
    if args.offload_activations or args.offload_activation_layers is not None:
        raw["activation_checkpointing"] = {**(raw.get("activation_checkpointing") or {}), "cpu_checkpointing": True}
    if args.offload_activation_layers is not None:
        raw["pipeline"] = {**raw.get("pipeline", {}), "offload_activation_layers": args.offload_activation_layers}
    if args.activation_checkpoint_layers is not None:
        raw["pipeline"] = {**raw.get("pipeline", {}), "activation_checkpoint_layers": args.activation_checkpoint_layers}
    return raw
