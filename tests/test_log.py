"""Logging helpers: TensorBoard events read back, rank filtering on two ranks, warn_once, progress, timers."""

import io
import logging
import time

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator

from harness import run
from pipezero.train.log import (Phase, Progress, TensorBoardWriter, Timers, get_logger, set_log_ranks,
                                warn_once)


def test_tensorboard_scalars_and_image_read_back(tmp_path):
    with TensorBoardWriter(str(tmp_path), "job", rank=0) as tb:
        assert tb.active
        for step in range(3):
            tb.scalars({"loss": 2.0 - step, "lr": torch.tensor(1e-3 * (step + 1))}, step, prefix="train/")
        tb.scalar("val/loss", 1.5, 2)
        tb.image("timeline", torch.rand(3, 8, 12), 2)
        tb.image("timeline_u8", np.zeros((5, 7, 3), dtype=np.uint8), 2)  # pipe.to_image's form
    acc = event_accumulator.EventAccumulator(str(tmp_path / "job"), size_guidance={"images": 0})
    acc.Reload()
    tags = acc.Tags()
    assert set(tags["scalars"]) == {"train/loss", "train/lr", "val/loss"}
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [0, 1, 2] and [e.value for e in loss] == [2.0, 1.0, 0.0]
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([1e-3, 2e-3, 3e-3])
    image = acc.Images("timeline")[0]
    assert (image.step, image.width, image.height) == (2, 12, 8)
    assert (acc.Images("timeline_u8")[0].width, acc.Images("timeline_u8")[0].height) == (7, 5)


def test_tensorboard_is_a_no_op_off_the_writer_rank(tmp_path):
    tb = TensorBoardWriter(str(tmp_path), "job", rank=1)
    tb.scalar("loss", 1.0, 0)
    tb.image("x", torch.rand(3, 2, 2), 0)
    tb.close()
    assert not tb.active and not (tmp_path / "job").exists()
    assert not TensorBoardWriter(str(tmp_path), "job", enabled=False, rank=0).active


def _log_on_each_rank():
    logger = get_logger("test")
    handler = next(h for h in logging.getLogger("pipezero").handlers if getattr(h, "_pipezero", False))
    out, old = io.StringIO(), handler.stream
    handler.setStream(out)
    try:
        logger.info("hello %s", "world")
        set_log_ranks(None)
        logger.info("everyone")
    finally:
        set_log_ranks()
        handler.setStream(old)
    return out.getvalue()


def test_only_rank_zero_logs_by_default_with_a_rank_prefix():
    zero, one = run(_log_on_each_rank, 2)
    assert zero == "[rank 0] INFO pipezero.test: hello world\n[rank 0] INFO pipezero.test: everyone\n"
    assert one == "[rank 1] INFO pipezero.test: everyone\n"


def test_warn_once():
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # its own handler: independent of propagation to the root logger
    logger = get_logger("test_warn")
    logger.addHandler(handler)
    try:
        assert warn_once("odd value %s", 3, logger=logger)
        assert not warn_once("odd value %s", 3, logger=logger)
        assert warn_once("odd value %s", 4, logger=logger)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["odd value 3", "odd value 4"]


def test_progress_bar_lines_off_a_terminal():
    out = io.StringIO()
    bar = Progress(100, desc="train", enabled=True, stream=out)
    for step in range(100):
        bar.update(loss=2.0 / (step + 1))
    lines = out.getvalue().splitlines()
    assert len(lines) == 20 and lines[-1].startswith("train [" + "#" * 24 + "] 100/100")
    assert "loss=0.02" in lines[-1] and "it/s" in lines[0]
    quiet = io.StringIO()
    Progress(10, enabled=False, stream=quiet).update(10)
    assert quiet.getvalue() == ""


def test_timers_accumulate_per_phase_and_sync():
    synced = []
    timers = Timers(sync=lambda: synced.append(1))
    for _ in range(2):
        with timers(Phase.FORWARD):
            time.sleep(0.01)
    with timers(Phase.OPTIMIZER):
        pass
    timers.add(Phase.COMMUNICATION, 0.25)
    ms = timers.elapsed_ms(reset=False)
    assert set(ms) == {"forward", "optimizer", "communication"} and len(synced) == 6
    assert ms["forward"] >= 20 and ms["communication"] == 250.0
    assert timers.format().startswith("forward ") and timers.elapsed_ms() == {}
    with pytest.raises(TypeError, match="Phase.FORWARD"):
        with timers("forward"):
            pass
    off = Timers(enabled=False)
    with off(Phase.BACKWARD):
        pass
    assert off.elapsed_ms() == {}


def test_progress_counts_on_from_a_resumed_step():
    out = io.StringIO()
    bar = Progress(10, desc="train", enabled=True, stream=out, start=6)
    bar.update(loss=1.0)
    assert " 7/10 " in out.getvalue()


def test_one_warn_once_for_the_config_readers_and_training():
    from pipezero import config_fields

    assert warn_once is config_fields.warn_once  # one record of what was warned, not one per package
