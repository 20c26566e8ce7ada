"""The fault campaign's catalogue, kept fixed: every bad input ends in a clear error, on every rank.

Pure cases (tests/faults/catalogue.py) run here; ranked ones (tests/faults/ranked.py) run on a
gloo world of 2 through tests/harness.py, all but the few that break their pipe group in one
call. Each error must be a ValueError/TypeError/OSError (or argparse's exit with its message)
containing the case's words; a hang fails through the harness timeout.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import catalogue  # noqa: E402
import data_cases  # noqa: E402
import ranked  # noqa: E402
from harness import run  # noqa: E402

_CLEAR = (ValueError, TypeError, OSError)


@pytest.mark.parametrize("case", catalogue.PURE + data_cases.CASES, ids=lambda c: f"{c.area}-{c.name.replace(' ', '_')}")
def test_pure_bad_input_is_refused_clearly(case, tmp_path, capsys):
    with pytest.raises((*_CLEAR, SystemExit)) as err:
        case.run(tmp_path) if inspect.signature(case.run).parameters else case.run()
    if err.type is SystemExit:  # argparse printed its usage error; SystemExit("...") carries its line
        code = err.value.code
        assert code not in (0, None), f"exit {code}: not an error"
        text = code if isinstance(code, str) else capsys.readouterr().err
    else:
        text = str(err.value)
    for word in case.words:
        assert word in text, f"{word!r} not in: {text}"


def _every_case(names: list[str]) -> dict[str, str]:
    """On one rank: each case's error as 'Type: message' ('' when it did not raise)."""
    out = {}
    for name in names:
        try:
            (ranked.CASES.get(name) or ranked.SOLO[name])()
            out[name] = ""
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def ranked_errors():
    return run(_every_case, 2, sorted(ranked.CASES), timeout=300)


@pytest.mark.parametrize("name", sorted(ranked.CASES))
def test_ranked_bad_input_is_refused_on_every_rank(name, ranked_errors):
    _check(name, ranked_errors)


@pytest.fixture(scope="module")
def stage_failures():
    """On pipe 2 x data 2 (the pipe groups are not the world group, which stays usable after a
    pipe group's timeout) in one call; the last case ends one worker, so the pool goes."""
    return run(_every_case, 4, list(ranked.SOLO), timeout=300, discard=True)


@pytest.mark.parametrize("name", list(ranked.SOLO))
def test_stage_failure_or_dead_peer_reaches_every_rank_within_seconds(name, stage_failures):
    """One stage fails (its error names layer and input) or a rank exits: every other rank raises
    within seconds (its 3 s pipeline timeout, or at once for a closed connection)."""
    _check(name, stage_failures)
    assert any(all(w in errors[name] for w in ranked.WORDS[name]) for errors in stage_failures)


def _check(name: str, per_rank: list[dict[str, str]]) -> None:
    """Every rank raised a known error; the case's words are in every rank's own error, or (for a
    failure inside one stage) in that rank's, while the others learned of it within seconds."""
    texts = [errors[name] for errors in per_rank]
    kinds = {c.__name__ for c in _CLEAR} | {"CheckpointError", "ScheduleError", "ConfigError", "LayerError",
                                            "PipelineTimeout", "PeerLost", "ConnectionError"}
    for rank, text in enumerate(texts):
        assert text and text.split(":")[0] in kinds, f"rank {rank}: {text or 'no error'}"
        if text.startswith(("PipelineTimeout", "PeerLost")):
            seconds = float(text.split("[")[1].split("s]")[0])
            assert seconds < 20, f"rank {rank} learned of the failure after {seconds}s: {text}"
        elif not text.startswith("ConnectionError"):
            for word in ranked.WORDS[name]:
                assert word in text, f"rank {rank}: {word!r} not in: {text}"


def test_simulate_shows_zero_cost_actions_and_plan_names_the_config_it_wrote(tmp_path, capsys, monkeypatch):
    """Issue 28 items 14 and 19: zero backward costs (accepted) render instead of a KeyError; the
    torchrun line of a plan without --write-config says the config is not written yet."""
    from pipezero.train.cli import main
    assert main(["simulate", "--stages", "2", "--microbatches", "3", "--backward-input", "0",
                 "--backward-weight", "0", "--png", str(tmp_path / "s.png")]) == 0
    text = capsys.readouterr().out
    assert all(f"0B{m}" in text for m in range(3)) and "makespan 4" in text, text
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--hardware", "h200", "--layers", "2", "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "plan_ds_config.json").exists()
    assert "--write-config plan_ds_config.json" in text.split("torchrun")[0], text


def test_a_dead_jobs_run_lock_is_taken_over(tmp_path):
    """Issue 28 item 10: a lock whose job died on this host (its pid gone) does not block the rerun."""
    import json
    import os
    import socket
    import subprocess

    from pipezero.train.run_dir import LOCK_NAME, claim_run_dir
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    with claim_run_dir(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_whose_pid_was_reused_names_the_file_to_delete(tmp_path):
    """A dead job's lock whose pid now belongs to a live process (pids restart in containers) is refused
    with the lock file to delete, as a lock of another host is (the message said only 'wait for it')."""
    import json
    import os
    import socket

    from pipezero.train.run_dir import LOCK_NAME, claim_run_dir
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "argv": ["train_gpt.py"]}))
    with pytest.raises(ValueError, match=f"delete {lock}"):
        with claim_run_dir(tmp_path):
            pass
