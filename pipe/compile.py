"""Regional compilation: each repeated layer of a stage (a transformer block) is torch.compile'd.

Compiling the whole model would trace the pipeline's executor, ZeRO's gathers and the schedule
into one graph; compiling each block instead (torchtitan's per-TransformerBlock compile, torch's
"regional compilation" recipe) fuses what runs inside a block (norms, rotary, SwiGLU,
attention's glue) and leaves everything between blocks eager: the p2p sends, the ZeRO hooks on
parameters and modules (only the layer's `forward` is compiled, its module hooks run around
it), tied weights (the tied embedding and head are not compiled), activation checkpointing
(torch.utils.checkpoint re-runs the compiled forward) and zero-bubble's deferred weight GEMMs
(under a schedule that splits backward, DeferringLinear's deferring path is not traced: each
Linear is a break between graphs, so its weight GEMM can still wait for W; under any other
schedule it is a plain Linear and the block compiles as one graph).

A layer's MLP in row tiles (pipe/tiled_mlp.py, past 8K tokens) runs outside the layer's graph, a
break, its function compiled on its own, one graph for every tile and layer: traced into the layer's
graph, the tiles' inputs were kept at the graph's end, so a checkpointed layer's recompute ran the
whole MLP once more for nothing (fullgraph=True keeps them in the graph, and that cost).

The last stage's loss_fn is compiled too (`compile_loss`): one fused pass over the logits each
way instead of an fp32 copy, log-softmax and their backward. A layer whose glue must stay eager
names the submodule to compile instead (`compiled_part`: the Hugging Face decoder layer builds
its mask outside the graph).

A whole model (build(model=...), initialize(model=...): no pipeline) is compiled the same way,
its blocks found as the repeated members of its outermost nn.ModuleLists (`model_blocks`: a
Hugging Face model's decoder layers); its forward and loss are the user's and stay eager.

Compiled for training: a call without gradients (evaluation, generation with a KV cache, whose
shapes change from call to call) runs the eager forward, so decoding never recompiles.

Blocks of one class share their code object, so torch compiles the class's forward once and
every later block reuses it (parameters are graph inputs, not constants). Shapes follow torch's
automatic dynamic (dynamic=None): compiled static on the first call, so fixed-shape training
never recompiles, per micro-batch or per step; when a shape changes (variable-length data,
train/data's pad="microbatch": each micro-batch as wide as its longest row) it recompiles once
with that dimension symbolic, where dynamic=False would recompile for every new width until
torch's recompile limit (8) and then run eager (tests/test_compile.py counts both).

The default (`compile=None`) compiles where it measured faster: on CUDA, without tensor
parallelism (bench/RESULTS.md, issue 31, one H200: the 1.34B GPT's step through build() 1.06x, a
Hugging Face Llama's under ZeRO-1 1.36x, its 1F1B pipeline 1.38x, level with a plain PyTorch loop
over compiled decoder layers); on CPU, where compiling costs more than it gives a short run, it
stays off. With tensor parallelism it works (tests/test_tensor_3d.py: the column/row hooks'
all-reduces trace into the block's one graph) but is off by default until measured on two GPUs.
`compile=False` turns it off, `compile=True` or a CompileConfig on anywhere.

Donated buffers are off, for the process, once pipezero compiles (torch._functorch.config.
donated_buffer = False). torch compiles a graph's backward at its first use: after a whole
backward (no retain_graph) it may write over the saved activations, and a later split backward
of the same graph (ZB-V's or DualPipeV's I on a chunk without deferring Linears, which keeps
the graph for W) is refused ("compiled with non-empty donated buffers"); the switch is read
again when each backward runs, so it cannot be scoped to pipezero's calls. One pipeline runs
both kinds of backward, and models of one layer class share graphs, so a ZB-V model after a 1F1B
one in the same process failed at its first I (tests/test_compile.py). The cost: inductor
cannot reuse a saved activation's memory inside the backward that frees it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch._functorch.config as functorch_config
from torch import nn

__all__ = ["CompileConfig", "compile_by_default", "compile_layers", "compile_loss", "compiled", "compiled_part",
           "model_blocks", "repeated_classes"]


@dataclass(kw_only=True, slots=True, frozen=True)
class CompileConfig:
    """How to compile a pipeline's layers (PipelineModule(compile=...), build(compile=...))."""

    backend: str | Callable = "inductor"   # torch.compile's backend ("aot_eager": tracing only, for tests)
    mode: str | None = None                # torch.compile's mode ("max-autotune", "reduce-overhead", ...)
    fullgraph: bool = False                # True: a graph break inside a layer is an error
    dynamic: bool | None = None            # torch's automatic dynamic: static, one recompile if a shape varies
    layers: str | None = None              # regex of layer class names; None: the classes used 2+ times
    options: dict[str, Any] = field(default_factory=dict)  # torch.compile(options=...), the backend's

    def __post_init__(self) -> None:
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"CompileConfig(backend={self.backend!r}): expected a backend name "
                            "(torch._dynamo.list_backends()) or a callable backend")
        if self.layers is not None:
            try:
                re.compile(self.layers)
            except re.error as err:
                raise ValueError(f"CompileConfig(layers={self.layers!r}): not a regex ({err}); expected a "
                                 "pattern of layer class names, e.g. 'Block|HFDecoderLayer'") from None

    @classmethod
    def of(cls, value: "CompileConfig | bool | None", device: torch.device | None = None,
           tensor_size: int = 1) -> "CompileConfig | None":
        """True: the defaults; False: no compilation; None: compile_by_default(device, tensor_size)."""
        if value is None:
            return cls() if device is not None and compile_by_default(device, tensor_size) else None
        if value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, cls):
            raise TypeError(f"compile={value!r}: expected True, False, None or a CompileConfig")
        return value


def compile_by_default(device: torch.device, tensor_size: int = 1) -> bool:
    """Where compiling measured faster: CUDA, no tensor parallelism (the module docstring says why)."""
    return torch.device(device).type == "cuda" and tensor_size == 1


def repeated_classes(specs: Iterable[Any]) -> set[type]:
    """The layer classes of which the whole model (all stages) builds two or more: its blocks."""
    seen: dict[type, int] = {}
    for spec in specs:
        cls = getattr(spec, "cls", None) if not isinstance(spec, nn.Module) else type(spec)
        if isinstance(cls, type):
            seen[cls] = seen.get(cls, 0) + 1
    return {cls for cls, n in seen.items() if n >= 2}


def compile_layers(layers: Iterable[nn.Module], config: CompileConfig,
                   repeated: set[type] | Sequence[type] = ()) -> list[nn.Module]:
    """Compile each layer's forward in place (its hooks stay eager); returns the layers compiled.

    Which layers: those whose class name matches config.layers, else those of a `repeated`
    class. A layer is compiled once: calling this again leaves it as it is.
    """
    done = []
    for layer in layers:
        if not _wanted(layer, config, repeated) or getattr(layer, "_pipezero_compiled", False):
            continue
        part = compiled_part(layer)
        part.forward = _training_only(part.forward, compiled(part.forward, config))
        _tiles_compiled_alone(part, config)
        layer._pipezero_compiled = True
        done.append(layer)
    return done


def _tiles_compiled_alone(part: nn.Module, config: CompileConfig) -> None:
    """The row tiles inside a compiled layer (pipe/tiled_mlp.py: the modules that declare
    `tiles_compile_as`) run outside its graph, each compiled on its own, so a checkpointed layer's
    recompute stops before them; under fullgraph, where a graph break is an error, they stay in it."""
    if config.fullgraph:
        return
    for m in part.modules():
        if hasattr(type(m), "tiles_compile_as"):
            m.tiles_compile_as = config


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """A whole model's repeated blocks: in each outermost nn.ModuleList, the members (modules with
    submodules of their own, not a bare Linear) whose class it holds two or more of (a transformer's
    layers; a block's own lists, experts say, are inside its graph)."""
    blocks, lists = [], []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or any(name.startswith(prefix) for prefix in lists):
            continue
        repeated = repeated_classes(m)
        found = [c for c in m if type(c) in repeated and next(c.children(), None) is not None]
        if found:
            blocks.extend(found)
            lists.append(f"{name}." if name else "")  # the root itself: every list is inside
    return blocks


def compile_loss(loss_fn: Callable, config: CompileConfig) -> Callable:
    """loss_fn compiled for training (eager without gradients), as the layers are.

    The plain loss upcasts the whole micro-batch's logits to fp32 and runs log-softmax and its
    backward as separate passes over them; compiled, each direction is one fused pass that reads
    the low-precision logits (torchtitan compiles its loss for the same reason).
    """
    return _training_only(loss_fn, compiled(loss_fn, config))


def compiled_part(layer: nn.Module) -> nn.Module:
    """What of `layer` is compiled: the submodule its class names in `compiled_part`, else the layer.

    A layer whose glue must stay eager names its block: HFDecoderLayer builds the attention
    mask with transformers' mask functions, whose checks (is the mask plain causal? are the
    sequences packed?) read the data; traced, they cannot decide, so the mask becomes a dense
    tensor and SDPA leaves its causal kernel (on one H200, attention 2.4x slower).
    """
    name = getattr(type(layer), "compiled_part", None)
    return layer.get_submodule(name) if name else layer


def compiled(fn: Callable, config: CompileConfig) -> Callable:
    """fn under torch.compile as config says."""
    functorch_config.donated_buffer = False  # for the process: the module docstring says why
    return torch.compile(fn, backend=config.backend, mode=config.mode, fullgraph=config.fullgraph,
                         dynamic=config.dynamic, options=config.options or None)


def _training_only(eager: Callable, compiled: Callable) -> Callable:
    """The compiled forward where gradients are recorded, the eager one elsewhere."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)
    return forward


def _wanted(layer: nn.Module, config: CompileConfig, repeated: set[type] | Sequence[type]) -> bool:
    if config.layers is not None:
        return re.fullmatch(config.layers, type(layer).__name__) is not None
    return type(layer) in set(repeated)
