"""LoRA adapters on the layers each pipeline stage builds: a frozen base, two small trainable matrices.

Fine-tuning a model too large for one device rarely trains every weight: LoRA (Hu et al. 2021,
"LoRA: Low-Rank Adaptation of Large Language Models") freezes the base weight W and learns
y = W x + b + (alpha / r) * B A dropout(x), with A (r x in) initialised as nn.Linear
initialises a weight (kaiming-uniform, a = sqrt(5)) and B (out x r) zero, so training starts
from the base model. The adapters are data on the layer specs: `lora_specs(specs, config)`
returns specs whose build() builds the layer as before (under PipelineModule's per-layer
seed), freezes all its parameters and replaces each targeted nn.Linear by a LoraLinear that
keeps the same `weight` / `bias` (the base loads from a checkpoint under its own names) and adds
`lora_A` / `lora_B`. Targets are chosen as Hugging Face `peft` chooses them: a list of names
matches a module whose full name is one of them or ends in "." + one of them; a string is a
regular expression matched against the whole name. Names are the Hugging Face ones for
hf_layer_specs' layers ("model.layers.0.self_attn.q_proj") and the pipeline's elsewhere
("layers.3.qkv"). Everything is checked on meta copies, so a bad config is the same
ValueError on every rank, before any collective.

    specs = lora_specs(hf_layer_specs(path), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    model = PipelineModule(specs, grid, loss_fn=causal_lm_loss)
    opt = ZeroOptimizer(torch.optim.AdamW(trainable_parameters(model)), stage=1, group=grid.data_sequence_group)
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.pipe.spec import LayerSpec, TiedLayerSpec

__all__ = ["LoraConfig", "LoraLinear", "adapter_state_dict", "adapters_disabled", "apply_lora",
           "check_adapters_kept", "load_adapter_state_dict", "lora_specs", "merged", "trainable_parameters"]

ALL_LINEAR = "all-linear"  # peft's shorthand for every linear layer but the output layer
_PEFT_DEFAULTS = {"use_dora": False, "bias": "none", "modules_to_save": None, "layers_to_transform": None,
                  "init_lora_weights": True, "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
                  "exclude_modules": None, "lora_bias": False, "target_parameters": None,
                  "trainable_token_indices": None, "layer_replication": None, "alora_invocation_tokens": None,
                  "use_qalora": False, "use_bdlora": None, "arrow_config": None, "kasa_config": None,
                  "monteclora_config": None, "velora_config": None}  # peft options this path does not implement
_PEFT_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")  # the ones it does


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """What to adapt and how (the fields spelled as peft's LoraConfig spells them)."""

    r: int = 8
    """Rank of the update B A."""
    lora_alpha: float = 8
    """The update is scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input (the base path sees x unchanged)."""
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    """Names (matched as the end of a module's full name), one regular expression (the whole name), or
    peft's "all-linear": every nn.Linear of the layer list but the output layer's (lora_specs resolves it)."""
    use_rslora: bool = False
    """Rank-stabilised scaling lora_alpha / sqrt(r) (Kalajievski 2023)."""
    base_dtype: torch.dtype | None = None
    """Keep the frozen base in this dtype (torch.bfloat16 halves it); None: as built. Adapters stay as built."""

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"LoraConfig(r={self.r!r}): expected a positive integer rank")
        if not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise ValueError(f"LoraConfig(lora_alpha={self.lora_alpha!r}): expected a positive number")
        if not isinstance(self.lora_dropout, (int, float)) or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"LoraConfig(lora_dropout={self.lora_dropout!r}): expected a probability in [0, 1)")
        targets = self.target_modules
        if not isinstance(targets, str):
            targets = tuple(targets) if targets is not None else ()
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"LoraConfig(target_modules={self.target_modules!r}): expected module names "
                                 "(e.g. ['q_proj', 'v_proj']) or one regular expression")
            object.__setattr__(self, "target_modules", targets)
        if self.base_dtype is not None and not (isinstance(self.base_dtype, torch.dtype)
                                                and self.base_dtype.is_floating_point):
            raise TypeError(f"LoraConfig(base_dtype={self.base_dtype!r}): expected a floating torch.dtype or None")

    @property
    def scaling(self) -> float:
        """The factor of B A x."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def of(cls, config: Any, base_dtype: torch.dtype | None = None) -> "LoraConfig":
        """Ours, or one read from a peft.LoraConfig (whose options beyond these must be their defaults)."""
        if isinstance(config, cls):
            return config
        if type(config).__name__ != "LoraConfig" or not hasattr(config, "target_modules"):
            raise TypeError(f"adapters={config!r}: expected a pipezero LoraConfig or a peft.LoraConfig")
        fields = {k: getattr(config, k) for k in (*_PEFT_DEFAULTS, *_PEFT_FIELDS) if hasattr(config, k)}
        return cls.from_peft_fields(fields, "peft.LoraConfig", base_dtype)

    @classmethod
    def from_peft_fields(cls, fields: Mapping[str, Any], where: str = "peft.LoraConfig",
                         base_dtype: torch.dtype | None = None) -> "LoraConfig":
        """One read from peft's LoraConfig fields (an adapter_config.json's dict): r, lora_alpha,
        lora_dropout, target_modules and use_rslora (peft's defaults where absent); every other
        option it names must be its default. `where` names the source in errors."""
        odd = {k: fields[k] for k, v in _PEFT_DEFAULTS.items()
               if k in fields and fields[k] not in (v, None if v == {} else v)}
        if odd:
            raise ValueError(f"{where} with {odd}: the pipeline's LoRA supports r, lora_alpha, lora_dropout, "
                             f"target_modules and use_rslora; set those options to their defaults {_PEFT_DEFAULTS}")
        targets = fields.get("target_modules")
        return cls(r=fields.get("r", 8), lora_alpha=fields.get("lora_alpha", 8),
                   lora_dropout=fields.get("lora_dropout", 0.0),
                   target_modules=targets if isinstance(targets, str) else tuple(sorted(targets or ())),
                   use_rslora=bool(fields.get("use_rslora", False)), base_dtype=base_dtype)

    def matches(self, name: str) -> bool:
        """Is the module of this full name a target (peft's rule)?"""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        return any(name == t or name.endswith("." + t) for t in self.target_modules)


class LoraLinear(nn.Linear):
    """A frozen nn.Linear (same `weight` and `bias`, so the same names) plus `lora_A`, `lora_B`.

    forward: base(x) + lora_B(lora_A(dropout(x))) * scaling, computed as peft computes it: the
    adapter path runs in the adapters' dtype and its sum is cast back to the base output's dtype.
    A frozen base needs only its input gradient; lora_A / lora_B are plain nn.Linear, so a
    zero-bubble schedule's W covers exactly them (pipe/deferred_linear.py).
    """

    def __init__(self, base: nn.Linear, config: LoraConfig):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        for p in self.parameters():
            p.requires_grad_(False)
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(self.in_features, config.r, bias=False, **like)
        self.lora_B = nn.Linear(config.r, self.out_features, bias=False, **like)
        self.lora_dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout else nn.Identity()
        self.scaling = config.scaling
        if base.weight.device.type != "meta":
            with torch.no_grad():
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
                nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        result = F.linear(x if x.dtype == w.dtype else x.to(w.dtype), w, self.bias)
        if "lora_A" not in self._modules:  # inside merged(): the update is in the weight
            return result
        a = self.lora_A.weight
        h = x if x.dtype == a.dtype else x.to(a.dtype)
        result = result + self.lora_B(self.lora_A(self.lora_dropout(h))) * self.scaling
        return result.to(w.dtype) if result.dtype != w.dtype and x.dtype == w.dtype else result

    def delta(self) -> torch.Tensor:
        """The update the adapters add to the weight: scaling * B A (in the adapters' dtype)."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.lora_A.out_features}, scaling={self.scaling:g}"


# -- applying -------------------------------------------------------------------------------
def _names(module: nn.Module, index: int | None) -> Iterator[tuple[str, str, nn.Module]]:
    """(path inside module, full name, submodule): the Hugging Face name for hf_layer_specs' layers
    ("model.layers.0.self_attn.q_proj"), else the pipeline's ("layers.3.qkv"; index None: the path)."""
    prefix = getattr(module, "prefix", None)
    hf = isinstance(prefix, str) and hasattr(module, "hf_parameters")
    for path, sub in module.named_modules():
        if not path:
            continue
        if hf:
            yield path, (prefix + path.removeprefix("inner").lstrip(".")).rstrip("."), sub
        else:
            yield path, path if index is None else f"layers.{index}.{path}", sub


def _targets(module: nn.Module, index: int | None, config: LoraConfig, where: str) -> list[tuple[str, str]]:
    """(path inside module, full name) of each target; ValueError for a target that cannot take one."""
    _refuse_fused(module, index, config, where)
    out = []
    for path, name, sub in _names(module, index):
        if not config.matches(name) or isinstance(sub, LoraLinear) or ".lora_" in "." + path:
            continue
        if type(sub) is not nn.Linear:
            raise ValueError(f"LoRA target {name!r} in {where} is a {type(sub).__name__}; the pipeline's LoRA adapts "
                             "nn.Linear layers only (GPT-2's Conv1D, embeddings and custom layers are not supported): "
                             "narrow target_modules to the model's nn.Linear projections")
        if config.r > min(sub.in_features, sub.out_features):
            raise ValueError(f"LoraConfig(r={config.r}) is larger than {name!r} in {where} "
                             f"({sub.out_features} x {sub.in_features}); expected r <= "
                             f"{min(sub.in_features, sub.out_features)}")
        out.append((path, name))
    return out


def _fused_experts(module: nn.Module, index: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(full name, parameter) of each stacked expert weight: a parameter of more than two dimensions held
    directly by a module that is not an nn.Linear (a MoE's fused gate_up_proj / down_proj)."""
    for _, name, sub in _names(module, index):
        if type(sub) is not nn.Linear and not isinstance(sub, LoraLinear):
            for leaf, p in sub.named_parameters(recurse=False):
                if p.dim() > 2:
                    yield f"{name}.{leaf}", p


def _refuse_fused(module: nn.Module, index: int | None, config: LoraConfig, where: str) -> None:
    """A target naming a fused expert weight (e.g. down_proj of a Qwen3-MoE): peft adapts it (as
    target_parameters) and the pipeline's LoRA cannot, so not a silent difference."""
    for name, p in _fused_experts(module, index):
        if config.matches(name):
            raise ValueError(f"LoraConfig(target_modules={config.target_modules!r}) names {name!r} in {where}, a "
                             f"{tuple(p.shape)} parameter outside nn.Linear (fused experts): peft adapts it "
                             "(target_parameters), the pipeline's LoRA adapts nn.Linear layers only; qualify the "
                             "name to the dense projections you mean (e.g. 'shared_expert.down_proj', "
                             "'self_attn.o_proj')")


def apply_lora(module: nn.Module, config: LoraConfig | Any, index: int | None = None) -> list[str]:
    """Freeze every parameter of `module` and put adapters on its targets; returns the targets' full names
    (as pipeline layer `index` names them; index None: the module's own paths, for a whole model).

    The adapters take the dtype the layer was built in; with config.base_dtype the rest is cast to it."""
    config = LoraConfig.of(config)
    if config.target_modules == ALL_LINEAR:
        raise ValueError(f"apply_lora(target_modules={ALL_LINEAR!r}): one module does not say which layer is the "
                         "output layer, which peft leaves out; use lora_specs(specs, config) (the layer list's "
                         "last layer is the output layer) or name the modules")
    targets = _targets(module, index, config, f"layer {index} ({type(module).__name__})")
    for p in module.parameters():
        p.requires_grad_(False)
    for path, _ in targets:
        parent_path, _, attr = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, attr, LoraLinear(getattr(parent, attr), config))
    if config.base_dtype is not None:
        for p in module.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(config.base_dtype)
    return [name for _, name in targets]


def _adapters(module: nn.Module, index: int | None) -> Iterator[tuple[str, LoraLinear]]:
    """(full name, LoraLinear) of each adapted projection inside a layer."""
    for _, name, sub in _names(module, index):
        if isinstance(sub, LoraLinear):
            yield name, sub


class _Adapted:
    """Mixed into a spec's copy: build() builds the inner spec, then applies the adapters."""

    inner: LayerSpec
    lora: LoraConfig
    index: int

    def build(self) -> nn.Module:
        module = self.inner.build()
        apply_lora(module, self.lora, self.index)
        return module

    def __repr__(self) -> str:
        return f"lora({self.inner!r}, r={self.lora.r})"


class _AdaptedSpec(_Adapted, LayerSpec):
    pass


class _AdaptedTiedSpec(_Adapted, TiedLayerSpec):
    pass


def lora_specs(specs: Sequence[Any], config: LoraConfig | Any) -> list[Any]:
    """The same layer list with every LayerSpec frozen and adapted (checked on meta copies, on every rank).

    A target that matches nothing, a target that is not an nn.Linear, a rank larger than a layer,
    or an adapter inside a tied layer (the embedding and the head that reuses it) is a ValueError.
    Plain modules and callables in the list are left as they are.
    """
    config = LoraConfig.of(config)
    if config.target_modules == ALL_LINEAR:
        config = _all_linear(specs, config)
    out, found, names, fused = [], 0, [], False
    for index, spec in enumerate(specs):
        if not isinstance(spec, LayerSpec):
            out.append(spec)
            continue
        with torch.device("meta"):
            module = spec.build()
        targets = _targets(module, index, config, f"layer {index} ({spec.cls.__name__})")
        names += [name for _, name, _ in _names(module, index)]
        fused = fused or next(_fused_experts(module, index), None) is not None
        if targets and isinstance(spec, TiedLayerSpec):
            raise ValueError(f"LoRA targets {[n for _, n in targets]} lie in layer {index}, a TiedLayerSpec (key "
                             f"{spec.key!r}) shared by several stages; adapt the decoder layers' projections instead")
        found += len(targets)
        cls = _AdaptedTiedSpec if isinstance(spec, TiedLayerSpec) else _AdaptedSpec
        adapted = cls.__new__(cls)
        adapted.__dict__.update(spec.__dict__)
        adapted.inner, adapted.lora, adapted.index = spec, config, index
        out.append(adapted)
    if not found:
        raise ValueError(f"LoraConfig(target_modules={config.target_modules!r}) matches no nn.Linear of the "
                         f"{len(specs)} layers; module names look like {_examples(specs)}")
    if fused:
        _refuse_expert_names(config, names)
    return out


def _refuse_expert_names(config: LoraConfig, names: list[str]) -> None:
    """On a model with fused experts, a listed name that matches no module: peft maps the experts' names of
    transformers v4 (Mixtral's w1 / w2 / w3, a Qwen-MoE's gate_proj / up_proj) onto the fused parameters, so
    it would adapt the experts where the pipeline's LoRA adapts nothing."""
    if isinstance(config.target_modules, str):
        return
    unmatched = [t for t in config.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"LoraConfig(target_modules={config.target_modules!r}): {unmatched} match no module of "
                         "this model with fused experts; peft maps such names (transformers v4's expert "
                         "projections, e.g. Mixtral's w1 / w2 / w3) onto the fused experts' parameters, the "
                         "pipeline's LoRA adapts nn.Linear layers only: leave them out")


def _all_linear(specs: Sequence[Any], config: LoraConfig) -> LoraConfig:
    """peft's "all-linear" as full names: every nn.Linear of the layer specs but the last layer's (the output
    layer, which peft leaves out: lm_head)."""
    layers = [(index, spec) for index, spec in enumerate(specs) if isinstance(spec, LayerSpec)]
    names = []
    for index, spec in layers[:-1]:
        with torch.device("meta"):
            module = spec.build()
        fused = [name for name, _ in _fused_experts(module, index)]
        if fused:
            raise ValueError(f"LoraConfig(target_modules={ALL_LINEAR!r}) on layer {index} with fused experts "
                             f"({fused[0]!r}, ...): peft's all-linear adapts them too (target_parameters), the "
                             "pipeline's LoRA adapts nn.Linear layers only; name the modules you mean (e.g. "
                             "q_proj k_proj v_proj o_proj)")
        names += [name for _, name, sub in _names(module, index) if type(sub) is nn.Linear]
    if not names:
        raise ValueError(f"LoraConfig(target_modules={ALL_LINEAR!r}) finds no nn.Linear outside the output layer "
                         f"in the {len(specs)} layers (GPT-2's Conv1D are not supported); name the modules")
    return replace(config, target_modules=tuple(names))


def _examples(specs: Sequence[Any]) -> list[str]:
    names: list[str] = []
    for index, spec in enumerate(specs):
        if isinstance(spec, LayerSpec) and len(names) < 6:
            with torch.device("meta"):
                module = spec.build()
            names += [n for _, n, m in _names(module, index) if isinstance(m, nn.Linear)][:6 - len(names)]
    return names


# -- the adapters' state ----------------------------------------------------------------------
def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that train (requires_grad): what the optimizer should be given."""
    return [p for p in module.parameters() if p.requires_grad]


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """{full name of lora_A / lora_B weight: tensor} of this rank's adapters (Hugging Face names for
    hf_layer_specs' layers, `layers.<i>.<name>` for other PipelineModule layers, the module's own
    names otherwise); the base is not in it. Tensor-parallel adapters (replicated) come back whole."""
    return {name: _whole(p.detach()) for name, p in _adapter_weights(module).items()}


def load_adapter_state_dict(module: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """Copy adapter weights in by full name (adapter_state_dict's names); returns the names loaded.

    strict: every local adapter must be in `state`, and every adapter of `state` on a local module must
    have one here (names of other stages' adapters are ignored)."""
    mine = _adapter_weights(module)
    missing = sorted(set(mine) - set(state))
    if strict and missing:
        raise ValueError(f"load_adapter_state_dict: {len(missing)} of this rank's adapters are not in the state, "
                         f"e.g. {missing[:2]}; it holds e.g. {sorted(state)[:2]}")
    if strict:
        local = {name for index, layer in _layers(module) for _, name, _ in _names(layer, index)}
        check_adapters_kept("load_adapter_state_dict", state, mine, local)
    with torch.no_grad():
        for name in set(mine) & set(state):
            if mine[name].shape != state[name].shape:
                raise ValueError(f"load_adapter_state_dict: {name!r} is {tuple(mine[name].shape)} here and "
                                 f"{tuple(state[name].shape)} in the state; expected adapters of the same rank")
            local = mine[name].to_local() if hasattr(mine[name], "to_local") else mine[name]  # tensor: replicated
            local.copy_(state[name])
    return sorted(set(mine) & set(state))


def check_adapters_kept(caller: str, names: Iterable[str], adapters: Iterable[str], modules: Iterable[str]) -> None:
    """Refuse to load adapter tensors that would be dropped: those of `names` (a state's, "<module>.lora_A.weight")
    on a module this rank holds (`modules`) that has no such adapter here (`adapters`: this rank's names).

    The one rule of every adapter loader (load_adapter_state_dict by Hugging Face names, a
    save_adapters checkpoint by the pipeline's): a q/v/down state into a q-only model is refused.
    """
    mine, local = set(adapters), set(modules)
    dropped = sorted(n for n in names if ".lora_" in n and n not in mine and n.rpartition(".lora_")[0] in local)
    if dropped:
        raise ValueError(f"{caller}: the state adapts {len(dropped)} tensors of modules this rank holds without "
                         f"adapters, e.g. {dropped[:2]}; build the model with the state's target_modules (they "
                         "would be dropped)")


def _adapter_weights(module: nn.Module) -> dict[str, nn.Parameter]:
    out = {}
    for index, layer in _layers(module):
        for name, m in _adapters(layer, index):
            out[name + ".lora_A.weight"] = m.lora_A.weight
            out[name + ".lora_B.weight"] = m.lora_B.weight
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # replicated over the tensor axis: no traffic


def _layers(module: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """(index, layer) of a PipelineModule's built layers; else its hf_layer_specs layers, or (None, module):
    a single-process model whose `layers.<i>` are the pipeline's layers (examples/gpt.py's GPT) has its names."""
    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.ModuleDict) and hasattr(module, "chunk_range"):
        for key, layer in layers.items():
            yield int(key), layer
        return
    hf = [m for m in module.modules() if isinstance(getattr(m, "prefix", None), str) and hasattr(m, "hf_parameters")]
    yield from ((0, m) for m in hf) if hf else [(None, module)]


@contextmanager
def merged(module: nn.Module) -> Iterator[nn.Module]:
    """Inside: each LoraLinear of `module` holds W + scaling * B A as its weight and no adapters
    (what a merged export writes, and the forward generation runs fastest with: one GEMM a
    projection); on exit the base weight and the adapters are put back unchanged.

    The sum is computed in the wider of the two dtypes, then rounded to the base weight's dtype."""
    saved = []
    try:
        for m in module.modules():
            if isinstance(m, LoraLinear):
                w = m.weight
                wide = torch.promote_types(w.dtype, m.lora_A.weight.dtype)
                with torch.no_grad():
                    value = (w.to(wide) + m.delta().to(wide)).to(w.dtype)
                saved.append((m, w, m._modules.pop("lora_A"), m._modules.pop("lora_B")))
                m.weight = nn.Parameter(value, requires_grad=False)
        yield module
    finally:
        for m, w, a, b in saved:
            m.weight = w
            m.lora_A, m.lora_B = a, b


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[nn.Module]:
    """Inside: each LoraLinear of `module` computes its frozen base alone (the model before
    fine-tuning, with no copy of it: GRPO's reference, train/rl/reference.py); on exit the
    same adapter modules are back. Raises when `module` holds no LoraLinear."""
    adapted = [m for m in module.modules() if isinstance(m, LoraLinear) and "lora_A" in m._modules]
    if not adapted:
        raise ValueError(f"adapters_disabled: {type(module).__name__} holds no LoraLinear with adapters; build it "
                         "from lora_specs(...) (a model without adapters is its own base)")
    saved = [(m, m._modules.pop("lora_A"), m._modules.pop("lora_B")) for m in adapted]
    try:
        yield module
    finally:
        for m, a, b in saved:
            m.lora_A, m.lora_B = a, b
