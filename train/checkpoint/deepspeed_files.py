"""DeepSpeed's checkpoint files, read without running any of their code: every parameter whole again.

DeepSpeed (0.19.8) saves `engine.save_checkpoint(dir)` under dir/<tag>/ (tag "global_step<N>", the
one dir/latest names):

    mp_rank_00_model_states.pt                   ZeRO 1-2: the module's state_dict, param_shapes (per
                                                 param group, in flattening order), the LR scheduler's
                                                 state, global_steps, skipped_steps, dp_world_size
    zero_pp_rank_<d>_mp_rank_00_model_states.pt  ZeRO-3: the same, one per data rank (the module empty)
    zero_pp_rank_<d>_mp_rank_00_optim_states.pt  one per data rank d (bf16: bf16_zero_pp_rank_...):
      ZeRO-1/2  each param group's parameters back to back in one flat fp32 vector, padded at its
                end and cut into dp equal partitions; rank d holds partition d of the masters
                (single_partition_of_fp32_groups) and of the optimizer's moments (base_optimizer_state),
                and param_slice_mappings names each piece (parameter, numel, start in the partition)
      ZeRO-3    every parameter cut on its own into dp pieces of ceil(numel / dp), the last padded;
                rank d's sub-groups hold its piece of each parameter back to back (fp32_flat_groups,
                optimizer_state_dict), in param_shapes order

and `ds_to_universal --input_folder dir/<tag> --output_folder OUT` writes every parameter whole:
OUT/zero/<name>/{fp32,exp_avg,exp_avg_sq[,step]}.pt, the optimizer's common state in
OUT/zero/optimizer_state.pt, the model_states files copied, OUT's name in OUT/../latest_universal.

Files are read with torch.load(weights_only=True, mmap=True): three DeepSpeed types inside them
(ZeroStageEnum, fragment_address, the loss scalers) load as plain stand-ins that keep their fields.
Anything this reader cannot map (pipeline layer_* files, tensor-parallel mp_rank_01, a ZeRO stage 0
checkpoint, a partition that does not add up) is a CheckpointError naming the file and the key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from pipezero.train.checkpoint.files import CheckpointError

__all__ = ["DeepSpeedState", "deepspeed_folder", "read_deepspeed"]

_OPTIM_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's moments, laid out as the masters are
_OWN_KEYS = {"module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
             "random_ltd", "lr_scheduler", "optimizer"}  # what DeepSpeed's load_checkpoint leaves out of client_state


class _Fields:
    """What DeepSpeed pickled as an object: its fields, nothing else (no method of it runs)."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fields = dict(state)


class _Fragment(_Fields):
    """deepspeed.utils.tensor_fragment.fragment_address: (numel, start) of a parameter's piece."""


class _Scaler(_Fields):
    """deepspeed.runtime.fp16.loss_scaler's LossScaler / DynamicLossScaler: cur_scale, cur_iter..."""


_STAND_INS = [(int, "deepspeed.runtime.zero.config.ZeroStageEnum"),
              (_Fragment, "deepspeed.utils.tensor_fragment.fragment_address"),
              (_Scaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
              (_Scaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")]


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint by DeepSpeed's parameter names, every tensor whole and fp32."""

    path: Path                                            # the tag folder (or universal folder) read
    weights: dict[str, torch.Tensor]                      # name -> the fp32 master (frozen ones: the module's)
    optim: dict[str, dict[str, torch.Tensor]]             # name -> {"exp_avg", "exp_avg_sq", "step"}
    groups: list[tuple[list[str], dict[str, Any]]]        # param-group settings (lr, betas...) and their names
    shared: dict[str, str] = field(default_factory=dict)  # a tied name -> the name it is stored under
    scheduler: dict[str, Any] | None = None               # the LR scheduler's state_dict
    loss_scaler: dict[str, Any] | None = None             # DeepSpeed's loss-scaler fields (cur_scale...)
    global_steps: int = 0
    skipped_steps: int = 0
    data_size: int = 1                                    # dp_world_size it was saved on
    zero_stage: int | str = 0                             # 1, 2, 3 or "universal"
    model_file: str = ""                                  # where the names came from (for errors)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # every parameter's, read or not
    client: dict[str, Any] = field(default_factory=dict)  # the model_states' other keys (client_state)


def _load(path: Path) -> Any:
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:  # a file of torch's legacy (not zip) format cannot be mapped: read it
                if "mmap" not in str(err):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError / RuntimeError / OSError, by cause
        raise CheckpointError(f"{path}: not readable with torch.load(weights_only=True) ({str(err)[:300]}); "
                              "pipezero reads only tensors, numbers and DeepSpeed's known plain records") from None


def _key(data: Any, key: str, path: Path, where: str = "") -> Any:
    if not isinstance(data, dict) or key not in data:
        raise CheckpointError(f"{path}: has no {where}[{key!r}]; expected a checkpoint written by DeepSpeed's "
                              "engine.save_checkpoint (or ds_to_universal)")
    return data[key]


def deepspeed_folder(path: str | Path, tag: str | None = None) -> Path:
    """The folder of one DeepSpeed checkpoint: path/tag, path itself when it holds the files, else the tag
    that path/latest (then path/latest_universal) names."""
    path = Path(path)
    if tag is not None:
        folder = path / str(tag)
    elif any(path.glob("*model_states.pt")):
        folder = path
    else:
        pointer = next((path / n for n in ("latest", "latest_universal") if (path / n).is_file()), None)
        if pointer is None:
            raise CheckpointError(f"{path}: no DeepSpeed checkpoint there (no *model_states.pt, no 'latest' file); "
                                  "pass the folder engine.save_checkpoint wrote, or tag=")
        folder = path / pointer.read_text().strip()
    if not folder.is_dir() or not any(folder.glob("*model_states.pt")):
        raise CheckpointError(f"{folder}: holds no DeepSpeed *model_states.pt file; pass the save_checkpoint folder "
                              "and the tag of a complete checkpoint")
    return folder


def read_deepspeed(path: str | Path, tag: str | None = None, wanted: Iterable[str] | None = None) -> DeepSpeedState:
    """The fp32 value and Adam state, whole, of each parameter of the DeepSpeed checkpoint at path (and tag)
    named in `wanted` (None: all; a name tied to a wanted one comes too); every parameter's shape.

    The files are memory-mapped: a rank reads only the pieces of the parameters it asks for.
    """
    folder = deepspeed_folder(path, tag)
    _refuse_layouts(folder)
    model_file = sorted(folder.glob("*model_states.pt"))[0]
    model = _load(model_file)
    shared = dict(model.get("shared_params") or {})
    want = None if wanted is None else set(wanted) | {shared[n] for n in wanted if n in shared}
    if (folder / "zero" / "optimizer_state.pt").is_file():
        return _universal(folder, model, model_file, want)
    optim_files = _optim_files(folder, model, model_file)
    first = _load(optim_files[0])
    stage = int(_key(_key(first, "optimizer_state_dict", optim_files[0]), "zero_stage", optim_files[0],
                     "['optimizer_state_dict']"))
    state = _common(folder, model, model_file, stage)
    optim = [first] + [_load(f) for f in optim_files[1:]]
    shapes = _shapes(model, model_file)
    state.shapes = {name: tuple(shape) for group in shapes for name, shape in group.items()}
    if stage in (1, 2):
        _zero12(state, optim, optim_files, shapes, want)
    else:
        _zero3(state, optim, optim_files, shapes, want)
    state.loss_scaler = _scaler(first["optimizer_state_dict"])
    _frozen(state, model, model_file, want)
    return state


def _refuse_layouts(folder: Path) -> None:
    """DeepSpeed's pipeline (layer_* files) and tensor-parallel (mp_rank > 0) checkpoints are not mapped."""
    layers = sorted(folder.glob("layer_*"))
    if layers:
        raise CheckpointError(f"{layers[0]}: a DeepSpeed pipeline-parallel checkpoint (layer_* files) is not "
                              "supported; save the DeepSpeed model without its PipelineModule, or convert it "
                              "with ds_to_universal first")
    tensor = sorted(f for f in folder.glob("*mp_rank_*") if not re.search(r"mp_rank_0+_", f.name))
    if tensor:
        raise CheckpointError(f"{tensor[0]}: a tensor-parallel DeepSpeed checkpoint (mp_rank > 0) is not supported; "
                              "pipezero maps a data-parallel ZeRO checkpoint (mp_rank_00 only)")


def _optim_files(folder: Path, model: Any, model_file: Path) -> list[Path]:
    """[bf16_]zero_pp_rank_<d>_mp_rank_00_optim_states.pt for d = 0 .. dp_world_size - 1, each present
    (bf16 training names them with the prefix)."""
    size = int(_key(model, "dp_world_size", model_file))
    if int(model.get("mp_world_size", 1)) != 1:
        raise CheckpointError(f"{model_file}: ['mp_world_size']={model['mp_world_size']}: a tensor-parallel "
                              "DeepSpeed checkpoint is not supported")
    prefix = "bf16_" if (folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file() else ""
    files = [folder / f"{prefix}zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(size)]
    missing = [f.name for f in files if not f.is_file()]
    if missing and not any(folder.glob("*optim_states.pt")):
        raise CheckpointError(f"{folder}: holds no *optim_states.pt (a ZeRO stage 0 checkpoint, whose optimizer "
                              f"state is {model_file.name}['optimizer'], is not supported); save it under ZeRO 1-3")
    if missing:
        raise CheckpointError(f"{folder}: lacks {missing} of the {size} data ranks ({model_file.name}"
                              "['dp_world_size']); the checkpoint is incomplete")
    return files


def _common(folder: Path, model: Any, model_file: Path, stage: int | str) -> DeepSpeedState:
    if model.get("optimizer") is not None and stage != "universal":
        raise CheckpointError(f"{model_file}: ['optimizer'] holds the whole optimizer (ZeRO stage 0), which is not "
                              "supported; save it under ZeRO 1-3")
    return DeepSpeedState(path=folder, weights={}, optim={}, groups=[], shared=dict(model.get("shared_params") or {}),
                          scheduler=model.get("lr_scheduler"), global_steps=int(model.get("global_steps", 0)),
                          skipped_steps=int(model.get("skipped_steps", 0)),
                          data_size=int(_key(model, "dp_world_size", model_file)), zero_stage=stage,
                          model_file=str(model_file), client={k: v for k, v in model.items() if k not in _OWN_KEYS})


def _shapes(model: Any, model_file: Path) -> list[dict[str, torch.Size]]:
    """param_shapes: per param group, each parameter's shape, in the order DeepSpeed flattened them."""
    shapes = _key(model, "param_shapes", model_file)
    if isinstance(shapes, dict):
        shapes = [shapes]
    return [dict(group) for group in shapes]


def _check_keys(state: dict[str, Any], path: Path, where: str) -> None:
    """Only Adam's state is mapped: another optimizer's (SGD's momentum_buffer...) is refused, not dropped."""
    other = sorted(set(state) - {*_OPTIM_KEYS, "step"})
    if other:
        raise CheckpointError(f"{path}: {where} holds {other}, optimizer state pipezero does not map (Adam's "
                              "exp_avg / exp_avg_sq / step are); load the weights alone (optimizer=False, "
                              "load_optimizer_states=False)")


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _base_state(optim: dict[str, Any], key: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per flat vector: the optimizer's state, per flat vector: its group's settings) of a torch state_dict
    whose parameters are DeepSpeed's flat vectors (ZeRO-3: one per sub-group, several in a param group)."""
    saved = optim[key]
    if isinstance(saved, list):  # older DeepSpeed: one state per group, no settings
        return saved, []
    flat = sorted((i, group) for group in saved["param_groups"] for i in group["params"])
    return [saved["state"].get(i, {}) for i, _ in flat], [group for _, group in flat]


def _zero12(state: DeepSpeedState, optim: list[Any], files: list[Path], shapes: list[dict], want: set | None
            ) -> None:
    """ZeRO-1/2: each parameter is the pieces param_slice_mappings names, in data-rank order."""
    sd = [o["optimizer_state_dict"] for o in optim]
    masters = [_key(s, "single_partition_of_fp32_groups", f, "['optimizer_state_dict']") for s, f in zip(sd, files)]
    pieces = [_key(s, "param_slice_mappings", f, "['optimizer_state_dict']") for s, f in zip(sd, files)]
    states = [_base_state(s, "base_optimizer_state") for s in sd]
    for g in range(len(states[0][0])):
        _check_keys(states[0][0][g], files[0], f"['optimizer_state_dict']['base_optimizer_state'][{g}]")
    for g, group in enumerate(shapes):
        for name, shape in group.items():
            if want is not None and name not in want:
                continue
            where = [(r, pieces[r][g][name].fields) for r in range(len(sd)) if name in pieces[r][g]]

            def whole(part_of: Any) -> torch.Tensor:
                flat = [part_of(r)[a["start"]:a["start"] + a["numel"]] for r, a in where]
                return _reshaped(torch.cat(flat) if flat else torch.empty(0), shape, name, files[0])
            state.weights[name] = whole(lambda r: masters[r][g])
            moments = {k: whole(lambda r, k=k: states[r][0][g][k]) for k in _OPTIM_KEYS if k in states[0][0][g]}
            state.optim[name] = {**moments, **_step(states[0][0][g])}
        if states[0][1]:
            state.groups.append((list(group), _settings(states[0][1][g])))


def _zero3(state: DeepSpeedState, optim: list[Any], files: list[Path], shapes: list[dict], want: set | None
           ) -> None:
    """ZeRO-3: parameter i is piece i of every rank's sub-groups (ceil(numel / dp) each), rank after rank;
    a sub-group holds whole parameters' pieces, back to back."""
    sd = [o["optimizer_state_dict"] for o in optim]
    flats = [_key(s, "fp32_flat_groups", f, "['optimizer_state_dict']") for s, f in zip(sd, files)]
    states = [_base_state(s, "optimizer_state_dict") for s in sd]
    for i, sub in enumerate(states[0][0]):
        _check_keys(sub, files[0], f"['optimizer_state_dict']['optimizer_state_dict']['state'][{i}]")
    sizes = [t.numel() for t in flats[0]]
    keys = [k for k in _OPTIM_KEYS if all(k in sub for sub in states[0][0])]
    sub, at, dp = 0, 0, len(sd)
    for group in shapes:
        for name, shape in group.items():
            piece = math.ceil(math.prod(shape) / dp)
            if at == sizes[sub] and sub + 1 < len(sizes):  # this sub-group is done: the next one's first piece
                sub, at = sub + 1, 0
            if want is None or name in want:
                def whole(flat_of: Any) -> torch.Tensor:
                    joined = torch.cat([flat_of(r)[at:at + piece] for r in range(dp)])[:math.prod(shape)]
                    return _reshaped(joined, shape, name, files[0])
                state.weights[name] = whole(lambda r: flats[r][sub])
                state.optim[name] = {**{k: whole(lambda r, k=k: states[r][0][sub][k]) for k in keys},
                                     **_step(states[0][0][sub])}
                if states[0][1]:
                    state.groups.append(([name], _settings(states[0][1][sub])))
            at += piece
    if (sub, at) != (len(sizes) - 1, sizes[-1]):
        raise CheckpointError(f"{files[0]}: ['optimizer_state_dict']['fp32_flat_groups'] hold {sizes} values, "
                              "param_shapes' parameters do not fill them so; the files are not of one checkpoint")


def _step(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {"step": torch.as_tensor(saved["step"], dtype=torch.float32).clone()} if "step" in saved else {}


def _reshaped(flat: torch.Tensor, shape: Any, name: str, path: Path) -> torch.Tensor:
    if flat.numel() != math.prod(shape):
        raise CheckpointError(f"{path}: the pieces of {name!r} hold {flat.numel()} values, its shape {tuple(shape)} "
                              f"takes {math.prod(shape)}; the files are not of one checkpoint")
    return flat.reshape(shape).float().clone()


def _scaler(optim: dict[str, Any]) -> dict[str, Any] | None:
    scaler = optim.get("loss_scaler")
    return dict(scaler.fields) if isinstance(scaler, _Fields) else None


def _frozen(state: DeepSpeedState, model: Any, model_file: Path, want: set | None) -> None:
    """Parameters no optimizer held (requires_grad False): the module's values (ZeRO 1-2), or each data
    rank's piece of them (ZeRO-3's frozen_param_fragments, one per zero_pp_rank_<d> model_states file)."""
    frozen = model.get("frozen_param_shapes") or {}
    pieces: list[Any] | None = None
    for name, shape in frozen.items():
        state.shapes[name] = tuple(shape)
        if want is not None and name not in want:
            continue
        value = (model.get("module") or {}).get(name)
        if value is None or value.numel() != math.prod(shape):
            pieces = pieces if pieces is not None else _fragments(model_file.parent, state.data_size)
            value = torch.cat([_key(_key(p, "frozen_param_fragments", f), name, f, "['frozen_param_fragments']")
                               .reshape(-1) for f, p in pieces])[:math.prod(shape)]
        state.weights[name] = _reshaped(value.reshape(-1), shape, name, model_file)


def _fragments(folder: Path, size: int) -> list[tuple[Path, Any]]:
    """Each data rank's ZeRO-3 model_states file, in data-rank order."""
    files = [folder / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(size)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder}: lacks {missing}, which hold the frozen parameters' pieces; the checkpoint "
                              "is incomplete")
    return [(f, _load(f)) for f in files]


def _universal(folder: Path, model: Any, model_file: Path, want: set | None) -> DeepSpeedState:
    """ds_to_universal's output: zero/<name>/<key>.pt whole (a tensor, or {"param": tensor}), by param_shapes."""
    common = _load(folder / "zero" / "optimizer_state.pt")
    state = _common(folder, model, model_file, "universal")
    saved = common.get("base_optimizer_state") or common.get("optimizer_state_dict") or {}
    groups = saved.get("param_groups", []) if isinstance(saved, dict) else []
    steps = saved.get("state", {}) if isinstance(saved, dict) else {}
    for g, group in enumerate(_shapes(model, model_file)):
        for name, shape in group.items():
            state.shapes[name] = tuple(shape)
            if want is not None and name not in want:
                continue
            state.weights[name] = _universal_tensor(folder, name, "fp32", shape)
            _check_keys({f.stem: None for f in (folder / "zero" / name).glob("*.pt") if f.stem != "fp32"},
                        folder / "zero" / name, "the folder")
            state.optim[name] = {k: _universal_tensor(folder, name, k, shape) for k in _OPTIM_KEYS
                                 if (folder / "zero" / name / f"{k}.pt").is_file()}
            step_file = folder / "zero" / name / "step.pt"
            step = _load(step_file) if step_file.is_file() else steps.get(min(g, len(steps) - 1), {}).get("step")
            if step is not None:
                state.optim[name]["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        if groups:
            state.groups.append((list(group), _settings(groups[min(g, len(groups) - 1)])))
    state.loss_scaler = _scaler(common)
    _frozen(state, model, model_file, want)
    return state


def _universal_tensor(folder: Path, name: str, key: str, shape: Any) -> torch.Tensor:
    path = folder / "zero" / name / f"{key}.pt"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the universal checkpoint has no {key} of parameter {name!r}")
    value = _load(path)
    if isinstance(value, dict):
        value = _key(value, "param", path)
    return _reshaped(value.reshape(-1), shape, name, path)
