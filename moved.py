"""Old module paths of files moved into subsystem folders: they still import, with a DeprecationWarning.

pipe/ and train/ were once flat (pipe/schedules.py, train/plan_memory.py); their subsystems now
have folders (pipe/schedule/, train/plan/, ...). `import pipezero.pipe.schedules` keeps working:
the finder below is asked only after the normal ones found nothing, imports the new module,
warns with the new path, and the old name becomes an alias of the very same module object (so
`isinstance`, monkeypatching and module state agree under both names). One table, no shim files.

Four old modules share their name with the folder that replaced them (pipezero.pipe.hf,
pipezero.train.config, pipezero.train.plan, pipezero.train.checkpoint): such a path is the package
now, and the package re-exports the old module's public names (`BECAME_PACKAGES` says from where).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["BECAME_PACKAGES", "MOVED", "install"]

MOVED: dict[str, str] = {
    # pipe/schedule/: schedules as data, apart from the executor
    **{f"pipezero.pipe.{m}": f"pipezero.pipe.schedule.{m}" for m in
       ("actions", "placement", "schedules", "registry", "validate", "simulate", "render", "timeline")},
    # pipe/hf/: the Hugging Face adapter
    **{f"pipezero.pipe.hf_{m}": f"pipezero.pipe.hf.{m}" for m in ("generate", "match", "tensor", "weights")},
    # train/config/: ds_config -> the parts' configs
    **{f"pipezero.train.config_{m}": f"pipezero.train.config.{m}" for m in ("auto", "batch", "compile", "keys", "optim")},
    # train/plan/: the planner
    **{f"pipezero.train.plan_{m}": f"pipezero.train.plan.{m}" for m in ("cli", "hardware", "layout", "memory", "model")},
    "pipezero.train.plan_time": "pipezero.train.plan.step_time",
    # train/checkpoint/: checkpoints and exports
    "pipezero.train.checkpoint_state": "pipezero.train.checkpoint.flatten",
    **{f"pipezero.train.{m}": f"pipezero.train.checkpoint.{m}" for m in
       ("state", "state_parts", "saveable", "tensor_state", "lora_state", "hf_export", "lora_export")},
}

BECAME_PACKAGES: dict[str, str] = {  # old module -> the module of the package that holds its code now
    "pipezero.pipe.hf": "pipezero.pipe.hf.specs",
    "pipezero.train.config": "pipezero.train.config.parse",
    "pipezero.train.plan": "pipezero.train.plan.planner",
    "pipezero.train.checkpoint": "pipezero.train.checkpoint.files",
}


class _KeepsItsNames(types.ModuleType):
    """A parent package of old paths. After loading a submodule the import system sets it as the parent's
    attribute; where the package already holds a name of its own there (pipezero.pipe.simulate is the
    function, as it was before the move), the old path's alias must not replace it."""

    def __setattr__(self, name: str, value: object) -> None:
        alias = isinstance(value, types.ModuleType) and MOVED.get(f"{self.__name__}.{name}") == value.__name__
        if alias and name in vars(self) and not isinstance(vars(self)[name], types.ModuleType):
            return
        super().__setattr__(name, value)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths in MOVED; loading one imports the new module and returns it under the old name."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new, parent = MOVED[spec.name], sys.modules[spec.name.rpartition(".")[0]]
        if type(parent) is types.ModuleType:
            parent.__class__ = _KeepsItsNames  # Python's documented way to customise a module's setattr
        # stacklevel 2: the importing line (warnings skips importlib's own bootstrap frames)
        warnings.warn(f"{spec.name} moved to {new}; import {new} instead", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)  # its own __spec__ and __name__ stay: importlib sets only missing ones

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the new module ran when it was imported."""


def install() -> None:
    """Put the finder last on sys.meta_path, once (a real module of an old name would still win)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
