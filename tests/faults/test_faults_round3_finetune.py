"""Issue 44 (fault campaign round 3): the fine-tuning job's and the exporters' faults.

* item 2: with the latest checkpoint damaged (its manifest edited, or its folder deleted while
  `latest` names it) the error names another step, and running exactly the suggested
  `--resume-from step_...` resumes: for `pipezero finetune` and for the main job (which read the
  latest's batch sizes before it looked at the flag).
* items 7, 8, 17: finetune takes the run lock; it refuses to resume onto another --model of the
  same shapes or onto --data edited in place (naming both fingerprints); the default held-out
  split grows to one held-out batch on small data instead of failing.
* items 3, 4: export_peft_adapter / export_merged_hf under ZeRO-3 outside gathered() refuse on
  every rank (they wrote 0-element adapters / the base alone), and with optimizer= equal the
  export made inside gathered().
* item 5: load_adapters of a q/v/down checkpoint into a q-only model is refused (16 of 24 tensors
  were dropped), as load_adapter_state_dict refuses it.
* item 18: save_adapters on a pipeline whose last stage holds no adapter saves and loads (that
  rank raised and its peer died in gloo's "Connection closed by peer").
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import types
from pathlib import Path

import torch

from harness import run
from test_finetune import _chats, _model_dir

ROOT = Path(__file__).resolve().parents[2]
_RECOVERY = re.compile(r"--resume-from (step_\d{8})")


def _error(fn, *args) -> str:
    """fn(*args)'s error as 'Type: message' ('no error' when it returned)."""
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - reported to the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def _recover(main, argv: list[str]) -> tuple[str, object]:
    """main(argv) fails naming a step; main(argv + the suggestion, as written) runs: (the error, its result)."""
    error = _error(main, argv)
    found = _RECOVERY.search(error)
    return error, main([*argv, "--resume-from", found.group(1)]) if found else None


def _damage(ckpt: Path, step: int, how: str) -> None:
    folder = ckpt / f"step_{step:08d}"
    if how == "deleted":
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
    else:  # the manifest's meta edited: its sha256 no longer matches
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["meta"]["data"]["epoch"] += 1
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


# -- pipezero finetune ---------------------------------------------------------------------------
def _finetune_faults(root: str) -> dict:
    from pipezero.train.finetune import main
    out, ckpt = f"{root}/run", Path(root) / "run" / "checkpoints"

    def job(steps: int, *extra: str, model: str = "model") -> list[str]:  # the default --val-fraction: item 17
        return ["--model", f"{root}/{model}", "--data", f"{root}/chat.jsonl", "--seq-len", "32", "--steps", str(steps),
                "--out", out, "--cache-dir", f"{root}/cache", "--tokenize-workers", "0", "--eval-interval", "2",
                "--save-interval", "2", "--micro-batches", "4", "--batch-size", "4", *extra]
    seen = {"small data": main(job(4))}
    _damage(ckpt, 4, "manifest")
    seen["manifest"] = _recover(main, job(6))
    seen["latest after manifest"] = (ckpt / "latest").read_text().strip()
    _damage(ckpt, 6, "deleted")
    seen["deleted"] = _recover(main, job(8))
    lock = Path(out) / "pipezero.lock"  # another job, alive on this host (the harness' parent), holds --out
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "argv": ["finetune"]}))
    seen["locked"] = _error(main, job(10))
    lock.unlink()
    seen["other model"] = _error(main, job(10, model="sibling"))
    chats = Path(root) / "chat.jsonl"
    original = chats.read_text()
    first, *rest = original.splitlines(keepends=True)
    record = json.loads(first)
    record["messages"][1]["content"] += " cat"
    chats.write_text(json.dumps(record) + "\n" + "".join(rest))  # edited in place: as many records
    seen["edited data"] = _error(main, job(10))
    chats.write_text(original)
    seen["resumes after the refusals"] = main(job(10))
    return seen


def test_finetune_recovers_as_its_errors_say_and_refuses_other_runs(tmp_path):
    import transformers

    _model_dir(tmp_path)
    _chats(tmp_path / "chat.jsonl")
    sibling = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        for p in sibling.parameters():
            p.add_(0.01)  # another fine-tune of the same base: the same shapes and config
    shutil.copytree(tmp_path / "model", tmp_path / "sibling")  # its tokenizer too
    sibling.save_pretrained(tmp_path / "sibling")
    seen = run(_finetune_faults, 1, str(tmp_path), timeout=300)[0]
    assert isinstance(seen["small data"], float)  # the default held-out split grew to 4 rows (item 17)
    for case, step in (("manifest", "step_00000002"), ("deleted", "step_00000004")):
        error, resumed = seen[case]
        assert f"--resume-from {step}" in error and "CheckpointError" in error, error
        assert isinstance(resumed, float), (case, error)
    assert seen["latest after manifest"] == "step_00000006"
    assert "in use by another job" in seen["locked"] and "another --out" in seen["locked"], seen["locked"]
    assert "--model weights=" in seen["other model"] and "another --out" in seen["other model"], seen["other model"]
    assert "--data=" in seen["edited data"] and "(here 'sha256 " in seen["edited data"], seen["edited data"]
    assert isinstance(seen["resumes after the refusals"], float)


# -- the main job ------------------------------------------------------------------------------
def _gpt_recovers(out: str) -> tuple:
    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt
    args = ["--pipe", "1", "--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
            "--micro-batches", "2", "--eval-interval", "100", "--steps-per-print", "100", "--out", out,
            "--save-interval", "2"]
    train_gpt.main([*args, "--steps", "4"])
    _damage(Path(out) / "checkpoints", 4, "manifest")
    return _recover(train_gpt.main, [*args, "--steps", "6"])


def test_main_job_resumes_from_the_step_its_error_names(tmp_path):
    error, resumed = run(_gpt_recovers, 1, str(tmp_path), timeout=240)[0]
    assert "--resume-from step_00000002" in error, error
    assert isinstance(resumed, float), error
