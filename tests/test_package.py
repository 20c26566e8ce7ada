"""The package stands on its own: the house rules a static check keeps, and the built wheel runs its commands.

House rules (ARCHITECTURE.md), checked on the source of every package module:
* no `sys.path` edits and no imports of examples/, bench/ or tests/ (nor of their bare modules,
  `gpt`, `generate`, `train_gpt`): what a command needs lives in the package;
* no private attribute of another package: `obj._name` where `_name` is defined only in other
  packages, and no `from pipezero.<other> ... import _name`;
* no `getattr` / `hasattr` probe, by a literal name, of an attribute defined only in other
  packages (torch's own Optimizer / Module attributes aside): a contract is a typed protocol.
The wheel test builds the wheel as CI does (from a copy of the checkout), unpacks it elsewhere and runs
`pipezero plan --help` and `pipezero train --steps 2` (no config) for a tiny GPT on two CPU processes.
"""

from __future__ import annotations

import ast
import collections
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("topology", "comm", "precision", "zero", "pipe", "train")
_OUTSIDE = {"examples", "bench", "tests", "gpt", "generate", "train_gpt"}
_TORCH_NAMES = set(dir(torch.optim.Optimizer)) | set(dir(torch.nn.Module)) | {"state", "param_groups", "defaults"}


def package_sources() -> dict[str, str]:
    """Relative path -> source of every module of the package (root modules and the six packages)."""
    files = list(ROOT.glob("*.py")) + [p for d in PACKAGES for p in (ROOT / d).rglob("*.py")]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def _package(path: str) -> str:
    parts = Path(path).parts
    return parts[0] if len(parts) > 1 else "<root>"


def _defined(trees: dict[str, ast.AST]) -> dict[str, set[str]]:
    """Name -> the packages that define it (a def, a class, or an assignment to it)."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[n.name].add(_package(path))
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out[n.attr].add(_package(path))
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out[n.id].add(_package(path))
    return out


def house_violations(sources: dict[str, str]) -> list[str]:
    """Every break of the house rules in `sources` (relative path -> module source), one line each."""
    trees = {path: ast.parse(src, path) for path, src in sources.items()}
    defined = _defined(trees)
    found = []
    for path, tree in trees.items():
        pkg = _package(path)
        for n in ast.walk(tree):
            where = f"{path}:{getattr(n, 'lineno', '?')}"
            if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name) \
                    and n.value.id == "sys":
                found.append(f"{where}: sys.path in the package")
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                found += [f"{where}: imports {m} (outside the package)" for m in names if m.split(".")[0] in _OUTSIDE]
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pipezero."):
                    other = n.module.split(".")[1]
                    found += [f"{where}: imports {n.module}.{a.name}, private to {other}/" for a in n.names
                              if a.name.startswith("_") and not a.name.startswith("__") and other != pkg]
            elif isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                owners = defined.get(n.attr, set())
                if owners and pkg not in owners:
                    found.append(f"{where}: {ast.unparse(n)} reads a private attribute of {sorted(owners)}")
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                    and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
                name = n.args[1].value
                owners = defined.get(name, set()) - {"<root>"}
                if owners and pkg not in owners and name not in _TORCH_NAMES:
                    found.append(f"{where}: {ast.unparse(n)} probes an attribute of {sorted(owners)}")
    return found


def test_the_package_keeps_the_house_rules():
    assert house_violations(package_sources()) == []


def test_the_house_check_finds_each_kind_of_break():
    sources = {
        "zero/sync.py": "class S:\n    def __init__(self):\n        self._held = set()\n    def hold(self): ...\n",
        "pipe/run.py": ("import sys\nsys.path.insert(0, 'examples')\nimport gpt\n"
                        "from pipezero.zero.sync import _weak\n"
                        "def f(opt):\n    opt._held.clear()\n    return hasattr(opt, 'hold')\n"),
    }
    found = "\n".join(house_violations(sources))
    for what in ("pipe/run.py:2: sys.path", "imports gpt", "private to zero/", "opt._held", "hasattr(opt, 'hold')"):
        assert what in found, (what, found)


def test_the_architecture_note_names_every_folder_and_event():
    """ARCHITECTURE.md stays true: each package folder and root module, each event of the step protocol."""
    from pipezero.pipe.readiness import StepListener

    note = (ROOT / "ARCHITECTURE.md").read_text()
    folders = [f"`{d}/`" for d in PACKAGES] + [f"`{p.name}`" for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    folders += [f"`{p.parent.parent.name}/{p.parent.name}/`" for d in PACKAGES for p in ROOT.glob(f"{d}/*/__init__.py")]
    events = [name for name in vars(StepListener) if not name.startswith("_")]
    missing = [f for f in folders if f not in note] + [e for e in events if f"{e}(" not in note]
    assert len(events) >= 8 and not missing, missing


def test_the_wheel_lists_every_subpackage():
    """pyproject.toml's package list names every folder with an __init__.py: one left out is not in the wheel."""
    listed = (ROOT / "pyproject.toml").read_text()
    folders = ["pipezero." + ".".join(p.parent.relative_to(ROOT).parts) for d in PACKAGES
               for p in (ROOT / d).rglob("__init__.py")]
    missing = [f for f in folders if f'"{f}"' not in listed]
    assert len(folders) > len(PACKAGES) and not missing, missing


@pytest.mark.timeout(900)  # a wheel build and a 2-process job: minutes on a loaded 2-core machine
def test_the_wheel_runs_its_commands(tmp_path):
    """Built as CI builds it, unpacked outside the checkout: `pipezero plan --help`, `pipezero train --steps 2`."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"  # a copy: no stale build/ of the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "runs",
                                                                 "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("pipezero-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        entry = next(n for n in z.namelist() if n.endswith("entry_points.txt"))
        assert "pipezero = pipezero.train.cli:main" in z.read(entry).decode()
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "pipezero.train.cli"]
    where = subprocess.run([sys.executable, "-c", "import pipezero; print(pipezero.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site)), where.stdout
    plan = subprocess.run([*cli, "plan", "--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "--global-batch" in plan.stdout, plan.stderr[-2000:]
    tiny = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
            "--micro-batches", "2", "--steps-per-print", "1", "--eval-interval", "2"]
    # no config: the wheel ships none (the job's defaults: 2 pipeline stages, 2 processes); `train --steps 2`
    # read "2" as a config path before CONFIG became optional
    train = subprocess.run([*cli, "train", "--steps", "2", "--out", str(tmp_path / "out"), *tiny],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert train.returncode == 0, train.stderr[-4000:]
    assert "step 2/2" in train.stdout + train.stderr and (tmp_path / "out" / "model.safetensors").is_file()
    # the sampling command the job's last log line names runs from the wheel too (no examples/ here)
    (hint,) = re.findall(r"sample from it: python (.+?)\)", train.stdout + train.stderr)
    sample = subprocess.run([sys.executable, *hint.split(), "--tokens", "4"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert sample.returncode == 0 and sample.stdout.startswith("def "), (hint, sample.stderr[-2000:])


def test_every_module_imports():
    """Each module of the package imports on CPU: a name one branch renamed and another still imports
    (state's agree_on_load, imported as _agree_on_load by lora_state after a merge) fails here, not first
    in a user's `from pipezero.train.checkpoint.lora_state import save_adapters`."""
    import importlib
    import pkgutil

    import pipezero

    failed = {}
    for info in pkgutil.walk_packages(pipezero.__path__, "pipezero."):
        if info.name.split(".")[1] in ("tests", "examples", "bench"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as err:  # noqa: BLE001 - every failing module named at once
            failed[info.name] = f"{type(err).__name__}: {err}"
    assert not failed, failed
