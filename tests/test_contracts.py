"""The contracts between the packages, in one process: the optimizer chain and gradient readiness."""

import pytest
import torch
from torch import nn

from pipezero.comm import innermost, links
from pipezero.pipe.readiness import grad_readiness, loss_scaling
from pipezero.precision import LossScaler, MasterWeights
from pipezero.zero import ZeroOptimizer


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_readiness_is_the_outermost_link_and_scaling_is_found_inside_it():
    model = _model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    assert type(grad_readiness(plain)).__name__ == "_NoReadiness"
    assert loss_scaling(plain)(torch.tensor(3.0)) == 3.0
    scaler = LossScaler(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=8.0)
    zero = ZeroOptimizer(scaler, stage=2)
    assert grad_readiness(zero) is zero and type(grad_readiness(scaler)).__name__ == "_NoReadiness"
    assert loss_scaling(zero)(torch.tensor(3.0)) == 24.0


def test_stage3_readiness_is_the_zero_optimizer():
    model = _model()
    zero = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3, module=model)
    assert grad_readiness(zero) is zero  # ZeRO-3 runs inside the pipeline (tests/test_zero3_pipe.py)


@pytest.mark.parametrize("outer", ["LossScaler", "MasterWeights", "ZeroOptimizer"])
def test_a_link_around_zero_is_refused_naming_the_order_to_use(outer):
    """The chain has one order, ZeRO outside (README): wrapping a ZeroOptimizer fails at construction."""
    model = _model()
    zero = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=2)
    make = {"LossScaler": LossScaler, "MasterWeights": MasterWeights, "ZeroOptimizer": ZeroOptimizer}[outer]
    with pytest.raises(TypeError, match=rf"{outer}\(ZeroOptimizer\(stage=2, SGD\)\): ZeroOptimizer must be the "
                                        rf"outermost link .*ZeroOptimizer\({outer}\(\.\.\.\)\)"):
        make(zero)


class _Counting(torch.optim.SGD):
    serialised = 0

    def state_dict(self):
        type(self).serialised += 1
        return super().state_dict()


def test_chain_state_serialises_the_inner_optimizer_once():
    model = _model().half()
    sgd = _Counting(model.parameters(), lr=0.1, momentum=0.9)
    opt = LossScaler(MasterWeights(sgd), init_scale=4.0)
    assert [type(link).__name__ for link in links(opt)] == ["LossScaler", "MasterWeights"]
    assert innermost(opt) is sgd
    opt.backward(model(torch.ones(2, 4, dtype=torch.half)).float().sum())
    assert opt.step() is True
    state = opt.state_dict()
    assert _Counting.serialised == 1 and set(state) == {"inner", "loss_scaler"}
    assert set(state["inner"]) == {"inner", "master"}
    opt.load_state_dict(state)
    with pytest.raises(ValueError, match=r"expects the keys \['inner', 'master'\]"):
        opt.inner.load_state_dict(state)
    zero = ZeroOptimizer(LossScaler(torch.optim.SGD(_model().half().parameters(), lr=0.1), init_scale=4.0), stage=1)
    assert set(zero.state_dict()) == {"inner", "zero"} and set(zero.state_dict()["inner"]) == {"inner", "loss_scaler"}


def test_zero_around_master_weights_is_refused():
    """MasterWeights' param_groups hold fp32 copies: ZeRO around it reduced no gradient, and each rank
    stepped its shard with its own (2 ranks, bf16: 5x the distance of ZeRO's own masters from one process)."""
    sgd = torch.optim.SGD(_model().half().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"MasterWeights's param_groups hold copies.*drop MasterWeights"):
        ZeroOptimizer(LossScaler(MasterWeights(sgd)), stage=1)
