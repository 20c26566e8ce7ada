"""ZeroConfig and ZeroOptimizer.from_config: DeepSpeed's keys, "auto" sizes, clear errors (no processes)."""

import pytest
import torch
from torch import nn

from pipezero.zero import ZeroConfig, ZeroOptimizer


def test_deepspeed_defaults_and_ignored_offload():
    assert ZeroConfig.from_dict({}) == ZeroConfig(stage=0, reduce_bucket_size=500_000_000, overlap_comm=False)
    assert ZeroConfig.from_dict({"stage": 3}).overlap_comm  # DeepSpeed turns overlap on at stage 3 only
    cfg = ZeroConfig.from_dict({"stage": 1, "offload_param": {"device": "cpu"}, "cpu_offload": "true"})
    assert cfg.offload_optimizer and not cfg.offload_param  # offload_param means nothing below stage 3


def test_deepspeed_keys():
    cfg = ZeroConfig.from_dict({"stage": 3, "reduce_bucket_size": 1000, "overlap_comm": False,
                                "contiguous_gradients": True, "stage3_param_persistence_threshold": 0,
                                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "offload_param": {"device": "none"}, "sub_group_size": 10**9})
    assert (cfg.stage, cfg.reduce_bucket_size, cfg.overlap_comm) == (3, 1000, False)
    assert cfg.offload_optimizer and not cfg.offload_param
    assert cfg.stage3_param_persistence_threshold == 0


def test_auto_sizes_follow_the_hidden_size():
    cfg = ZeroConfig.from_dict({"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto"}, hidden_size=64)
    assert (cfg.reduce_bucket_size, cfg.stage3_prefetch_bucket_size,
            cfg.stage3_param_persistence_threshold) == (64 * 64, int(0.9 * 64 * 64), 640)


@pytest.mark.parametrize("section,match", [
    ({"stage": 5}, r'\["stage"\] = 5: expected a value in \[0, 3\]'),
    ({"stage": 2, "reduce_bucket_sise": 10}, 'did you mean "reduce_bucket_size"'),
    ({"stage": 2, "reduce_bucket_size": 0}, r'\["reduce_bucket_size"\] = 0: expected a value >= 1'),
    ({"stage": 2, "reduce_bucket_size": "auto"}, r'is "auto": pass hidden_size='),
    ({"stage": 2, "overlap_comm": "sometimes"}, "expected true or false"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "NVMe offload .* is not supported by pipezero"),
    ({"stage": 2, "offload_optimizer": {"devise": "cpu"}}, 'did you mean "device"'),
    ({"stage": 3, "zero_hpz_partition_size": 8}, "ZeRO\\+\\+ hierarchical partitioning .* set it to 1"),
    ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}, "both 'cpu_offload'"),
    ({"stage": 2, "mics_shard_size": 8}, "MiCS"),
])
def test_bad_sections_name_the_key(section, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ZeroConfig.from_dict(section)


class WithConfig(nn.Module):
    class config:
        hidden_size = 8

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


def test_from_config_builds_the_optimizer():
    model = WithConfig()
    opt = ZeroOptimizer.from_config(torch.optim.Adam(model.parameters()),
                                    {"stage": 3, "reduce_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto"}, module=model)
    assert opt.config.reduce_bucket_size == 64 and opt.config.stage3_param_persistence_threshold == 80
    assert repr(opt) == "ZeroOptimizer(stage=3, Adam)"
    model(torch.randn(2, 8)).sum().backward()   # a group of one: no process group needed
    assert opt.step() is True and opt.last_step_skipped is False
