"""The old module paths of files moved into subsystem folders are retired (pre-1.0; README's changelog).

`moved.py`'s finder imported them with a DeprecationWarning from every `import pipezero`; it is gone:
`import pipezero` installs no import hook, each old path fails as any missing module does, and
nothing in the repository uses one. The four old modules that became the folder of their name
(pipezero.train.plan, ...) are those packages: they keep the old module's public names.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_ALLOWED = {"tests/test_moved.py"}  # this test names the old paths on purpose
_TEXT = (".py", ".md", ".toml", ".sh", ".cfg", ".txt", ".json")

RETIRED: dict[str, str] = {  # old path -> the module to import instead
    **{f"pipezero.pipe.{m}": f"pipezero.pipe.schedule.{m}" for m in
       ("actions", "placement", "schedules", "registry", "validate", "simulate", "render", "timeline")},
    **{f"pipezero.pipe.hf_{m}": f"pipezero.pipe.hf.{m}" for m in ("generate", "match", "tensor", "weights")},
    **{f"pipezero.train.config_{m}": f"pipezero.train.config.{m}" for m in ("auto", "batch", "compile", "keys", "optim")},
    **{f"pipezero.train.plan_{m}": f"pipezero.train.plan.{m}" for m in ("cli", "hardware", "layout", "memory", "model")},
    "pipezero.train.plan_time": "pipezero.train.plan.step_time",
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


def test_import_pipezero_installs_no_import_hook_and_the_old_paths_are_gone():
    code = ("import sys; before = list(sys.meta_path); import pipezero; "
            "print(len(sys.meta_path) - len(before)); print(*sorted(sys.modules), sep=',')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    added, modules = done.stdout.split("\n")[:2]
    assert added == "0", done.stdout  # moved.py's finder was appended to sys.meta_path
    assert not [m for m in modules.split(",") if m.startswith("pipezero.")], modules
    for old in sorted(RETIRED):
        assert old not in sys.modules or sys.modules[old].__name__ != RETIRED[old], old
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


@pytest.mark.parametrize("package", sorted(BECAME_PACKAGES))
def test_an_old_module_that_became_its_folder_keeps_its_public_names(package):
    """pipezero.train.checkpoint was a module and is the folder now: the package re-exports what the module did."""
    pkg, module = importlib.import_module(package), importlib.import_module(BECAME_PACKAGES[package])
    missing = [n for n in module.__all__ if getattr(pkg, n, None) is not getattr(module, n)]
    assert module.__all__ and not missing, missing


def _exported(package: str) -> set[str]:
    return set(importlib.import_module(package).__all__)


def old_paths_in(path: str, text: str) -> list[str]:
    """Each use of an old module path in one file: the dotted name anywhere, or a `from pipezero.pipe import
    schedules` of a moved module (a name the package itself does not export)."""
    dotted = re.compile(r"\b(" + "|".join(re.escape(o) for o in sorted(RETIRED, key=len, reverse=True)) + r")(?!\w)")
    found = [f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}" for m in dotted.finditer(text)]
    if path.endswith(".py"):
        exported = {p: _exported(p) for p in {o.rsplit(".", 1)[0] for o in RETIRED}}
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.ImportFrom) and node.module in exported:
                found += [f"{path}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in RETIRED and a.name not in exported[node.module]]
    return found


def test_the_old_path_check_finds_each_kind_of_use():
    old = sorted(RETIRED)[0]
    parent, leaf = old.rsplit(".", 1)
    sample = f"import {old} as m\nfrom {parent} import (\n    {leaf},\n)\npatch('{old}.x')\n"
    found = old_paths_in("x.py", sample)
    assert [f.split(": ", 1)[0] for f in found] == ["x.py:1", "x.py:5", "x.py:2"], found


def test_nothing_in_the_repository_uses_an_old_path():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout: every file under the root but the virtual environment
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".venv" not in p.parts]
    files = [f for f in files if (f.endswith(_TEXT) or f == ".ci/run") and f not in _ALLOWED and (ROOT / f).is_file()]
    assert len(files) > 50, files
    found = [use for f in files for use in old_paths_in(f, (ROOT / f).read_text())]
    assert not found, "use the new module paths (tests/test_moved.py's RETIRED):\n" + "\n".join(found)
