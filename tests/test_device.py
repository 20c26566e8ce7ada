"""One device rule: build() on a fresh process picks the device its process group will use.

No GPU here, so CUDA's presence is mocked: the rule must answer cuda:LOCAL_RANK before
init_distributed has run (it once answered "cpu", and the GPU user's job ran on the CPU).
"""

import importlib

import pytest
import torch
import torch.distributed as dist

from pipezero.topology import default_backend, device_for, process_device
from pipezero.topology import device as device_mod


class _Picked(Exception):
    """Stops build() right after it chose the device."""


@pytest.fixture
def fresh_cuda_process(monkeypatch):
    """An uninitialised process on a (pretended) CUDA machine, as torchrun's LOCAL_RANK=1 worker."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")


def test_the_rule_is_a_pure_function_of_backend_and_local_rank():
    assert device_for("nccl", 3) == torch.device("cuda", 3)
    assert device_for("gloo", 3) == torch.device("cpu")


def test_an_uninitialised_process_predicts_the_backend_and_device(fresh_cuda_process):
    assert default_backend() == "nccl"
    assert process_device() == torch.device("cuda", 1)


def test_no_cuda_means_gloo_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: False)
    assert (default_backend(), process_device()) == ("gloo", torch.device("cpu"))


def test_build_on_a_fresh_process_picks_the_process_groups_device(fresh_cuda_process, monkeypatch):
    build_mod = importlib.import_module("pipezero.train.build")  # the module (pipezero.train.build is the function)
    picked = []

    def stop(dtype, device):
        picked.append(device)
        raise _Picked

    monkeypatch.setattr(build_mod, "resolve_precision", stop)
    assert not dist.is_initialized()
    with pytest.raises(_Picked):
        build_mod.build({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
                        model=torch.nn.Linear(2, 2))
    assert picked == [torch.device("cuda", 1)]


def test_more_local_ranks_than_gpus_is_named_before_any_rendezvous(fresh_cuda_process, monkeypatch):
    """Two processes on a one-GPU node: rank 1 used to fail inside set_device (or wait on a peer)."""
    from pipezero.topology import env as env_mod

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(env_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(env_mod.dist, "init_process_group", lambda *a, **k: pytest.fail("rendezvous reached"))
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 but this node has 1 visible GPU.*--nproc-per-node 1"):
        env_mod.init_distributed()
