"""LossScaler in one process: the scale trajectory (against DeepSpeed's class), the no-op path, checkpoints, bad input."""

import copy
import json
import logging
import random

import pytest
import safetensors.torch
import torch

from pipezero.precision import LossScaler, MasterWeights, ScalerConfig, clip_grad_norm
from pipezero.precision.scale_state import ScaleState

INF = float("inf")


# -- the trajectory: DeepSpeed 0.19.8's own DynamicLossScaler is the reference ---------------
def deepspeed_trajectory(overflows, init, window, hysteresis, min_scale, consecutive):
    """(scale, hysteresis left) after each step of DeepSpeed's DynamicLossScaler (a test-only dependency)."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    from unittest import mock

    ds = loss_scaler.DynamicLossScaler(init_scale=init, scale_window=window, min_scale=min_scale,
                                       delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                       raise_error_at_min_scale=False,  # pipezero never raises at the floor
                                       dtype=torch.float32)  # (fp16 only changes its log line, which int()s inf)
    out = []
    with mock.patch.object(loss_scaler.dist, "get_rank", lambda *a, **k: 0):  # no process group here
        for overflow in overflows:
            ds.update_scale(overflow)
            out.append((ds.cur_scale, ds.cur_hysteresis))
    return out


def overflow_patterns(n, seed):
    rng = random.Random(seed)
    randoms = [rng.random() < 0.3 for _ in range(n)]
    bursts = []  # long overflow runs (down to the floor) then clean runs crossing window multiples
    while len(bursts) < n:
        bursts += [True] * rng.randint(1, 25) + [False] * rng.randint(1, 40)
    alternating = [i % 2 == 0 for i in range(n)]
    sparse = [rng.random() < 0.02 for _ in range(n)]
    return {"random": randoms, "bursts": bursts[:n], "alternating": alternating, "sparse": sparse}


CONFIGS = [
    dict(init=2.0 ** 16, window=1000, hysteresis=2, min_scale=1.0, consecutive=False),  # DeepSpeed defaults
    dict(init=2.0 ** 8, window=7, hysteresis=1, min_scale=1.0, consecutive=False),
    dict(init=2.0 ** 10, window=5, hysteresis=3, min_scale=4.0, consecutive=True),
    dict(init=2.0 ** 4, window=1, hysteresis=2, min_scale=0.25, consecutive=False),
    dict(init=2.0 ** 12, window=3, hysteresis=4, min_scale=2.0, consecutive=False),
    dict(init=2.0 ** 6, window=2, hysteresis=1, min_scale=1.0, consecutive=True),
]


def _scaler(cfg, lr=0.5):
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = LossScaler(torch.optim.SGD([param], lr=lr), init_scale=cfg["init"], scale_window=cfg["window"],
                     hysteresis=cfg["hysteresis"], min_scale=cfg["min_scale"],
                     consecutive_hysteresis=cfg["consecutive"])
    return param, opt


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"w{c['window']}h{c['hysteresis']}c{int(c['consecutive'])}")
def test_scale_trajectory_matches_deepspeed(cfg):
    """5000 steps per pattern through ScaleState (LossScaler's rule), the first 400 through LossScaler.step."""
    for name, pattern in overflow_patterns(5000, seed=cfg["window"]).items():
        expected = deepspeed_trajectory(pattern, **cfg)
        state = ScaleState(scale=cfg["init"], hysteresis_left=cfg["hysteresis"])
        got = []
        for overflow in pattern:
            state.update(overflow, dynamic=True, hysteresis=cfg["hysteresis"], scale_window=cfg["window"],
                         min_scale=cfg["min_scale"], consecutive_hysteresis=cfg["consecutive"])
            got.append((state.scale, state.hysteresis_left))
        assert got == expected, f"pattern {name}: first difference at step " \
                                f"{next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)}"
        param, opt = _scaler(cfg)
        for step, overflow in enumerate(pattern[:400]):
            before = param.detach().clone()
            param.grad = torch.tensor([INF if overflow else 1.0], dtype=torch.float64)
            assert opt.step() is not overflow and opt.last_step_skipped == overflow
            assert (opt.loss_scale, opt.scale_state.hysteresis_left) == expected[step], f"{name}: step {step}"
            if overflow:
                assert torch.equal(param.detach(), before), f"{name}: a skipped step moved the parameter"
        assert opt.skipped_steps == sum(pattern[:400])


def test_growth_waits_a_full_window_after_the_overflow():
    """DeepSpeed's rule: window 7, hysteresis 1, overflow at iteration 190 -> the scale doubles at 198, not 197."""
    param, opt = _scaler(dict(init=2.0 ** 8, window=7, hysteresis=1, min_scale=1.0, consecutive=False))
    scales = []
    for step in range(200):
        param.grad = torch.tensor([INF if step == 190 else 1.0], dtype=torch.float64)
        opt.step()
        scales.append(opt.loss_scale)
    assert scales[7] == 2.0 ** 9 and scales[6] == 2.0 ** 8  # first growth at iteration 7 (= window)
    assert scales[190] == scales[189] / 2
    assert scales[197] == scales[190] and scales[198] == 2 * scales[190]


def test_floor_keeps_training_then_limit_raises(caplog, monkeypatch):
    # train/log.py stops "pipezero" records at its own handler once used; caplog listens at the root
    monkeypatch.setattr(logging.getLogger("pipezero"), "propagate", True)
    param, opt = _scaler(dict(init=4.0, window=100, hysteresis=1, min_scale=1.0, consecutive=False))
    opt.config.max_consecutive_skips = 0
    for _ in range(6):
        param.grad = torch.tensor([INF], dtype=torch.float64)
        assert opt.step() is False
    assert opt.loss_scale == 1.0
    assert opt.scale_state.consecutive_skips_at_floor == 4  # steps 3..6 were at the floor
    assert "consecutive step(s) skipped" in caplog.text
    limited = LossScaler(torch.optim.SGD([param], lr=0.1), init_scale=2.0, dynamic=False,
                         max_consecutive_skips=3)
    for _ in range(2):
        param.grad = torch.tensor([INF], dtype=torch.float64)
        assert limited.step() is False
    param.grad = torch.tensor([INF], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="3 consecutive steps skipped.*max_consecutive_skips=3"):
        limited.step()


def test_noop_path_is_the_inner_optimizer():
    """Scale 1, static: no multiply, no check; an inf gradient goes through as it would without it."""
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    twin.load_state_dict(model.state_dict())
    opt = LossScaler(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=1, dynamic=False)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    assert repr(opt) == "LossScaler(off, SGD)"
    x = torch.randn(4, 6)
    loss = model(x).square().mean()
    assert opt.scale(loss) is loss
    opt.backward(loss)
    twin(x).square().mean().backward()
    assert opt.step() is True and ref.step() is None
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    bf16 = LossScaler.from_config(torch.optim.SGD(model.parameters(), lr=0.1), {"enabled": True},
                                  dtype=torch.bfloat16)
    assert bf16.config.is_noop and bf16.config.checks_finite  # DeepSpeed's check_grad_overflow default
    unchecked = LossScaler.from_config(torch.optim.SGD(model.parameters(), lr=0.1),
                                       {"enabled": True, "check_grad_overflow": False}, dtype=torch.bfloat16)
    assert unchecked.config.is_noop and not unchecked.config.checks_finite
    model.weight.grad = torch.full_like(model.weight, INF)
    assert bf16.step() is False


def test_clip_option_equals_torch_clip_after_unscaling():
    torch.manual_seed(1)
    model, twin = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    twin.load_state_dict(model.state_dict())
    opt = LossScaler(torch.optim.SGD(model.parameters(), lr=0.1), init_scale=2.0 ** 10, clip_grad_norm=0.05)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    opt.backward(model(x).square().mean())
    twin(x).square().mean().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    assert expected_norm > 0.05  # the clip really clips
    assert opt.step() is True
    ref.step()
    assert opt.last_grad_norm == pytest.approx(expected_norm.item(), rel=1e-6)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _fp16_chain(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).half()
    opt = LossScaler(MasterWeights(torch.optim.Adam(model.parameters(), lr=1e-2)),
                     init_scale=2.0 ** 13, scale_window=2, hysteresis=2)
    return model, opt


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    record = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen).half()
        loss = (model(x).float() - x[:, :1].float()).square().mean() * 300  # big grads: overflows happen
        opt.backward(loss)
        record.append((loss.item(), opt.step(), opt.loss_scale))
        opt.zero_grad()
    return record, [p.detach().clone() for p in model.parameters()]


def test_state_dict_round_trip_continues_bit_identically():
    model, opt = _fp16_chain(0)
    _train(model, opt, 8, seed=1)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    json.dumps(saved_opt["loss_scaler"])  # plain numbers
    safetensors.torch.load(safetensors.torch.save(saved_opt["inner"]["master"]))  # str -> tensor
    first, first_params = _train(model, opt, 10, seed=2)
    assert not all(stepped for _, stepped, _ in first) and any(stepped for _, stepped, _ in first)

    fresh, fresh_opt = _fp16_chain(5)
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    assert fresh_opt.loss_scale == saved_opt["loss_scaler"]["scale"]
    second, second_params = _train(fresh, fresh_opt, 10, seed=2)
    assert second == first
    for a, b in zip(first_params, second_params):
        assert torch.equal(a, b)


def test_repr_shows_the_nesting():
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))]
    assert repr(LossScaler(MasterWeights(torch.optim.Adam(params)))) == "LossScaler(dynamic, MasterWeights(Adam))"
    assert repr(LossScaler(torch.optim.SGD(params, lr=1), init_scale=128, dynamic=False, clip_grad_norm=1.0)) \
        == "LossScaler(static=128, clip=1, SGD)"


def test_lr_scheduler_drives_the_whole_chain():
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))]
    adam = torch.optim.Adam(params, lr=1.0)
    opt = LossScaler(MasterWeights(adam))
    assert opt.param_groups is adam.param_groups
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    params[0].grad = torch.ones(2, dtype=torch.float16)
    assert opt.step() is True
    sched.step()
    assert adam.param_groups[0]["lr"] == 0.5
    assert adam.param_groups[0]["params"][0].dtype == torch.float32  # Adam steps the fp32 master


def test_masters_keep_the_duplicate_mark():
    tied = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    tied.pipezero_duplicate = True
    own = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    masters = MasterWeights(torch.optim.SGD([tied, own], lr=0.1)).param_groups[0]["params"]
    assert [getattr(m, "pipezero_duplicate", False) for m in masters] == [True, False]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(init_scale=0), ValueError, "init_scale=0"),
    (dict(init_scale=-4.0), ValueError, "init_scale=-4.0"),
    (dict(init_scale=float("nan")), ValueError, "init_scale=nan"),
    (dict(min_scale=0.0), ValueError, "min_scale=0.0"),
    (dict(scale_window=0), ValueError, "scale_window=0"),
    (dict(hysteresis=0), ValueError, "hysteresis=0"),
    (dict(init_scale=1.0, min_scale=2.0), ValueError, "below the floor"),
    (dict(clip_grad_norm=-1.0), ValueError, "clip_grad_norm=-1.0"),
    (dict(dynamic="yes"), TypeError, "dynamic='yes'"),
    (dict(check_finite=False), ValueError, "check_finite=False"),
])
def test_bad_arguments(kwargs, error, match):
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(error, match=match):
        LossScaler(torch.optim.SGD(params, lr=0.1), **kwargs)


@pytest.mark.parametrize("section, match", [
    ({"loss_scale": 0, "loss_scale_windw": 100}, 'did you mean "loss_scale_window"'),
    ({"enabled": "maybe"}, r'\["enabled"\] = .maybe.: expected true or false'),
    ({"loss_scale": -1}, r'\["loss_scale"\] = -1'),
    ({"initial_scale_power": 200}, r'\["initial_scale_power"\] = 200'),
    ({"hysteresis": 0}, r'\["hysteresis"\] = 0'),
    ({"opt_level": "O2"}, r"not a key of DeepSpeed's ds_config\[\"fp16\"\] section"),
])
def test_bad_config(section, match):
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=match):
        LossScaler.from_config(torch.optim.SGD(params, lr=0.1), section)


def test_from_config_reads_deepspeed_keys():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = LossScaler.from_config(torch.optim.SGD(params, lr=0.1), {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 50,
        "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 2, "auto_cast": False},
        clip_grad_norm=1.5)
    assert opt.config == ScalerConfig(init_scale=4096.0, dynamic=True, scale_window=50, hysteresis=3,
                                      min_scale=2.0, consecutive_hysteresis=True, clip_grad_norm=1.5)
    static = LossScaler.from_config(torch.optim.SGD(params, lr=0.1), {"loss_scale": 128})
    assert not static.config.dynamic and static.loss_scale == 128.0


def test_bad_wrapping_and_loading():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"LossScaler\(inner=Linear\) needs an optimizer"):
        LossScaler(model)
    with pytest.raises(TypeError, match="MasterWeights"):
        MasterWeights(list(model.parameters()))
    stepped = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="has not stepped yet"):
        MasterWeights(stepped)
    opt = LossScaler(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"expects the keys \['inner', 'loss_scaler'\]"):
        opt.load_state_dict(stepped.state_dict())
    with pytest.raises(TypeError, match="takes no closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_grad_norm(model.parameters(), 0)
