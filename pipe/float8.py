"""Float8 training: the blocks' Linear layers multiply in fp8 (torchao's Float8Linear), nothing else changes.

A Hopper-class GPU (compute capability 8.9 and up) multiplies fp8 at twice its bf16 rate.
torchao's Float8Linear casts a Linear's input, weight and output gradient to fp8 with dynamic
scales (one per tensor, recipe "tensorwise"; one per row, "rowwise"; "rowwise_with_gw_hp" keeps the
weight gradient's GEMM in high precision) and keeps the weight, its gradient and the optimizer's
state in their own dtype: ZeRO, the master weights, checkpoints and exports see the same
parameters under the same names. The casts' amax and scaling fuse into the neighbouring kernels
when the blocks are compiled (pipe/compile.py: on by default on CUDA); eager, they cost more
than the fp8 GEMMs gain.

Which Linears: every nn.Linear inside the repeated blocks (the classes the model builds twice or
more, as compile picks them; with model=, pipe/compile.py's model_blocks) whose in and out
features are multiples of 16 (the fp8 GEMM's alignment; others stay as they are). The embedding,
the head and the loss keep the model's dtype, as torchtitan's float8 recipe leaves the output
projection in bf16.

Not combined with tensor parallelism (torchao shards fp8 Linears through DTensor plans; this
package's tensor-parallel Linears are local tensors): refused. `emulate=True` runs the same casts
with high-precision GEMMs, on any device: the CPU tests train it beside torchao's own conversion
of the one-process model. torchao is an optional extra: pip install 'pipezero[float8]'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

__all__ = ["RECIPES", "Float8Config", "check_float8", "float8_linears", "to_float8"]

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values
ALIGNMENT = 16   # fp8 GEMMs (torch._scaled_mm) need both matrix sides in multiples of 16
MIN_CAPABILITY = (8, 9)


@dataclass(kw_only=True, slots=True, frozen=True)
class Float8Config:
    """How the blocks' Linears train in fp8 (PipelineModule(float8=...), build(float8=...))."""

    recipe: str = "tensorwise"  # torchao's scaling recipe, one of RECIPES
    emulate: bool = False       # the fp8 casts with high-precision GEMMs: any device (tests)

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"Float8Config(recipe={self.recipe!r}): expected one of {', '.join(RECIPES)}")

    @classmethod
    def of(cls, value: "Float8Config | bool | None") -> "Float8Config | None":
        """True: the defaults; False or None: no fp8."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, cls):
            raise TypeError(f"float8={value!r}: expected True, False, None or a Float8Config")
        return value


def float8_linears(blocks: Iterable[nn.Module]) -> list[nn.Linear]:
    """The Linears inside `blocks` that would train in fp8: plain nn.Linear (not a block that is itself
    one: it is swapped in its parent), both sides multiples of 16."""
    found: dict[int, nn.Linear] = {}
    for block in blocks:
        for m in block.modules():
            if m is not block and type(m) is nn.Linear and _aligned(m):
                found.setdefault(id(m), m)
    return list(found.values())


def _aligned(linear: nn.Linear) -> bool:
    return linear.in_features % ALIGNMENT == 0 and linear.out_features % ALIGNMENT == 0


def to_float8(blocks: Iterable[nn.Module], config: Float8Config, device: torch.device,
              tensor_size: int = 1) -> int:
    """Swap float8_linears(blocks) for torchao's Float8Linear in place (same parameters); returns how many.

    Call it before anything hooks the Linears (ZeRO-3, tensor parallelism) and before compiling.
    """
    blocks = list(blocks)
    if not blocks:
        return 0
    check_float8(config, torch.device(device), tensor_size)
    chosen = {id(m) for m in float8_linears(blocks)}
    if not chosen:
        names = sorted({type(b).__name__ for b in blocks})
        raise ValueError(f"float8: the blocks ({', '.join(names)}) hold no nn.Linear with in and out features "
                         f"multiples of {ALIGNMENT}; fp8 converts nn.Linear only (GPT-2's Conv1D is not one): "
                         "pass float8=False")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ao_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(config.recipe), emulate=config.emulate)
    for block in blocks:
        convert_to_float8_training(block, config=ao_config, module_filter_fn=lambda m, _fqn: id(m) in chosen)
    return len(chosen)


def check_float8(config: Float8Config, device: torch.device, tensor_size: int = 1) -> None:
    """Every reason fp8 cannot run here, named with its fix: call it before any collective."""
    if tensor_size > 1:
        raise ValueError(f"float8 with tensor parallelism (tensor={tensor_size}) is not supported: pass "
                         "float8=False, or tensor=1 (fp8 with pipe and data parallelism and ZeRO works)")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ImportError(f"float8 needs torchao ({err}): pip install 'pipezero[float8]' "
                          "(or pip install torchao), or pass float8=False") from None
    if config.emulate:
        return
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < MIN_CAPABILITY:
        found = f"compute capability {capability[0]}.{capability[1]}" if capability else f"device {device.type}"
        raise ValueError(f"float8 needs a GPU of compute capability 8.9+ (H100, H200, L4, RTX 4090) for fp8 "
                         f"GEMMs; this process has {found}: pass float8=False (drop --float8), or "
                         "Float8Config(emulate=True) to run fp8's rounding without fp8 GEMMs")
