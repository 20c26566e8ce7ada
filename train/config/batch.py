"""Batch arithmetic: train_batch_size = micro batch x accumulation steps x data degree.

Any two of the three ds_config keys imply the third; all three given must agree. DeepSpeed's
rule is kept: with only one of train_batch_size / train_micro_batch_size_per_gpu given,
gradient_accumulation_steps is 1. "auto" (the Hugging Face Trainer's placeholder) left after
`auto_values` counts as not given. The pipeline's micro-batches per step are the accumulation steps.
A run resumed on another data degree keeps its checkpoint's global batch (`keep_global_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pipezero.config_fields import AUTO, ConfigError, Section

__all__ = ["BatchConfig", "data_degree", "keep_global_batch", "resolve_batch"]

_TBS, _MBS, _GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(kw_only=True, slots=True, frozen=True)
class BatchConfig:
    """Resolved batch sizes; train_batch_size = micro_batch_size x accumulation_steps x data_degree."""

    train_batch_size: int       # samples per optimizer step over the whole job
    micro_batch_size: int       # samples per forward on one data rank
    accumulation_steps: int     # micro-batches per optimizer step (pipeline micro_batches)
    data_degree: int            # data-parallel replicas

    @property
    def per_rank_batch_size(self) -> int:
        """Samples one data rank consumes per optimizer step."""
        return self.micro_batch_size * self.accumulation_steps


def data_degree(world_size: int, pipe: int, tensor: int = 1, sequence: int = 1) -> int:
    """world_size // (pipe * tensor * sequence), or a ConfigError naming the numbers. The sequence ranks
    of one data replica share its batch (each takes a slice of every row), as in DeepSpeed."""
    for name, value in (("world_size", world_size), ("pipe", pipe), ("tensor", tensor), ("sequence", sequence)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    others = pipe * tensor * sequence
    if world_size % others:
        seq = f' x sequence_parallel_size {sequence}' if sequence > 1 else ""
        raise ConfigError(f'ds_config["pipeline"]["stages"] = {pipe} x tensor {tensor}{seq} does not divide '
                          f"the world size {world_size}: start a multiple of {others} processes "
                          f"or change the stages")
    return world_size // others


def resolve_batch(ds_config: Mapping[str, Any], *, world_size: int, pipe: int = 1, tensor: int = 1,
                  micro_batches: int | None = None, sequence: int = 1) -> BatchConfig:
    """Read the three batch keys of a ds_config and complete them."""
    dp = data_degree(world_size, pipe, tensor, sequence)
    top = Section(ds_config, ())
    tbs, mbs, gas = (top.int(key, None, lo=1) for key in (_TBS, _MBS, _GAS))
    autos = [key for key in (_TBS, _MBS, _GAS) if ds_config.get(key) == AUTO]
    if micro_batches is not None:
        if gas is not None and gas != micro_batches:
            raise ConfigError(f'ds_config["pipeline"]["micro_batches"] = {micro_batches} disagrees with '
                              f'ds_config["{_GAS}"] = {gas}: they are the same number; keep one')
        gas = micro_batches
    tbs, mbs, gas = _complete(tbs, mbs, gas, dp, autos)
    if tbs != mbs * gas * dp:
        raise ConfigError(f'ds_config["{_TBS}"] = {tbs} != {_MBS} {mbs} x {_GAS} {gas} x data degree '
                          f"{dp} = {mbs * gas * dp}: change one of them so the product holds")
    return BatchConfig(train_batch_size=tbs, micro_batch_size=mbs, accumulation_steps=gas, data_degree=dp)


def _complete(tbs: int | None, mbs: int | None, gas: int | None, dp: int,
              autos: list[str]) -> tuple[int, int, int]:
    """Fill the missing value(s); a division that does not come out even is an error with the numbers."""
    if tbs is None and mbs is None and autos:
        raise ConfigError(f'ds_config sets {" and ".join(autos)} to "auto" and nothing resolves them: pass '
                          f'auto_values={{"{_MBS}": N, "{_GAS}": M}} to parse_config, build or initialize '
                          f"(the per-device batch size and accumulation steps your script uses), or write them")
    if tbs is None and mbs is None:
        raise ConfigError(f'ds_config sets neither "{_TBS}" nor "{_MBS}": set at least one of them '
                          f"(with {_GAS}, any two imply the third)")
    if tbs is not None and mbs is not None and gas is None:
        if tbs % (mbs * dp):
            raise ConfigError(f'ds_config["{_TBS}"] = {tbs} is not divisible by {_MBS} {mbs} x data '
                              f"degree {dp} = {mbs * dp}: make it a multiple of {mbs * dp}")
        return tbs, mbs, tbs // (mbs * dp)
    gas = 1 if gas is None else gas
    if mbs is None:
        if tbs % (gas * dp):
            raise ConfigError(f'ds_config["{_TBS}"] = {tbs} is not divisible by {_GAS} {gas} x data '
                              f"degree {dp} = {gas * dp}: make it a multiple of {gas * dp} or set {_MBS}")
        return tbs, tbs // (gas * dp), gas
    return (mbs * gas * dp if tbs is None else tbs), mbs, gas


def keep_global_batch(batch: BatchConfig, saved: BatchConfig | None) -> BatchConfig:
    """This launch's batch, with the checkpoint's global batch when the data degree changed.

    An elastic restart onto fewer nodes runs the same command on a smaller world: the data
    degree shrinks, and with the same micro-batch size and accumulation steps so would the
    global batch, and with it what one optimizer step, the lr schedule and the data position
    (global batches taken) mean. So the checkpoint's train_batch_size is kept and the
    accumulation steps absorb the change: accumulation = train_batch_size / (micro batch x
    data degree), more steps on fewer replicas. With an unchanged data degree (or no
    checkpoint) the launch's own batch is returned as it is.
    """
    if saved is None or batch.data_degree == saved.data_degree:
        return batch
    per_step = batch.micro_batch_size * batch.data_degree
    if saved.train_batch_size % per_step:
        raise ConfigError(
            f"resuming a checkpoint trained with {_TBS} {saved.train_batch_size} (micro batch "
            f"{saved.micro_batch_size} x {saved.accumulation_steps} accumulation steps x data degree "
            f"{saved.data_degree}) on data degree {batch.data_degree}: {saved.train_batch_size} is not "
            f"divisible by micro batch {batch.micro_batch_size} x data degree {batch.data_degree} = "
            f"{per_step}, so no whole number of accumulation steps keeps the global batch; launch a "
            f"data degree whose product with {_MBS} divides {saved.train_batch_size}")
    return BatchConfig(train_batch_size=saved.train_batch_size, micro_batch_size=batch.micro_batch_size,
                       accumulation_steps=saved.train_batch_size // per_step, data_degree=batch.data_degree)
