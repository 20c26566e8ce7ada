"""The fault catalogue's broken Hugging Face checkpoints: each must be refused by hf_layer_specs (before
any layer is built, so on every rank alike) naming the file, the tensor and the config field.

A tiny Llama (vocab 96, hidden 32, MLP 48, 4 heads of 8, 2 KV heads: distinct sizes, so the field
behind a size is unambiguous) is saved once as one file and once in shards; each case copies one,
breaks it as downloads and hand edits break them, and reads it.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from catalogue import Case

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@functools.cache
def _saved(sharded: bool) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    path = Path(tempfile.mkdtemp(prefix="pz-hf-")) / ("sharded" if sharded else "single")
    model.save_pretrained(path, max_shard_size="60KB" if sharded else "1GB")
    if sharded:  # two shards exactly, named as the cases name them
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [SHARD_1, SHARD_2], index
    return path


def _broken(edit: Callable[[Path], object], sharded: bool = False, build: bool = False):
    def run(tmp: Path):
        from pipezero.pipe.hf import hf_layer_specs

        path = tmp / "ckpt"
        shutil.copytree(_saved(sharded), path)
        edit(path)
        specs = hf_layer_specs(str(path))
        if build:  # every layer built in one process, reading every tensor
            from pipezero.pipe import PipelineModule
            from pipezero.topology import Grid
            return PipelineModule(specs, Grid(pipe=1))
        return specs
    return run


def _config(**edit):
    def apply(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **edit}))
    return apply


def _truncate(name: str, keep: float | int):
    def apply(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    return apply


def _index(edit: Callable[[dict], object]):
    def apply(path: Path) -> None:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        edit(index)
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return apply


def _move(name: str, to: str):
    return _index(lambda index: index["weight_map"].__setitem__(name, to))


def _drop_tensor(name: str):
    def apply(path: Path) -> None:
        from safetensors.torch import load_file, save_file
        state = load_file(path / "model.safetensors")
        del state[name]
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return apply


def _reshape_tensor(name: str, shape: tuple[int, ...]):
    def apply(path: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file
        state = load_file(path / "model.safetensors")
        state[name] = torch.zeros(shape)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return apply


def _write(name: str, data: bytes):
    return lambda path: (path / name).write_bytes(data)


def _remove(*names: str):
    return lambda path: [(path / n).unlink() for n in names]


E, Q = "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"
GATE, HEAD = "model.layers.0.mlp.gate_proj.weight", "lm_head.weight"


def _hf(name: str, edit, words: tuple[str, ...], sharded: bool = False, build: bool = False) -> Case:
    return Case("hf", name, _broken(edit, sharded, build), words)


HF = [
    # damaged files
    _hf("single file truncated to half", _truncate("model.safetensors", 0.5), ("model.safetensors", "truncated")),
    _hf("single file truncated inside its header", _truncate("model.safetensors", 50), ("model.safetensors",
                                                                                         "not a readable safetensors")),
    _hf("single file empty", _write("model.safetensors", b""), ("model.safetensors", "0 bytes")),
    _hf("single file not safetensors", _write("model.safetensors", b"PK\x03\x04" + b"\0" * 64),
        ("model.safetensors", "not a readable safetensors")),
    _hf("first shard truncated", _truncate(SHARD_1, 0.7), (SHARD_1, "truncated"), sharded=True),
    _hf("second shard truncated", _truncate(SHARD_2, 0.9), (SHARD_2, "truncated"), sharded=True),
    _hf("a shard missing", _remove(SHARD_2), (SHARD_2, "not in", "fetch every shard"), sharded=True),
    # the index
    _hf("index maps a tensor to the other shard", _move(E, SHARD_2), (E, SHARD_2, "does not hold it", SHARD_1),
        sharded=True),
    _hf("index maps the head to the wrong shard", _move(HEAD, SHARD_1), (HEAD, "does not hold it"), sharded=True),
    _hf("index maps a tensor to a shard that does not exist", _move(Q, "model-00003-of-00003.safetensors"),
        ("model-00003-of-00003.safetensors", Q, "not in"), sharded=True),
    _hf("index not JSON", _write("model.safetensors.index.json", b"{weight_map"),
        ("model.safetensors.index.json", "not a shard index"), sharded=True),
    _hf("index without weight_map", _write("model.safetensors.index.json", b'{"metadata": {}}'),
        ("model.safetensors.index.json", "weight_map"), sharded=True),
    _hf("index weight_map a list", _write("model.safetensors.index.json", b'{"weight_map": ["a"]}'),
        ("model.safetensors.index.json", "weight_map"), sharded=True),
    _hf("index names a tensor no shard holds", _index(lambda i: i["weight_map"].__setitem__("x.weight", SHARD_1)),
        ("'x.weight'", SHARD_1, "does not hold it"), sharded=True),
    _hf("index lost a tensor", _index(lambda i: i["weight_map"].pop(GATE)), ("lacks 1 tensors", GATE), sharded=True),
    # config.json against the weights
    _hf("config hidden size doubled", _config(hidden_size=64), (E, "model.safetensors", "config.hidden_size=64")),
    _hf("config vocabulary larger", _config(vocab_size=128), (E, "(96, 32)", "config.vocab_size=128")),
    _hf("config MLP width changed", _config(intermediate_size=40), (GATE, "config.intermediate_size=40")),
    _hf("config KV heads changed", _config(num_key_value_heads=4),
        ("k_proj.weight", "(16, 32)", "config.head_dim=8 x config.num_key_value_heads=4")),
    _hf("config head dim changed", _config(head_dim=16), (Q, "config.head_dim=16")),
    _hf("config more layers than stored", _config(num_hidden_layers=3),
        ("lacks", "model.layers.2", "num_hidden_layers=3", "holds 2 layers")),
    _hf("config sizes of another sharded model", _config(hidden_size=48, intermediate_size=32),
        ("model-0000", "config.hidden_size=48"), sharded=True),
    _hf("config not JSON", _write("config.json", b"{hidden"), ("config.json",)),
    _hf("config of an unknown model type", _config(model_type="nope"), ("nope",)),
    _hf("config without a model type", _config(model_type=None), ("config.json",)),
    # the weights against the model
    _hf("a tensor missing", _drop_tensor(Q), ("lacks 1 tensors", Q)),
    _hf("the final norm missing", _drop_tensor("model.norm.weight"), ("lacks 1 tensors", "model.norm.weight")),
    _hf("a tensor of another shape", _reshape_tensor(GATE, (48, 16)), (GATE, "(48, 16)", "config.hidden_size=32")),
    _hf("a tensor of another rank", _reshape_tensor("model.norm.weight", (32, 1)), ("model.norm.weight", "(32, 1)")),
    _hf("no weights at all", _remove("model.safetensors"), ("holds no model.safetensors",)),
    _hf("no config.json", _remove("config.json"), ("no config.json", "save_pretrained")),
]


def _source(obj):
    def run():
        from pipezero.pipe.hf import hf_layer_specs
        return hf_layer_specs(obj)
    return run


def _export_plain(tmp: Path):
    from torch import nn

    from pipezero.train.checkpoint.hf_export import export_hf
    return export_hf(nn.Linear(2, 2), tmp / "out")


SOURCES = [
    Case("hf", "source a number", _source(42), ("checkpoint directory", "PreTrainedModel")),
    Case("hf", "source a dict", _source({"hidden_size": 32}), ("PretrainedConfig",)),
    Case("hf", "source a file, not a folder", lambda tmp: _source(str(Path(__file__)))(), ("no config.json",)),
    Case("hf", "export of a module of no hf layer", _export_plain, ("Linear", "hf_layer_specs")),
]

ALL = HF + SOURCES


@functools.cache
def _saved_moe() -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    path = Path(tempfile.mkdtemp(prefix="pz-hf-moe-"))
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return path


def _moe(edit):
    def run(tmp: Path):
        from pipezero.pipe import PipelineModule
        from pipezero.pipe.hf import hf_layer_specs
        from pipezero.topology import Grid
        path = tmp / "moe"
        shutil.copytree(_saved_moe(), path)
        edit(path)
        return PipelineModule(hf_layer_specs(str(path)), Grid(pipe=1))
    return run


MOE = [
    Case("hf", "moe config MLP width changed", _moe(_config(intermediate_size=40)),
         ("experts.gate_up_proj", "(4, 96, 32)", "config.intermediate_size=40")),
    Case("hf", "moe config more experts than stored", _moe(_config(num_local_experts=6)),
         ("gate.weight", "(4, 32)", "config.num_local_experts=6")),
]

ALL += MOE


@functools.cache
def _saved_gpt2() -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=64)
    path = Path(tempfile.mkdtemp(prefix="pz-hf-gpt2-"))
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def _gpt2(edit):
    def run(tmp: Path):
        from pipezero.pipe.hf import hf_layer_specs
        path = tmp / "gpt2"
        shutil.copytree(_saved_gpt2(), path)
        edit(path)
        return hf_layer_specs(str(path))
    return run


GPT2 = [  # issue 28 round 3: GPT-2's size fields (n_inner, n_positions) were not among those named
    Case("hf", "gpt2 config MLP width set", _gpt2(_config(n_inner=64)), ("c_fc.weight", "(32, 128)", "config.n_inner=64")),
    Case("hf", "gpt2 config fewer positions", _gpt2(_config(n_positions=48)), ("wpe.weight", "config.n_positions=48")),
]

ALL += GPT2
