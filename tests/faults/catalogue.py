"""The fault campaign's catalogue of bad inputs: each one, and the words its error must contain.

A case is a function that feeds one bad input to one part (grid, schedule, module, optimizer
chain, loss-scaler state, data, config, command line) and lets it raise. Pure cases run in the
test process (a pure check raises the same on every rank by construction); `RANKED` cases run
on every rank of a gloo world through tests/harness.py and must raise there on EVERY rank,
before any collective could hang. tests/faults/test_faults_inputs.py runs them all.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))


class Case(NamedTuple):
    area: str
    name: str
    run: Callable[..., object]
    words: tuple[str, ...]   # every one must appear in the error message


def _adam(lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.Adam([nn.Parameter(torch.zeros(3))], lr=lr)


# -- grid ------------------------------------------------------------------------------------------
def _grid(*args, **kw):
    from pipezero.topology.grid import grid_shape
    return lambda: grid_shape(*args, **kw)


GRID = [
    Case("grid", "pipe zero", _grid(4, pipe=0), ("pipe=0",)),
    Case("grid", "tensor negative", _grid(4, pipe=2, tensor=-1), ("tensor=-1",)),
    Case("grid", "pipe a string", _grid(4, pipe="2"), ("pipe='2'",)),
    Case("grid", "pipe a bool", _grid(4, pipe=True), ("pipe=True",)),
    Case("grid", "data zero", _grid(4, pipe=2, data=0), ("data=0",)),
    Case("grid", "stages do not divide world", _grid(4, pipe=3), ("4 processes", "pipe * tensor=3")),
    Case("grid", "degrees need more processes", _grid(4, pipe=2, data=3), ("needs 6 processes", "4")),
]


# -- schedule --------------------------------------------------------------------------------------


def _custom(table):
    from pipezero.pipe import Custom
    return lambda: Custom(table)


def _validate(table, stages, **kw):
    from pipezero.pipe import Custom, validate
    return lambda: validate(Custom(table), stages, **kw)


def _p():
    import pipezero.pipe as p
    return p


SCHEDULE = [
    Case("schedule", "1f1b zero microbatches", lambda: _p().OneFOneB(num_microbatches=0), ("num_microbatches",)),
    Case("schedule", "gpipe negative microbatches", lambda: _p().GPipe(num_microbatches=-1), ("-1",)),
    Case("schedule", "interleaved one chunk", lambda: _p().Interleaved1F1B(num_microbatches=4, num_chunks=1),
         ("num_chunks",)),
    Case("schedule", "interleaved m not a multiple", lambda: _p().Interleaved1F1B(num_microbatches=3).actions(2),
         ("multiple of num_stages", "e.g. 2 or 4")),
    Case("schedule", "interleaved m below p", lambda: _p().Interleaved1F1B(num_microbatches=1).actions(2),
         ("(e.g. 2)",)),
    Case("schedule", "zero stages", lambda: _p().OneFOneB(num_microbatches=4).actions(0), ("num_stages",)),
    Case("schedule", "custom without ranks", _custom({}), ("ranks 0..p-1",)),
    Case("schedule", "custom bad cell", _custom({0: ["0X0"]}), ("0X0",)),
    Case("schedule", "custom backward before forward", _validate({0: ["0B0", "0F0"]}, 1), ("0B0",)),
    Case("schedule", "custom action twice", _validate({0: ["0F0", "0B0", "0F0", "0B0"]}, 1), ("0F0",)),
    Case("schedule", "custom microbatch without backward", _validate({0: ["0F0", "0F1", "0B0"]}, 1), ("0B1",)),
    Case("schedule", "custom rank missing a microbatch",
         _validate({0: ["0F0", "0F1", "0B0", "0B1"], 1: ["0F0", "0B0"]}, 2), ("0F1",)),
    Case("schedule", "microbatches differ from expected",
         lambda: _p().validate(_p().OneFOneB(num_microbatches=4), 2, num_microbatches=8), ("8",)),
    Case("schedule", "custom text unreadable", lambda: _p().Custom.from_text("step rank 0\n  0 ?!"), ("cannot read action",)),
]


# -- optimizer chain -------------------------------------------------------------------------------
def _scaler(**kw):
    from pipezero.precision import LossScaler
    return lambda: LossScaler(_adam(), **kw)


def _zero(inner: Callable[[], object], **kw):
    from pipezero.zero import ZeroOptimizer
    return lambda: ZeroOptimizer(inner(), **kw)


def _adam_with_state():
    opt = _adam()
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    return opt


OPTIMIZER = [
    Case("optimizer", "scaler wraps no optimizer", lambda: _scaler_of(object()), ("LossScaler", "object")),
    Case("optimizer", "scale zero", _scaler(init_scale=0), ("init_scale",)),
    Case("optimizer", "scale window zero", _scaler(scale_window=0), ("scale_window",)),
    Case("optimizer", "hysteresis zero", _scaler(hysteresis=0), ("hysteresis",)),
    Case("optimizer", "min scale negative", _scaler(min_scale=-1.0), ("min_scale",)),
    Case("optimizer", "clip negative", _scaler(clip_grad_norm=-1.0), ("clip_grad_norm",)),
    Case("optimizer", "zero stage 4", _zero(_adam, stage=4), ("stage",)),
    Case("optimizer", "zero around lbfgs", _zero(lambda: torch.optim.LBFGS([nn.Parameter(torch.zeros(2))])),
         ("LBFGS", "element-wise")),
    Case("optimizer", "zero stage 3 without module", _zero(_adam, stage=3), ("module=",)),
    Case("optimizer", "zero after the first step", _zero(_adam_with_state), ("already has state",)),
    Case("optimizer", "master weights wrap no optimizer", lambda: _master_of(42), ("MasterWeights", "int")),
    Case("optimizer", "scaler around zero (the other chain order)", lambda: _scaler_of(_zero(_adam)()),
         ("LossScaler(ZeroOptimizer(stage=", "outermost", "ZeroOptimizer(LossScaler(")),
]


def _scaler_of(inner):
    from pipezero.precision import LossScaler
    return LossScaler(inner)


def _master_of(inner):
    from pipezero.precision import MasterWeights
    return MasterWeights(inner)


# -- loss-scaler state from a checkpoint -----------------------------------------------------------
def _scale_state(**edit):
    def load():
        from pipezero.precision import LossScaler
        opt = LossScaler(_adam())
        state = opt.state_dict()
        state["loss_scaler"] = {**state["loss_scaler"], **edit}
        opt.load_state_dict(state)
    return load


def _scale_state_without(key):
    def load():
        from pipezero.precision import LossScaler
        opt = LossScaler(_adam())
        state = opt.state_dict()
        del state["loss_scaler"][key]
        opt.load_state_dict(state)
    return load


SCALER = [
    Case("scaler", "scale nan", _scale_state(scale=float("nan")), ("scale=nan", "finite")),
    Case("scaler", "scale zero", _scale_state(scale=0.0), ("scale=0.0",)),
    Case("scaler", "scale negative", _scale_state(scale=-8.0), ("scale=-8.0",)),
    Case("scaler", "scale inf", _scale_state(scale=float("inf")), ("scale=inf",)),
    Case("scaler", "scale a string", _scale_state(scale="big"), ("scale='big'",)),
    Case("scaler", "iteration negative", _scale_state(iteration=-5), ("iteration=-5",)),
    Case("scaler", "skipped steps fractional", _scale_state(skipped_steps=1.5), ("skipped_steps=1.5",)),
    Case("scaler", "hysteresis left negative", _scale_state(hysteresis_left=-1), ("hysteresis_left=-1",)),
    Case("scaler", "a key missing", _scale_state_without("iteration"), ("iteration",)),
    Case("scaler", "an unknown key", _scale_state(bogus=1), ("bogus",)),
]


# -- data ------------------------------------------------------------------------------------------
def _write(tmp: Path, name: str, data: bytes | None = None, array=None) -> Path:
    path = tmp / name
    if array is not None:
        import numpy as np
        np.save(path, array)
    else:
        path.write_bytes(data or b"")
    return path


def _tokens(path_fn, **kw):
    def load(tmp: Path):
        from pipezero.train.data import TokenData
        return TokenData.from_file(path_fn(tmp), 8, **kw)
    return load


def _batches(batch, rank, degree, state=None):
    def make(tmp: Path):
        from pipezero.train.data import ShardedBatches, TokenData
        b = ShardedBatches(TokenData(torch.arange(2000) % 256, 8), batch, rank, degree)
        if state is not None:
            b.load_state_dict(state)
    return make


DATA = [
    Case("data", "data path missing", _tokens(lambda t: t / "nonexistent.txt"), ("nonexistent.txt", "--data-path")),
    Case("data", "bin of odd bytes", _tokens(lambda t: _write(t, "x.bin", b"abc")), ("3 bytes", "uint16")),
    Case("data", "npy of 2 dims", _tokens(lambda t: _write(t, "x.npy", array=__import__("numpy").zeros((4, 4), "int64"))),
         ("1-D integer array",)),
    Case("data", "npy of floats", _tokens(lambda t: _write(t, "f.npy", array=__import__("numpy").zeros(99, "float32"))),
         ("float32",)),
    Case("data", "token id past the vocabulary",
         _tokens(lambda t: _write(t, "v.npy", array=__import__("numpy").arange(600))), ("[0, 599]", "256")),
    Case("data", "text too short", _tokens(lambda t: _write(t, "short.txt", b"hello")), ("too few", "seq_len=8")),
    Case("data", "no validation share", _tokens(lambda t: _write(t, "ok.txt", b"x" * 999), val_fraction=0.0),
         ("val_fraction=0.0",)),
    Case("data", "data rank out of range", _batches(2, 2, 2), ("data_rank=2",)),
    Case("data", "batch above the data", _batches(10_000, 0, 1), ("fewer than one global batch",)),
    Case("data", "global batch changed on resume", _batches(2, 0, 2, {"epoch": 0, "step": 3, "global_batch": 8}),
         ("global batches of 8", "takes 4")),
]


# -- config ----------------------------------------------------------------------------------------
def _config(cfg: dict, world: int = 4):
    def parse():
        from pipezero.train.config import parse_config
        return parse_config({"train_batch_size": 8, **cfg}, world_size=world)
    return parse


CONFIG = [
    Case("config", "unknown key", _config({"trian_micro_batch": 1}), ("trian_micro_batch",)),
    Case("config", "batch arithmetic", _config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                                                "gradient_accumulation_steps": 1}), ("10",)),
    Case("config", "zero stages", _config({"pipeline": {"stages": 0}}), ("stages",)),
    Case("config", "unknown schedule", _config({"pipeline": {"stages": 2, "schedule": "2f2b"}}), ("2f2b",)),
    Case("config", "chunks for 1f1b", _config({"pipeline": {"stages": 2, "chunks": 3}}), ("chunks", "3")),
    Case("config", "timeout zero", _config({"pipeline": {"stages": 2, "timeout": 0}}), ("timeout",)),
    Case("config", "timeout a word", _config({"pipeline": {"stages": 2, "timeout": "soon"}}), ("timeout", "soon")),
    Case("config", "zero stage 7", _config({"zero_optimization": {"stage": 7}}), ("stage", "7")),
    Case("config", "fp16 and bf16", _config({"fp16": {"enabled": True}, "bf16": {"enabled": True}}),
         ("fp16", "bf16")),
    Case("config", "clipping negative", _config({"gradient_clipping": -1.0}), ("gradient_clipping",)),
    Case("config", "zero pipeline microbatches", _config({"pipeline": {"stages": 2, "micro_batches": 0}}),
         ("micro_batches",)),
    Case("config", "unknown optimizer", _config({"optimizer": {"type": "Nope", "params": {}}}), ("Nope",)),
    Case("config", "stages do not divide world", _config({"pipeline": {"stages": 3}}), ("3", "world size 4")),
    Case("config", "bad partition method", _config({"pipeline": {"stages": 2, "partition_method": "by-luck"}}),
         ("by-luck",)),
    Case("config", "not JSON", lambda tmp: _config_file(tmp), ("ds.json",)),
]


def _config_file(tmp: Path):
    from pipezero.train.config import parse_config
    path = tmp / "ds.json"
    path.write_text("{batch: 8")
    return parse_config(str(path), world_size=1)


# -- command line of the main job ------------------------------------------------------------------
def _cli(*argv: str):
    def parse(tmp: Path):
        import train_gpt
        args = train_gpt.parse_args(["--out", str(tmp), *argv])
        from pipezero.train.config import parse_config
        return parse_config(train_gpt.ds_config(args), world_size=4)
    return parse


def _resume_from(name: str):
    def resume(tmp: Path):
        import train_gpt
        (tmp / "step_00000002").mkdir()
        return train_gpt.resume(None, tmp, name)
    return resume


def _plain_python(tmp: Path):
    import os

    import train_gpt
    saved = os.environ.pop("WORLD_SIZE", None)
    try:
        return train_gpt.main(["--out", str(tmp)])
    finally:
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved


CLI = [
    Case("cli", "micro-batches zero", _cli("--micro-batches", "0"), ("--micro-batches", "positive")),
    Case("cli", "batch-size zero", _cli("--batch-size", "0"), ("--batch-size", "positive")),
    Case("cli", "batch-size negative", _cli("--batch-size", "-3"), ("--batch-size", "-3")),
    Case("cli", "micro-batches a word", _cli("--micro-batches", "many"), ("--micro-batches", "many")),
    Case("cli", "unknown schedule", _cli("--schedule", "2f2b"), ("--schedule", "2f2b")),
    Case("cli", "pipeline timeout zero", _cli("--pipeline-timeout", "0"), ("timeout",)),
    Case("cli", "resume-from not a step", _resume_from("latest"), ("--resume-from", "step_00000012")),
    Case("cli", "resume-from a missing step", _resume_from("step_00000099"), ("step_00000099", "step_00000002")),
    Case("cli", "plain python, two stages", _plain_python, ("torchrun", "--pipe 1")),
]

PURE = GRID + SCHEDULE + OPTIMIZER + SCALER + DATA + CONFIG + CLI

from catalogue_cli import ALL as _COMMANDS  # noqa: E402 - the pipezero command's flags (they import Case)
from catalogue_hf import ALL as _HF  # noqa: E402 - broken Hugging Face checkpoints

PURE += _COMMANDS + _HF

from catalogue_finetune import ALL as _FINETUNE  # noqa: E402 - pipezero finetune's flags (issue 44)

PURE += _FINETUNE
