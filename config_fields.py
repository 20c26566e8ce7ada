"""Typed reading of one ds_config.json section with DeepSpeed 0.19.8's coercions and key rules.

Each package reads the DeepSpeed section it owns (precision/: fp16 and bf16, zero/:
zero_optimization, train/: the rest) through this one reader, so it lives under the import
root, below all of them (the bottom layer of the import contract in pyproject.toml).
DeepSpeed reads its sections through pydantic in lax mode, and its users' files rely on
that: "true"/"false" (and yes/no, on/off, 1/0) are booleans, 2e8 and "16"
are integers, numeric strings are numbers, and inside a section Hugging Face's placeholder
"auto" is dropped so DeepSpeed's default applies. A section also sorts every key it does not
read into one of three cases with its own message:
  * a DeepSpeed key pipezero does not act on (`Ignored`): silent at its no-op value, else one
    warning;
  * a DeepSpeed feature pipezero lacks (`Unsupported`): refused unless at its no-op value;
  * a key of no DeepSpeed version: a near miss of a real key is a typo error ("did you mean");
    otherwise an error where DeepSpeed refuses unknown keys (`strict`, its pydantic sections)
    and one warning where DeepSpeed ignores them (the top level).
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["AUTO", "ConfigError", "ConfigTypeError", "Ignored", "Rule", "Section", "Unsupported", "as_bool",
           "warn_once"]

AUTO = "auto"
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_NEVER = object()
_log = logging.getLogger("pipezero.config")
_WARNED: set[tuple] = set()


class ConfigError(ValueError):
    """A ds_config value or key that pipezero cannot honour."""


class ConfigTypeError(ConfigError, TypeError):
    """A ds_config value of the wrong JSON type."""


def warn_once(message: str, *args: object, logger: logging.Logger | None = None) -> bool:
    """Log a warning the first time this (message, args) is seen in the process; True if logged.

    pipezero's one warn-once helper (train/log.py exports it beside the rank-aware logger): it
    lives in this module, the bottom layer, so that every package's config reader can use it.
    Without `logger` it warns on the `pipezero.config` logger.
    """
    key = (message, args)
    if key in _WARNED:
        return False
    _WARNED.add(key)
    (logger or _log).warning(message, *args)
    return True


@dataclass(frozen=True)
class Ignored:
    """A DeepSpeed key with no effect here: silent at `noop` (a value or a predicate), else one warning."""

    why: str
    noop: Any = _NEVER


@dataclass(frozen=True)
class Unsupported:
    """A DeepSpeed feature pipezero lacks: `what` it does and the `fix`; refused unless at `noop`."""

    what: str
    fix: str
    noop: Any = _NEVER


Rule = Ignored | Unsupported


def as_bool(value: Any) -> bool | None:
    """DeepSpeed's (pydantic's) reading of a boolean, or None when the value is not one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    return None


def _is_noop(value: Any, noop: Any) -> bool:
    if noop is _NEVER:
        return False
    if callable(noop):
        return bool(noop(value))
    if value == AUTO:
        return True
    if isinstance(noop, bool):
        return as_bool(value) is noop
    return value == noop


class Section:
    """One JSON object of the config at `keys` (e.g. ("zero_optimization", "offload_param")).

    `auto_default`: an "auto" value means "use the default" (DeepSpeed's pydantic sections);
    otherwise it is an error that says which argument resolves it.
    """

    def __init__(self, data: Any, keys: tuple[str, ...] = (), *, auto_default: bool = True):
        self.keys, self.auto_default = tuple(keys), auto_default
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigTypeError(f"{self.path} = {data!r}: expected a JSON object {{...}}, "
                                  f"got {type(data).__name__}")
        self.data = data

    @property
    def path(self) -> str:
        """The section's path for messages, e.g. ds_config["zero_optimization"]."""
        return "ds_config" + "".join(f'["{k}"]' for k in self.keys)

    def where(self, key: str) -> str:
        """The key's path for messages, e.g. ds_config["zero_optimization"]["stage"]."""
        return f'{self.path}["{key}"]'

    def check(self, known: Iterable[str], rules: Mapping[str, Rule] = {}, *, strict: bool = True) -> None:
        """Sort every key that is not in `known`: ignored (warn), unsupported or unknown (refuse)."""
        known = set(known)
        for key, value in self.data.items():
            if key in known:
                continue
            rule = rules.get(key)
            if isinstance(rule, Ignored):
                if not _is_noop(value, rule.noop):
                    warn_once(f"{self.where(key)} is ignored by pipezero: {rule.why}")
            elif isinstance(rule, Unsupported):
                if not _is_noop(value, rule.noop):
                    raise ConfigError(f"{self.where(key)} = {value!r}: DeepSpeed's {key} ({rule.what}) is not "
                                      f"supported by pipezero: remove it or {rule.fix}")
            else:
                self._unknown(key, [*known, *rules], strict)

    def _unknown(self, key: str, candidates: list[str], strict: bool) -> None:
        close = _near_miss(key, candidates)
        if close:
            raise ConfigError(f'{self.where(key)} is not a DeepSpeed key: did you mean "{close}"?')
        if strict:
            raise ConfigError(f"{self.where(key)} is not a key of DeepSpeed's {self.path} section (DeepSpeed "
                              f"0.19.8 refuses it too); remove it. Known keys: {', '.join(sorted(candidates))}")
        warn_once(f"{self.where(key)} is not a key of any DeepSpeed version; ignored (as DeepSpeed ignores it)")

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as written, or default (also for "auto" where "auto" means the default)."""
        value = self.data.get(key, default)
        if value == AUTO and isinstance(value, str):
            if self.auto_default:
                return default
            dotted = ".".join((*self.keys, key))
            raise ConfigError(f'{self.where(key)} is "auto" and nothing resolves it: pass '
                              f'auto_values={{"{dotted}": ...}} to parse_config, build or initialize '
                              f"(the value your script would have given Hugging Face), or write the value")
        return value

    def bool(self, key: str, default: bool) -> bool:
        """true/false, or one of the strings and numbers DeepSpeed reads as a boolean."""
        value = self.raw(key, default)
        got = as_bool(value)
        if got is None:
            raise ConfigTypeError(f"{self.where(key)} = {value!r}: expected true or false")
        return got

    def int(self, key: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
        """An integer in [lo, hi]; 5e8 and "16" are integers, as in DeepSpeed."""
        value = self.raw(key, default)
        if value is default and value is None:
            return None
        got = value
        if isinstance(value, float) and value.is_integer():
            got = int(value)
        elif isinstance(value, str):
            try:
                got = int(value.strip())
            except ValueError:
                pass
        if not isinstance(got, int) or isinstance(got, bool):
            raise ConfigTypeError(f"{self.where(key)} = {value!r}: expected an integer")
        self._check_range(key, got, lo, hi)
        return got

    def float(self, key: str, default: Any, lo: float | None = None, hi: float | None = None) -> Any:
        """A finite number in [lo, hi]; numeric strings are numbers, as in DeepSpeed."""
        value = self.raw(key, default)
        got = value
        if isinstance(value, str):
            try:
                got = float(value)
            except ValueError:
                pass
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            raise ConfigTypeError(f"{self.where(key)} = {value!r}: expected a finite number")
        self._check_range(key, got, lo, hi)
        return float(got)

    def choice(self, key: str, default: Any, choices: Iterable[str]) -> str:
        """One of a fixed set of strings, compared case-insensitively."""
        choices = list(choices)
        value = self.raw(key, default)
        for c in choices:
            if isinstance(value, str) and value.lower() == c.lower():
                return c
        raise ConfigError(f"{self.where(key)} = {value!r}: expected one of {', '.join(repr(c) for c in choices)}")

    def section(self, key: str, *, auto_default: bool | None = None) -> "Section":
        """A nested JSON object (an empty one when absent)."""
        auto = self.auto_default if auto_default is None else auto_default
        return Section(self.data.get(key), (*self.keys, key), auto_default=auto)

    def one_of(self, *spellings: str) -> str:
        """The spelling of a key with aliases that the section uses (the first when none is present)."""
        present = [s for s in spellings if s in self.data]
        if len(present) > 1:
            raise ConfigError(f"{self.path} sets both {present[0]!r} and its alias {present[1]!r}: keep one")
        return present[0] if present else spellings[0]

    def _check_range(self, key: str, value: Any, lo: Any, hi: Any) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if hi is None:
                bounds = f"a value >= {lo}"
            elif lo is None:
                bounds = f"a value <= {hi}"
            else:
                bounds = f"a value in [{lo}, {hi}]"
            raise ConfigError(f"{self.where(key)} = {value!r}: expected {bounds}")


def _near_miss(key: str, candidates: list[str]) -> str | None:
    """The real key `key` is a typo of: close as a whole, or (8 characters or more) close to the
    start of a longer key, as a shortened misspelling is ("trian_micro_batch")."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
    if close or len(key) < 8:
        return close[0] if close else None
    starts = {c[:len(key) + 2]: c for c in candidates if len(c) > len(key) + 2}
    close = difflib.get_close_matches(key, list(starts), n=1, cutoff=0.85)
    return starts[close[0]] if close else None
