"""The fault catalogue's bad command lines of the `pipezero` command: simulate and plan.

Each case runs `pipezero.train.cli.main(argv)` and must end in the command's one-line error
(argparse's usage error, or `pipezero <command>: ...`) before anything is simulated, measured
or written: never a traceback, never a silent default.
"""

from __future__ import annotations

from pathlib import Path

from catalogue import Case


def _pz(*argv: str):
    def run(tmp: Path):
        from pipezero.train.cli import main
        return main([a.replace("{tmp}", str(tmp)) for a in argv])
    return run


def _sim(name: str, argv: tuple[str, ...], words: tuple[str, ...]) -> Case:
    return Case("simulate", name, _pz("simulate", *argv, *(() if "--png" in argv else ("--png", "{tmp}/s.png"))),
                words)


def _plan(name: str, argv: tuple[str, ...], words: tuple[str, ...]) -> Case:
    return Case("plan", name, _pz("plan", *argv), words)


SIMULATE = [
    _sim("stages zero", ("--stages", "0"), ("--stages", "0 is not a positive integer")),
    _sim("stages negative", ("--stages", "-2"), ("--stages", "-2")),
    _sim("stages a word", ("--stages", "two"), ("--stages", "'two'")),
    _sim("microbatches zero", ("--microbatches", "0"), ("--microbatches", "positive")),
    _sim("microbatches negative", ("--microbatches", "-1"), ("--microbatches", "-1")),
    _sim("microbatches fractional", ("--microbatches", "2.5"), ("--microbatches", "'2.5'")),
    _sim("chunks zero", ("--chunks", "0"), ("--chunks", "positive")),
    _sim("forward negative", ("--forward", "-1"), ("--forward", "-1", ">= 0")),
    _sim("forward nan", ("--forward", "nan"), ("--forward", "finite")),
    _sim("forward inf", ("--forward", "inf"), ("--forward", "finite")),
    _sim("backward input negative", ("--backward-input", "-0.5"), ("--backward-input", "-0.5")),
    _sim("backward weight a word", ("--backward-weight", "slow"), ("--backward-weight", "'slow'")),
    _sim("unknown schedule", ("--schedule", "2f2b"), ("--schedule", "2f2b")),
    _sim("dualpipev m below 2p", ("--schedule", "dualpipev", "--stages", "4", "--microbatches", "4"),
         ("pipezero simulate", "num_microbatches >= 2 * num_stages = 8")),
    _sim("interleaved m not a multiple", ("--schedule", "interleaved_1f1b", "--stages", "3", "--microbatches", "4"),
         ("pipezero simulate", "multiple of num_stages")),
    _sim("interleaved one chunk", ("--schedule", "interleaved_1f1b", "--chunks", "1"),
         ("pipezero simulate", "chunks >= 2")),
    _sim("1f1b with chunks", ("--schedule", "1f1b", "--chunks", "3"), ("pipezero simulate", "chunks=3")),
    _sim("gpipe with chunks", ("--schedule", "gpipe", "--chunks", "2"), ("pipezero simulate", "chunks=2")),
    _sim("png in a missing folder", ("--png", "{tmp}/no/such/dir/x.png"),
         ("pipezero simulate", "--png", "no/such/dir/x.png")),
    _sim("png a folder", ("--png", "{tmp}"), ("pipezero simulate", "--png")),
    _sim("stages too many to simulate", ("--stages", "100000", "--microbatches", "1"),
         ("pipezero simulate", "--stages 100000", "at most 1024 stages")),
    _sim("microbatches too many to simulate", ("--stages", "64", "--microbatches", "100000"),
         ("pipezero simulate", "--microbatches 100000", "pass fewer")),
    _sim("unknown argument", ("--stage", "2", "--extra"), ("unknown arguments", "--extra")),
]


PLAN = [
    _plan("gpus per node zero", ("--gpus-per-node", "0"), ("--gpus-per-node", "0 is not a positive integer")),
    _plan("gpus per node zero on h200", ("--hardware", "h200", "--gpus-per-node", "0"), ("--gpus-per-node", "0")),
    _plan("gpus per node negative", ("--gpus-per-node", "-8"), ("--gpus-per-node", "-8")),
    _plan("nodes zero", ("--hardware", "h200", "--nodes", "0"), ("--nodes", "0")),
    _plan("nodes on local hardware", ("--nodes", "3"), ("--nodes 3", "--hardware h200")),
    _plan("efficiency above one", ("--hardware", "h200", "--efficiency", "7"), ("--efficiency", "(0, 1]")),
    _plan("efficiency zero", ("--hardware", "h200", "--efficiency", "0"), ("--efficiency", "0")),
    _plan("efficiency negative", ("--hardware", "h200", "--efficiency", "-0.1"), ("--efficiency", "-0.1")),
    _plan("efficiency nan", ("--hardware", "h200", "--efficiency", "nan"), ("--efficiency", "nan")),
    _plan("efficiency on local hardware", ("--efficiency", "0.5"), ("--efficiency 0.5", "--hardware h200")),
    _plan("inter-node bandwidth on local hardware", ("--inter-gbps", "100"), ("--inter-gbps 100", "--hardware h200")),
    _plan("memory zero", ("--hardware", "h200", "--memory-gb", "0"), ("--memory-gb", "> 0")),
    _plan("memory negative", ("--hardware", "h200", "--memory-gb", "-4"), ("--memory-gb", "-4")),
    _plan("intra bandwidth zero", ("--hardware", "h200", "--intra-gbps", "0"), ("--intra-gbps", "0")),
    _plan("inter bandwidth negative", ("--hardware", "h200", "--inter-gbps", "-5"), ("--inter-gbps", "-5")),
    _plan("top zero", ("--hardware", "h200", "--top", "0"), ("--top", "0")),
    _plan("layers zero", ("--hardware", "h200", "--layers", "0"), ("--layers", "0")),
    _plan("d-model zero", ("--hardware", "h200", "--d-model", "0"), ("--d-model", "0")),
    _plan("heads zero", ("--hardware", "h200", "--heads", "0"), ("--heads", "0")),
    _plan("heads do not divide d-model", ("--hardware", "h200", "--heads", "3"),
          ("pipezero plan", "d_model=128, heads=3", "multiple of heads")),
    _plan("seq-len negative", ("--hardware", "h200", "--seq-len", "-1"), ("--seq-len", "-1")),
    _plan("vocab zero", ("--hardware", "h200", "--vocab", "0"), ("--vocab", "0")),
    _plan("global batch zero", ("--hardware", "h200", "--global-batch", "0"), ("--global-batch", "0")),
    _plan("global batch a word", ("--hardware", "h200", "--global-batch", "lots"), ("--global-batch", "'lots'")),
    _plan("precision fp8", ("--precision", "fp8"), ("--precision", "fp8")),
    _plan("hardware tpu", ("--hardware", "tpu"), ("--hardware", "tpu")),
    _plan("memory too small for any layout", ("--hardware", "h200", "--memory-gb", "0.000001"),
          ("pipezero plan", "no layout", "1e-06 GB")),
    _plan("write-config into a missing folder", ("--hardware", "h200", "--write-config", "{tmp}/no/dir/ds.json"),
          ("--write-config", "no/dir", "does not exist")),
    _plan("write-config into a file's folder", ("--hardware", "h200", "--write-config", __file__ + "/ds.json"),
          ("--write-config", "does not exist")),
    _plan("unknown argument", ("--hardware", "h200", "--gpu-count", "8"), ("unknown arguments", "--gpu-count")),
]

ALL = SIMULATE + PLAN


def _locked(holder: dict | None, raw: bytes | None = None):
    """claim_run_dir on an --out whose lock another job holds (the holder's JSON, or raw bytes)."""
    def run(tmp: Path):
        import json
        import os
        import socket

        from pipezero.train.run_dir import LOCK_NAME, claim_run_dir
        fields = {"pid": os.getppid(), "host": socket.gethostname()}
        data = raw if raw is not None else json.dumps({**fields, **(holder or {})}).encode()
        (tmp / LOCK_NAME).write_bytes(data)
        with claim_run_dir(tmp):
            pass
    return run


def _out_is_a_file(tmp: Path):
    from pipezero.train.run_dir import claim_run_dir
    (tmp / "file").write_text("x")
    with claim_run_dir(tmp / "file" / "run"):
        pass


RUN_DIR = [
    Case("run-dir", "held by a live job on this host", _locked({"argv": ["train_gpt.py", "--steps", "9"]}),
         ("in use by another job", "pid ", "--steps 9", "another --out")),
    Case("run-dir", "held by a job on another host", _locked({"host": "node-17", "pid": 4242}),
         ("pid 4242 on host node-17", "delete", "pipezero.lock")),
    Case("run-dir", "lock file damaged", _locked(None, raw=b"\x00garbage"), ("in use by another job", "delete")),
    Case("run-dir", "--out inside a file", _out_is_a_file, ("cannot be created", "writable --out")),
]

ALL += RUN_DIR


def _idx(magic: int, dims: tuple[int, ...], fill: int = 0, cut: int = 0) -> bytes:
    import math
    head = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    body = bytes([fill]) * math.prod(dims)
    return (head + body)[:len(head) + len(body) - cut]


def _mnist(images: bytes | None, labels: bytes | None, gz: bool = False):
    """The seed example's --mnist folder holding these two files (None: absent)."""
    def run(tmp: Path):
        import gzip

        import seed_simple_model
        for name, data in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels)):
            if data is not None:
                (tmp / (name + ".gz" if gz else name)).write_bytes(gzip.compress(data)[:-9] if gz else data)
        return seed_simple_model.load_digits(str(tmp))
    return run


IMAGES, LABELS = _idx(0x803, (5, 28, 28)), _idx(0x801, (5,))
MNIST = [
    Case("mnist", "fewer labels than images", _mnist(IMAGES, _idx(0x801, (3,))),
         ("train-labels-idx1-ubyte holds 3 labels", "5 images")),
    Case("mnist", "more labels than images", _mnist(IMAGES, _idx(0x801, (60000,))), ("60000 labels", "5 images")),
    Case("mnist", "the two files swapped", _mnist(LABELS, IMAGES), ("train-images-idx3-ubyte", "magic 0x801")),
    Case("mnist", "images truncated", _mnist(_idx(0x803, (5, 28, 28), cut=100), LABELS),
         ("train-images-idx3-ubyte", "truncated")),
    Case("mnist", "labels truncated", _mnist(IMAGES, _idx(0x801, (5,), cut=2)),
         ("train-labels-idx1-ubyte", "11 bytes", "makes 13")),
    Case("mnist", "images of 8x8", _mnist(_idx(0x803, (5, 8, 8)), LABELS), ("8x8", "28x28")),
    Case("mnist", "a label past 9", _mnist(IMAGES, _idx(0x801, (5,), fill=12)), ("labels up to 12", "0..9")),
    Case("mnist", "images file empty", _mnist(b"", LABELS), ("train-images-idx3-ubyte", "magic None")),
    Case("mnist", "labels missing", _mnist(IMAGES, None), ("no train-labels-idx1-ubyte",)),
    Case("mnist", "gzip cut short", _mnist(IMAGES, LABELS, gz=True), ("train-images-idx3-ubyte.gz", "gzip")),
]

ALL += MNIST


def _costs(**kw):
    def make():
        from pipezero.pipe import Costs
        return Costs(**kw)
    return make


def _simulate(schedule: str, m: int, p: int, costs=None):
    def run():
        from pipezero import pipe
        sched = pipe.make_schedule(schedule, m, None)
        return pipe.simulate(sched, p) if costs is None else pipe.simulate(sched, p, costs=costs())
    return run


def _per_chunk(*keys, p2p=(0.0, 0.0)):
    def make():
        from pipezero.pipe import Costs
        return {key: Costs(p2p=p2p[i % 2]) for i, key in enumerate(keys)}
    return make


def _render(fn_name: str, arg):
    def run():
        from pipezero.pipe.schedule import render
        return getattr(render, fn_name)(arg() if callable(arg) else arg)
    return run


SIMULATOR = [
    Case("simulator", "forward cost negative", _costs(forward=-1), ("Costs.forward=-1", ">= 0")),
    Case("simulator", "backward cost nan", _costs(backward_input=float("nan")), ("Costs.backward_input=nan", "finite")),
    Case("simulator", "p2p a string", _costs(p2p="1"), ("Costs.p2p='1'", "number")),
    Case("simulator", "weight cost a bool", _costs(backward_weight=True), ("Costs.backward_weight=True",)),
    Case("simulator", "zero stages", _simulate("1f1b", 4, 0), ("num_stages",)),
    Case("simulator", "dualpipev m below 2p", _simulate("dualpipev", 4, 4), ("2 * num_stages = 8",)),
    Case("simulator", "costs a dict of numbers", _simulate("1f1b", 4, 2, lambda: {"forward": 1}),
         ("costs must be a Costs",)),
    Case("simulator", "per-chunk costs miss a rank", _simulate("1f1b", 4, 2, _per_chunk((0, 0))),
         ("no entry for (rank, chunk)", "(1, 0)")),
    Case("simulator", "per-chunk costs disagree on p2p", _simulate("1f1b", 4, 2, _per_chunk((0, 0), (1, 0),
                                                                                            p2p=(0.0, 1.0))),
         ("disagree on p2p",)),
    Case("simulator", "render text of a number", _render("to_text", 42), ("to_text needs", "int")),
]


TRAIN = [
    Case("train", "config file missing", _pz("train", "{tmp}/nope.json"),
         ("pipezero train", "nope.json", "not a file")),
    Case("train", "no command", _pz(), ("required",)),
    Case("train", "unknown command", _pz("fit"), ("invalid choice", "'fit'")),
]

ALL += SIMULATOR + TRAIN
