"""Run a function on N gloo/CPU processes; the one spawn helper every distributed test uses.

Starting N fresh Python processes (each importing torch) costs seconds on 2 cores, so the
workers of each world size are started once and reused across tests: each holds an
initialised gloo process group and runs the functions it is sent.  A test that fails on a
rank re-raises here with that rank and its traceback; a test that times out, or whose ranks
do not all answer, kills its pool (no process left behind) and the next test starts afresh.

Workers are forked from multiprocessing's fork server, which imports torch's heavy modules
(and transformers') once per session, _PRELOAD: a fresh worker then costs a fork and ~0.1 s of
pipezero imports, not the ~4.5 s of CPU that a spawned interpreter spends importing torch (36
workers for world sizes 1..8, and every pool that a timeout or discard=True replaces).  The
server only imports: it runs no torch op, starts no thread and never asks for CUDA, so the
forks inherit a clean process; pipezero and the test modules are imported by each worker.
Workers see the environment of the server's start (start_server: conftest calls it before
collection), with OMP/MKL at 1 thread.
Each worker freezes what it inherited (gc.freeze): the ~300k objects of those imports would
otherwise make every gc.collect() and gc.get_objects() of a memory test cost ~0.5 s.

    results = run(fn, world_size, *args, timeout=120)   # fn(*args) on every rank
"""

from __future__ import annotations

import atexit
import datetime
import gc
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
import traceback
from multiprocessing import forkserver

_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.pipelining",
            "transformers", "transformers.modeling_utils"]  # the last two: the Hugging Face tests
_CTX.set_forkserver_preload(_PRELOAD)
_POOLS: dict[int, "_Pool"] = {}
_GRACE_S = 3.0  # after one rank fails, how long the others get to answer


class RankError(RuntimeError):
    """A function raised on one or more ranks."""


def run(fn, world_size: int, *args, timeout: float = 120.0, discard: bool = False, **kwargs) -> list:
    """Call fn(*args, **kwargs) on every rank of a gloo world; return the per-rank results.

    discard=True stops the workers afterwards: for tests that leave the process group
    unusable on purpose (a gloo receive that timed out closes its connection).
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size={world_size}: the harness runs 1..8 processes")
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.call(fn, args, kwargs, timeout)
    except (TimeoutError, _Broken):
        discard = True
        raise
    finally:
        if discard:
            pool.kill()
            _POOLS.pop(world_size, None)


def start_server() -> None:
    """Start the fork server now (a no-op while it runs), with OMP/MKL at one thread per worker.

    conftest.py calls it before collection, so that its imports run beside pytest's own.
    """
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shutdown() -> None:
    """Stop every worker pool."""
    for pool in list(_POOLS.values()):
        pool.kill()
    _POOLS.clear()


atexit.register(shutdown)


class _Broken(RankError):
    """Some ranks failed and the others never answered: the pool is unusable."""


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.results = _CTX.Queue()
        self.tasks = [_CTX.Queue() for _ in range(world_size)]
        port = _free_port()
        start_server()  # the workers' environment is the server's
        self.procs = [
            _CTX.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results,
                                               list(sys.path)), daemon=True)
            for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def call(self, fn, args, kwargs, timeout: float) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        answers: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            failed = any(not ok for ok, _ in answers.values())
            wait = min(deadline, self._first_failure + _GRACE_S) if failed else deadline
            try:
                rank, ok, value = self.results.get(timeout=min(1.0, max(0.0, wait - time.monotonic())))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(answers))
                dead = [r for r in missing if not self.procs[r].is_alive()]
                if dead:
                    codes = [self.procs[r].exitcode for r in dead]
                    raise _Broken(self._report(answers, f"ranks {dead} died (exit codes {codes})"))
                if time.monotonic() < wait:
                    continue
                if failed:
                    raise _Broken(self._report(answers, f"ranks {missing} never answered"))
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {self.world_size} ranks: "
                                   f"ranks {missing} did not finish within {timeout:.0f}s")
            if not ok and not any(not o for o, _ in answers.values()):
                self._first_failure = time.monotonic()
            answers[rank] = (ok, value)
        if any(not ok for ok, _ in answers.values()):
            raise RankError(self._report(answers, ""))
        return [answers[r][1] for r in range(self.world_size)]

    _first_failure = 0.0

    def _report(self, answers, extra: str) -> str:
        lines = [f"failed on {self.world_size} ranks" + (f"; {extra}" if extra else "")]
        for rank in sorted(answers):
            ok, value = answers[rank]
            if not ok:
                lines.append(f"--- rank {rank} ---\n{value}")
        return "\n".join(lines)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for q in [self.results, *self.tasks]:
            q.cancel_join_thread()
            q.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_parent() -> None:
    """Exit once the test process is gone (its pipe to this worker closes).

    Not os.getppid(): a worker's parent is the fork server, which outlives the test process
    for as long as any of its forks lives.
    """
    _CTX.parent_process().join()
    os._exit(1)


def _worker(rank, world_size, port, tasks, results, path):
    sys.path[:] = path
    threading.Thread(target=_watch_parent, daemon=True).start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    gc.freeze()  # the server's imports live for good: collections (and gc.get_objects) skip them
    while True:
        fn, args, kwargs = tasks.get()
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
        _drop_task_groups(dist)


def _drop_task_groups(dist) -> None:
    """Destroy the process groups the task made, keeping the worker's default group.

    Every Grid, mesh and tie makes subgroups; kept for the worker's life, a 4-rank worker held
    ~900 gloo threads after a suite, and their polling cost a fifth of a core per worker. The
    ranks first meet on the default group, so no peer is still using a subgroup; a task that
    broke the default group (its pool is discarded) skips the cleanup.
    """
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    made = [pg for pg in list(c10d._world.pg_map) if pg is not world]
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a broken default group: the parent discards this pool
        return
    for pg in made:
        dist.destroy_process_group(pg)
    _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions. They are keyed by mesh equality, which compares the
    ranks and dim names but not the process groups: a later task's equal mesh would get an output spec
    holding an earlier task's mesh, whose groups _drop_task_groups destroyed ("Could not resolve the
    process group registered under the name ...")."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    _redistribute._gen_transform_infos.cache_clear()
