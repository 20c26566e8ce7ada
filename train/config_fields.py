"""Typed reading of one ds_config.json section, with errors that name the key path and the fix.

JSON has no int/float distinction and DeepSpeed users write bucket sizes as `5e8`, so an
integral float is accepted where an int is expected; `true` must be a bool, not `1` or "true".
Every section records the keys it read, so keys nobody read are reported, never dropped.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping

from pipezero.train.log import warn_once

__all__ = ["AUTO", "ConfigError", "ConfigTypeError", "Section"]

AUTO = "auto"


class ConfigError(ValueError):
    """A ds_config value or key that pipezero cannot honour."""


class ConfigTypeError(ConfigError, TypeError):
    """A ds_config value of the wrong JSON type."""


class Section:
    """One JSON object of the config, read key by key; `finish()` rejects what was not read."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            raise ConfigTypeError(f"{path} = {data!r}: expected a JSON object {{...}}, "
                                  f"got {type(data).__name__}")
        self.data, self.path, self.read = data, path, set()

    def where(self, key: str) -> str:
        """The key's path for error messages, e.g. ds_config["zero_optimization"]["stage"]."""
        return f'{self.path}["{key}"]'

    def has(self, key: str) -> bool:
        """Whether the key is present (and mark it read)."""
        self.read.add(key)
        return key in self.data

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as written, or default."""
        self.read.add(key)
        return self.data.get(key, default)

    def bool(self, key: str, default: bool) -> bool:
        """A JSON true/false."""
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise ConfigTypeError(f"{self.where(key)} = {value!r}: expected true or false{_auto_hint(value)}")
        return value

    def int(self, key: str, default: Any, lo: int | None = None, hi: int | None = None,
            auto: bool = False) -> Any:
        """An integer in [lo, hi]; an integral float like 5e8 is accepted; "auto" if allowed."""
        value = self.raw(key, default)
        if auto and value == AUTO:
            return AUTO
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            hint = ' or "auto"' if auto else _auto_hint(value)
            raise ConfigTypeError(f"{self.where(key)} = {value!r}: expected an integer{hint}")
        self._check_range(key, value, lo, hi)
        return value

    def float(self, key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
        """A number in [lo, hi]."""
        value = self.raw(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigTypeError(f"{self.where(key)} = {value!r}: expected a number{_auto_hint(value)}")
        self._check_range(key, value, lo, hi)
        return float(value)

    def choice(self, key: str, default: Any, choices: Iterable[Any]) -> Any:
        """One of a fixed set of values (strings are compared case-insensitively)."""
        choices = list(choices)
        value = self.raw(key, default)
        norm = value.lower() if isinstance(value, str) else value
        for c in choices:
            if norm == (c.lower() if isinstance(c, str) else c) and type(norm) is type(c):
                return c
        raise ConfigError(f"{self.where(key)} = {value!r}: expected one of "
                          f"{', '.join(repr(c) for c in choices)}")

    def section(self, key: str) -> "Section":
        """A nested JSON object (an empty one when absent)."""
        return Section(self.raw(key, {}), self.where(key))

    def finish(self, cosmetic: Mapping[str, str] = {}, known: Mapping[str, str] = {}) -> None:
        """Reject keys nobody read: cosmetic ones warn once, known DeepSpeed ones say the fix."""
        for key in self.data:
            if key in self.read:
                continue
            if key in cosmetic:
                warn_once(f"{self.where(key)} is ignored by pipezero ({cosmetic[key]})")
            elif key in known:
                raise ConfigError(f"{self.where(key)} is not supported by pipezero: {known[key]}")
            else:
                accepted = ", ".join(sorted(self.read)) or "none"
                raise ConfigError(f"{self.where(key)} is not a key pipezero knows"
                                  f"{_did_you_mean(key, [*self.read, *cosmetic])}; remove it "
                                  f"(accepted here: {accepted})")

    def _check_range(self, key: str, value: Any, lo: Any, hi: Any) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if hi is None:
                bounds = f"a value >= {lo}"
            elif lo is None:
                bounds = f"a value <= {hi}"
            else:
                bounds = f"a value in [{lo}, {hi}]"
            raise ConfigError(f"{self.where(key)} = {value!r}: expected {bounds}")


def _auto_hint(value: Any) -> str:
    if value == AUTO:
        return ' ("auto" is filled in by the HuggingFace Trainer; write the number here)'
    return ""


def _did_you_mean(key: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.7)
    return f' (did you mean "{close[0]}"?)' if close else ""
