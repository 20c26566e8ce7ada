"""A static-shape step captured once as a CUDA graph, replayed for every further token.

A 1B model's decode step is hundreds of small kernels; launched from Python each token, the
GPU waits on the CPU. A CUDA graph records the kernels once and replays them with one launch.
It replays fixed addresses, so it is captured only when the step's weights stay put while it
runs (whole local tensors: not ZeRO-3 shards gathered per layer by module hooks, not
DTensors) and it lives no longer than the call that captured it: under ZeRO-3 the weights
gathered by one `gathered(opt)` phase are freed at its end, and a graph kept past it would
read freed memory, so each generate call captures its own (see pipe/hf/generate.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["capture_step"]

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the warm-up and capture stream


def _addresses(modules: Sequence[nn.Module]) -> list[int] | None:
    """Addresses of every parameter and buffer, or None if one is not whole and local (a ZeRO-3
    shard, a DTensor, a tensor-parallel shard: its layer's all-reduces stay out of a graph)."""
    from torch.distributed.tensor import DTensor

    from pipezero.comm import tensor_shard

    tensors = [t for m in modules for t in (*m.parameters(), *m.buffers())]
    if any(isinstance(t, DTensor) or tensor_shard(t) is not None or t.numel() == 0 for t in tensors):
        return None
    return [t.data_ptr() for t in tensors]


def capture_step(step: Callable[[], torch.Tensor], modules: Sequence[nn.Module], device: torch.device,
                 required: bool) -> Callable[[], torch.Tensor] | None:
    """step captured into a CUDA graph, as replay() -> step's output; None where it cannot be.

    The warm-up before the capture is a real run of the step with the inputs in place (it
    writes what the first replay writes again). Warm-up and capture share one side stream per
    device, as torch.cuda.graphs documents. required: raise instead of returning None.
    """
    before = _addresses(modules)
    why = "some weights are ZeRO-3 shards, DTensors or tensor-parallel shards" if before is None else ""
    with torch.cuda.device(device):
        if before is not None:
            if device.index not in _SIDE_STREAMS:
                _SIDE_STREAMS[device.index] = torch.cuda.Stream()
            side = _SIDE_STREAMS[device.index]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            if _addresses(modules) != before:
                why = "the weights moved during the step (ZeRO-3 hooks gathering each layer)"
        if not why:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=side):
                    out = step()
            except RuntimeError as err:  # an operation that cannot be captured (a host sync in the layers)
                why = f"the step cannot be captured: {err}"
    if why:
        if required:
            raise ValueError(f"cuda_graph=True: {why}; a graph replays fixed addresses, so generate inside one "
                             "`with gathered(opt)` without layers_at_a_time, or pass cuda_graph=None or False")
        return None

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay
