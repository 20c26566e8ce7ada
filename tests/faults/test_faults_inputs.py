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
    text = capsys.readouterr().err if err.type is SystemExit else str(err.value)
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
