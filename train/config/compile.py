"""ds_config["compile"]: DeepSpeed 0.19.8's compile section, read with its meaning.

In DeepSpeed the section configures `engine.compile()`; `"deepcompile": true` asks for its
compiler, which rewrites the model's graph with ZeRO's gathers and reductions inside it (Jiang
et al. 2025, "DeepCompile"). pipezero's nearest equivalent, and what `"deepcompile": true`
turns on here, is regional compilation of each stage's layers (pipe/compile.py): each block
compiled, ZeRO's collectives eager between the blocks (on the pipeline's schedule). An empty
section, or deepcompile false, compiles nothing, as in DeepSpeed before engine.compile(); the
settings of DeepCompile's own passes (activation freeing and offload, double buffering, ...)
have no counterpart and are refused unless at DeepSpeed's defaults. The keys of the section
before DeepSpeed 0.16 (`enabled`, `backend`, `kwargs`: compile the engine at initialize, with
torch.compile's backend and keyword arguments), still in users' files, keep that meaning;
`"enabled": false` turns compilation off (pipezero compiles on CUDA by default, pipe/compile.py).
"""

from __future__ import annotations

from typing import Any

from pipezero.config_fields import ConfigError, ConfigTypeError, Ignored, Section, Unsupported
from pipezero.pipe.compile import CompileConfig

__all__ = ["read_compile"]

_PASS = "DeepCompile's {} pass; pipezero compiles each layer and keeps ZeRO eager between them"
_RULES = {
    "autoep_non_moe": Ignored("pipezero has no AutoEP mixture-of-experts layers", noop=False),
    "free_activation": Unsupported(_PASS.format("activation-freeing"), "set it to false", noop=False),
    "free_activation_threshold": Ignored("only DeepCompile's free_activation reads it", noop=lambda v: True),
    "offload_activation": Unsupported(_PASS.format("activation offload"), "set it to false", noop=False),
    "offload_activation_pin_memory": Ignored("only DeepCompile's offload_activation reads it", noop=lambda v: True),
    "offload_opt_states": Unsupported(_PASS.format("optimizer-state offload"),
                                      'use zero_optimization.offload_optimizer', noop=False),
    "offload_parameters": Unsupported(_PASS.format("parameter offload"), 'use zero_optimization.offload_param',
                                      noop=False),
    "double_buffer": Ignored("ZeRO-3 prefetches with stage3_prefetch_bucket_size", noop=True),
    "symmetric_memory": Unsupported(_PASS.format("symmetric-memory"), "set it to false", noop=False),
    "debug_log": Ignored("set TORCH_LOGS=graph_code to see the compiled graphs", noop=False),
    **{k: Ignored("collectives are ordered by the stream they run on", noop=False)
       for k in ("sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather")},
    "keep_int_input_tensors": Ignored("only DeepCompile's profiling reads it", noop=lambda v: True),
    "keep_all_input_tensors": Ignored("only DeepCompile's profiling reads it", noop=lambda v: True),
    "passes": Unsupported("DeepCompile's graph passes (z1, z3, autosp, autotp)", "remove the key",
                          noop=lambda v: v is None or v == []),
}


_KWARGS = ("mode", "fullgraph", "dynamic", "options")  # torch.compile's, as CompileConfig holds them


def read_compile(raw: Any) -> CompileConfig | bool | None:
    """The section -> a CompileConfig (deepcompile or enabled true), False (enabled false) or None
    (absent or silent: pipezero's default)."""
    sec = Section(raw, ("compile",))
    sec.check(("deepcompile", "enabled", "backend", "kwargs"), _RULES)
    if sec.raw("enabled") is not None and not sec.bool("enabled", False) and not sec.bool("deepcompile", False):
        return False
    if not (sec.bool("deepcompile", False) or sec.bool("enabled", False)):
        return None
    backend, kwargs = sec.raw("backend", "inductor"), sec.raw("kwargs", {}) or {}
    if not isinstance(backend, str):
        raise ConfigTypeError(f'{sec.where("backend")} = {backend!r}: expected a torch.compile backend name')
    if not isinstance(kwargs, dict) or set(kwargs) - set(_KWARGS):
        raise ConfigError(f'{sec.where("kwargs")} = {kwargs!r}: expected an object of torch.compile keyword '
                          f"arguments among {list(_KWARGS)}")
    return CompileConfig(backend=backend, **kwargs)
