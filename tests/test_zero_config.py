"""ZeroConfig and ZeroOptimizer.from_config: DeepSpeed's keys, "auto" sizes, clear errors (no processes)."""

import pytest
import torch
from torch import nn

from pipezero.zero import ZeroConfig, ZeroOptimizer


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
    ({"stage": 5}, "stage must be 0, 1, 2 or 3"),
    ({"stage": 2, "reduce_bucket_sise": 10}, "reduce_bucket_sise is not a known key"),
    ({"stage": 2, "reduce_bucket_size": 0}, "reduce_bucket_size=0"),
    ({"stage": 2, "reduce_bucket_size": "auto"}, "needs the model's hidden size"),
    ({"stage": 2, "overlap_comm": "auto"}, "only .* may be \"auto\""),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "needs stage 3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "NVMe offload is not supported"),
    ({"stage": 2, "offload_optimizer": {"devise": "cpu"}}, "unknown keys \\['devise'\\]"),
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
