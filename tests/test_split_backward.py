"""Zero-bubble's I and W: the deferred Linear GEMMs give autograd's own gradients, in two parts.

The truth is one plain torch.autograd.backward of an identical copy of the chunk.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness import run
from pipezero.pipe import PipelineModule, PipelineRunner
from pipezero.pipe.deferred_linear import DeferringLinear, WeightSink, collecting, defer_linear_weights
from pipezero.pipe.split_backward import backward_input
from pipezero.topology import Grid


class Block(nn.Module):
    """Pre-LN MLP block: a LayerNorm (kept in I) and two Linears (deferred to W)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(3 * width, width)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.ln(h))))


class Chunk(nn.Module):
    """Two blocks, each under activation checkpointing if asked (PipelineModule's: non-reentrant)."""

    def __init__(self, ckpt: str):
        super().__init__()
        torch.manual_seed(0)
        self.blocks, self.ckpt = nn.ModuleList([Block(), Block()]), ckpt

    def forward(self, h):
        for block in self.blocks:
            h = block(h) if self.ckpt == "none" else checkpoint(block, h, use_reentrant=False)
        return h


def _grads(model, h):
    return [h.grad] + [p.grad for p in model.parameters()]


def _truth(model, h, grad):
    h = h.clone().requires_grad_()
    torch.autograd.backward([model(h)], [grad])
    return _grads(model, h)


@pytest.mark.parametrize("ckpt", ["none", "non-reentrant"])
def test_deferred_linears_split_autograd_into_i_and_w(ckpt):
    ref = Chunk(ckpt)
    model = copy.deepcopy(ref)
    assert defer_linear_weights(model) == 4 and isinstance(model.blocks[0].up, DeferringLinear)
    h0, grad = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    truth = _truth(ref, h0, grad)
    h, sink = h0.clone().requires_grad_(), WeightSink()
    with collecting(sink):
        out = model(h)
    assert sink  # the forward deferred
    linears = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    in_grads, w = backward_input([out], [grad], [h], list(model.parameters()), sink)
    torch.testing.assert_close(in_grads[0], truth[0], rtol=1e-6, atol=1e-6)
    assert all(p.grad is None for p in linears)  # their GEMMs wait for W
    assert model.blocks[0].ln.weight.grad is not None  # everything else ran in I
    assert w.run() is True  # .grad assigned without hooks: the runner tells the optimizer
    for got, want in zip(_grads(model, h), truth):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_deferred_gradients_pass_no_accumulate_grad_hooks():
    """A ZeRO optimizer's post-accumulate hooks must not fire for a weight whose gradient W
    assigns later: it would take the .grad of the microbatches before and lose what W adds."""
    model = Chunk("none")
    defer_linear_weights(model)
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    h, sink = torch.randn(2, 8, requires_grad=True), WeightSink()
    with collecting(sink):
        out = model(h)
    _, w = backward_input([out.sum()], [None], [h], list(model.parameters()), sink)
    w.run()
    lns = {id(p) for b in model.blocks for p in b.ln.parameters()}
    assert fired and {id(p) for p in fired} == lns


def test_first_chunk_defers_the_same_way():
    """No input needs a gradient (the first stage): I runs the backward all the same, W the GEMMs."""
    ref, model = Chunk("none"), Chunk("none")
    defer_linear_weights(model)
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    torch.autograd.backward([ref(x)], [grad])
    sink = WeightSink()
    with collecting(sink):
        out = model(x)  # the Linears' inputs need gradients: the LayerNorm before them has weights
    in_grads, w = backward_input([out], [grad], [], list(model.parameters()), sink)
    linears = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    assert in_grads == () and all(p.grad is None for p in linears)
    assert w.run() is True
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6)


def test_outside_a_sink_or_under_autocast_a_deferring_linear_is_nn_linear():
    model = Chunk("none")
    defer_linear_weights(model)
    h = torch.randn(2, 8, requires_grad=True)
    model(h).sum().backward()  # no sink: ordinary gradients
    assert all(p.grad is not None for p in model.parameters())
    sink = WeightSink()
    with collecting(sink), torch.autocast("cpu", dtype=torch.bfloat16):
        model(h)
    with collecting(sink), torch.no_grad():
        model(h)
    assert not sink  # nothing deferred: backward_input falls back to torch's graph split


def _linear_classes(schedule: str, deferred: bool) -> tuple:
    from pipezero.pipe import OneFOneB, ZeroBubbleV

    sched = {"OneFOneB": OneFOneB, "ZeroBubbleV": ZeroBubbleV}[schedule](num_microbatches=4)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    model = PipelineModule(layers, grid=Grid(pipe=2), loss_fn=F.mse_loss, partition_method="uniform",
                           num_chunks=sched.num_chunks, placement=sched.placement, deferred_linear=deferred)
    classes = lambda: sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)})  # noqa: E731
    built = classes()
    PipelineRunner(model, sched)
    return built, classes()


def test_deferred_linear_is_a_module_option_not_a_runner_side_effect():
    for schedule in ("ZeroBubbleV", "OneFOneB"):
        assert run(_linear_classes, 2, schedule, True) == [(["DeferringLinear"], ["DeferringLinear"])] * 2
        assert run(_linear_classes, 2, schedule, False) == [(["Linear"], ["Linear"])] * 2
