"""Packages whose public names import their modules on first use, so a light module under them stays light.

`pipezero.train` re-exports the parts (build, initialize, save_state, ...), which import torch; the
command line's modules live under it too (train/cli.py, train/flags.py) and must answer `--help`
before torch loads. A lazy package keeps `from pipezero.train import build` working and imports
pipezero.train.build only then (PEP 562's module __getattr__). Where an exported name is also a
submodule's name (the function `build` of the module pipezero.train.build), the export stays the
package's attribute when the submodule is imported, as it was with eager imports.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Mapping

__all__ = ["lazy_package"]


class _LazyPackage(types.ModuleType):
    """A package module whose `_lazy_exports` (name -> module) are imported when first asked for."""

    _lazy_exports: Mapping[str, str]

    def __getattr__(self, name: str) -> object:
        module = vars(self).get("_lazy_exports", {}).get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        exports = vars(self).get("_lazy_exports", {})
        if isinstance(value, types.ModuleType) and exports.get(name) == value.__name__ == f"{self.__name__}.{name}":
            value = getattr(value, name)  # the import system binds the submodule: the function of its name wins
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *vars(self).get("_lazy_exports", {})})


def lazy_package(name: str, exports: Mapping[str, str]) -> None:
    """Make the package `name` (its __init__ calls this) import each of `exports` (name -> module) on use."""
    package = sys.modules[name]
    package.__class__ = _LazyPackage  # Python's documented way to give a module attribute hooks
    package._lazy_exports = dict(exports)
