"""Round 3 of the fault campaign, the data's share (issue 44): a build of the tokenized corpus killed
while tokenizing leaves no tokenizer worker behind, and no temporary folder for good.

Before: SIGKILL or SIGTERM of the builder left its forked tokenizer workers running (orphans) and its
`<key>.tmp-<pid>` folder on disk for ever. Now the workers die with their parent (the parent-death
signal), SIGTERM removes the folder on the way out, and the next build removes the folder of a
SIGKILLed one (its process is gone). The bad inputs of the same round are in tests/faults/data_cases.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from data_tokenizer import make_tokenizer
from pipezero.train.data import tokenized_corpus

# the builder: tokenizing made slow (the workers are forked after the patch), so it can be killed mid-way
_BUILDER = """
import sys, time
import pipezero.train.data.tokenize as tokenize
encode = tokenize.encode
tokenize.encode = lambda tok, doc: (time.sleep(0.01), encode(tok, doc))[1]
from pipezero.train.data import tokenized_corpus
tokenized_corpus(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3], workers=2)
"""


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if stat[0] == "Z" else int(stat[1])  # a zombie counts as gone


def _workers(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == pid]


def _ready(builder: subprocess.Popen, cache: Path) -> list[int]:
    """Wait until the builder has written its temporary folder and both workers are up: their pids."""
    deadline, workers = time.monotonic() + 120, []
    while not (list(cache.glob("*.tmp-*")) and len(workers) == 2):
        assert builder.poll() is None and time.monotonic() < deadline, "the build ended before it was killed"
        time.sleep(0.1)
        workers = _workers(builder.pid)
    return workers


def test_a_killed_build_leaves_no_worker_and_no_temporary_folder(tmp_path):
    """Two builds at once (their start, the imports, is what costs): one gets SIGKILL, one SIGTERM."""
    if not sys.platform.startswith("linux"):
        import pytest
        pytest.skip("the parent-death signal and /proc are Linux's")
    tok = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"the cat sat on the mat {i % 7}"}) + "\n" for i in range(2000)))
    hows = (signal.SIGKILL, signal.SIGTERM)
    caches = {how: tmp_path / f"cache-{how.name}" for how in hows}
    builders = {how: subprocess.Popen([sys.executable, "-c", _BUILDER, str(data), str(tok), str(caches[how])])
                for how in hows}
    try:
        workers = {how: _ready(builders[how], caches[how]) for how in hows}
        for how in hows:
            builders[how].send_signal(how)
        codes = {how: builders[how].wait(60) for how in hows}
    finally:
        for builder in builders.values():
            builder.kill()
    assert codes == {signal.SIGKILL: -signal.SIGKILL, signal.SIGTERM: 128 + signal.SIGTERM}, codes
    deadline = time.monotonic() + 10
    pids = [w for ws in workers.values() for w in ws]
    while any(_parent(w) is not None for w in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_parent(w) is None for w in pids), f"tokenizer workers {workers} outlived their killed builds"
    term, kill = caches[signal.SIGTERM], caches[signal.SIGKILL]
    assert not list(term.glob("*.tmp-*")) and not list(term.glob("*.lock")), list(term.iterdir())  # on the way out
    assert len(list(kill.glob("*.tmp-*"))) == 1  # SIGKILL runs nothing: the next build removes it
    assert tokenized_corpus(data, tok, cache_dir=kill).num_docs == 2000
    assert not list(kill.glob("*.tmp-*")), list(kill.iterdir())
