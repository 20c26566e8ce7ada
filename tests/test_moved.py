"""Old module paths of moved files: each still imports, warns with its new path and IS the new module;
nothing in the repository uses one (so the table in moved.py is the only place they are written)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipezero.moved import BECAME_PACKAGES, MOVED

ROOT = Path(__file__).resolve().parents[1]
_ALLOWED = {"moved.py", "tests/test_moved.py"}  # the table and this test name old paths on purpose
_TEXT = (".py", ".md", ".toml", ".sh", ".cfg", ".txt", ".json")


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_warns_and_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to {re.escape(MOVED[old])}"):
        module = importlib.import_module(old)
    assert module is new and sys.modules[old] is new and module.__name__ == MOVED[old]
    parent, leaf = old.rsplit(".", 1)
    if leaf in _exported(parent):  # pipezero.pipe.simulate: the package's function, as before the move
        assert not isinstance(getattr(importlib.import_module(parent), leaf), type(sys)), leaf


def test_a_from_import_of_an_old_module_works_and_an_unknown_name_still_fails():
    old = next(o for o in sorted(MOVED) if o.rsplit(".", 1)[1] not in _exported(o.rsplit(".", 1)[0]))
    parent, leaf = old.rsplit(".", 1)
    sys.modules.pop(old, None)
    vars(importlib.import_module(parent)).pop(leaf, None)  # as if never imported under its old name
    names: dict = {}
    with pytest.warns(DeprecationWarning, match=re.escape(MOVED[old])):
        exec(f"from {parent} import {leaf} as got", names)
    assert names["got"] is importlib.import_module(MOVED[old])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{parent}.no_such_module")


def _exported(package: str) -> set[str]:
    return set(importlib.import_module(package).__all__)


@pytest.mark.parametrize("package", sorted(BECAME_PACKAGES))
def test_an_old_module_that_became_its_folder_keeps_its_public_names(package):
    """pipezero.train.checkpoint was a module and is the folder now: the package re-exports what the module did."""
    pkg, module = importlib.import_module(package), importlib.import_module(BECAME_PACKAGES[package])
    missing = [n for n in module.__all__ if getattr(pkg, n, None) is not getattr(module, n)]
    assert module.__all__ and not missing, missing


def old_paths_in(path: str, text: str) -> list[str]:
    """Each use of an old module path in one file: the dotted name anywhere, or a `from pipezero.pipe import
    schedules` of a moved module (a name the package itself does not export)."""
    dotted = re.compile(r"\b(" + "|".join(re.escape(o) for o in sorted(MOVED, key=len, reverse=True)) + r")(?!\w)")
    found = [f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}" for m in dotted.finditer(text)]
    if path.endswith(".py"):
        exported = {p: _exported(p) for p in {o.rsplit(".", 1)[0] for o in MOVED}}
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, ast.ImportFrom) and node.module in exported:
                found += [f"{path}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in MOVED and a.name not in exported[node.module]]
    return found


def test_the_old_path_check_finds_each_kind_of_use():
    old = sorted(MOVED)[0]
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
    assert not found, "use the new module paths (moved.py's MOVED):\n" + "\n".join(found)
