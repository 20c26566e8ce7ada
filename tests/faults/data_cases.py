"""The fault catalogue's data cases (pipezero.train.data and the fine-tuning job): each bad input
and the words its error must contain: the file, the line where there is one, and the fix.

Every check here is pure (it reads files, no collective), so it raises alike on every rank;
a rank that waits for another's tokenization raises the builder's own error (tests/test_data_sources.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from catalogue import Case


def _write(tmp: Path, name: str, data: bytes | str) -> Path:
    path = tmp / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _documents(name: str, data: bytes | str, **kw):
    def read(tmp: Path):
        from pipezero.train.data import read_documents
        return list(read_documents(_write(tmp, name, data), **kw))
    return read


def _tokens(name: str, data: bytes | str):
    def load(tmp: Path):
        from pipezero.train.data import load_tokens
        return load_tokens(_write(tmp, name, data))
    return load


def _negative_ids(tmp: Path):
    import numpy as np

    from pipezero.train.data import load_tokens
    np.save(tmp / "neg.npy", -np.ones(8, dtype=np.int64))
    return load_tokens(tmp / "neg.npy")


def _tokenized(name: str, records: list, chat: bool = True):
    def build(tmp: Path):
        from data_tokenizer import make_tokenizer
        from pipezero.train.data import tokenized_corpus
        model = make_tokenizer(tmp / "tok", chat=chat)
        data = _write(tmp, name, "".join(json.dumps(r) + "\n" for r in records))
        return tokenized_corpus(data, model, cache_dir=tmp / "cache")
    return build


def _damaged_cache(damage):
    """A corpus built, then its cache folder damaged by `damage(folder)`, then asked for again."""
    def run(tmp: Path):
        corpus = _tokenized("d.jsonl", [{"text": "the cat sat on the mat"}, {"text": "a dog ran far"}] * 4)(tmp)
        damage(corpus.folder)
        return _tokenized("d.jsonl", [{"text": "the cat sat on the mat"}, {"text": "a dog ran far"}] * 4)(tmp)
    return run


def _zero_half(folder: Path):  # the same size, half the ids zeroed: trained on without a word before
    raw = bytearray((folder / "tokens.bin").read_bytes())
    raw[:len(raw) // 2] = bytes(len(raw) // 2)
    (folder / "tokens.bin").write_bytes(bytes(raw))


def _truncate(folder: Path):  # numpy's "mmap length is greater than file size" before
    raw = (folder / "tokens.bin").read_bytes()
    (folder / "tokens.bin").write_bytes(raw[:len(raw) - 8])


def _disk_full(tmp: Path):
    import errno
    from unittest import mock

    from data_tokenizer import make_tokenizer
    from pipezero.train.data import tokenized_corpus
    data = _write(tmp, "d.jsonl", json.dumps({"text": "the cat sat"}) + "\n")
    full = OSError(errno.ENOSPC, "No space left on device")
    with mock.patch("pipezero.train.data.cache.np.save", side_effect=full):
        return tokenized_corpus(data, make_tokenizer(tmp / "tok"), cache_dir=tmp / "my-cache")


def _model_without_tokenizer(tmp: Path):
    """A model directory of weights only: the good message came inside each worker's traceback, then
    BrokenProcessPool; it is raised once, in the parent, before any worker starts."""
    from pipezero.train.data import tokenized_corpus
    model = tmp / "model"
    model.mkdir()
    _write(model, "config.json", "{}")
    data = _write(tmp, "d.jsonl", json.dumps({"text": "the cat sat"}) + "\n")
    return tokenized_corpus(data, model, cache_dir=tmp / "cache", workers=1)


def _vocab(tmp: Path):
    _tokenized("v.jsonl", [{"text": "the cat sat"}])(tmp).check_vocab(4)


def _parquet_without_field(tmp: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pipezero.train.data import read_documents
    pq.write_table(pa.table({"body": ["red sky"]}), tmp / "d.parquet")
    return list(read_documents(tmp / "d.parquet"))


def _pack(**kw):
    def run():
        from pipezero.train.data import MemoryCorpus, pack
        return pack(MemoryCorpus([[1, 2, 3]]), **kw)
    return run


def _finetune(*argv: str):
    def run(tmp: Path):
        from pipezero.train.finetune import main
        return main([a.replace("TMP", str(tmp)) for a in argv])
    return run


def _unwritable_out(tmp: Path):
    from pipezero.train.finetune import main
    _write(tmp, "file", "x")
    return main(["--out", str(tmp / "file" / "run")])


def _out_model_a_file(tmp: Path):
    from pipezero.train.finetune import main
    (tmp / "run").mkdir()
    _write(tmp, "run/model", "x")  # export_hf's folder: found only after training before issue 28's round 3
    return main(["--out", str(tmp / "run"), "--steps", "1"])


def _resume_global_batch():
    from pipezero.train.data import GlobalOrder
    GlobalOrder(100, 4).load_state_dict({"epoch": 0, "step": 3, "global_batch": 8})


def _microbatches_do_not_divide():
    from pipezero.train.data import MemoryCorpus, PackedBatches, pack
    corpus = MemoryCorpus([[1, 2, 3]] * 8)
    PackedBatches(pack(corpus, 4), corpus, batch_size=3, num_microbatches=2)


CASES = [
    Case("data", "jsonl line without the field", _documents("x.jsonl", '{"text": "a"}\n{"body": "b"}\n'),
         ("x.jsonl:2", "'text'", "--text-field")),
    Case("data", "jsonl text not a string", _documents("n.jsonl", '{"text": "a"}\n{"text": 42}\n'),
         ("n.jsonl:2", "'text' is int (42)", "a string")),
    Case("data", "jsonl line not json", _documents("j.jsonl", '{"text": "a"}\n{oops\n'), ("j.jsonl:2", "valid JSON")),
    Case("data", "jsonl empty", _documents("e.jsonl", ""), ("e.jsonl", "empty")),
    Case("data", "text file empty", _documents("e.txt", "  \n"), ("e.txt", "empty")),
    Case("data", "binary file", _documents("b.txt", b"\x00\x01\x02\x03"), ("b.txt", "binary")),
    Case("data", "not utf-8", _documents("l.txt", b"caf\xe9"), ("l.txt", "not UTF-8", "iconv")),
    Case("data", "prompt without completion", _documents("p.jsonl", '{"prompt": "a", "completion": "b"}\n'
                                                                     '{"prompt": "a", "completion": 3}\n'),
         ("p.jsonl:2", "'prompt' and 'completion'")),
    Case("data", "chat without assistant", _documents("c.jsonl", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}]}) + "\n"), ("c.jsonl:1", "no assistant turn")),
    Case("data", "chat messages malformed", _documents("m.jsonl", json.dumps(
        {"messages": [{"role": "assistant", "content": "x"}]}) + "\n" + json.dumps({"messages": "hi"}) + "\n"),
         ("m.jsonl:2", "'messages'")),
    Case("data", "parquet without the field", _parquet_without_field, ("d.parquet:1", "'text'", "--text-field")),
    Case("data", "pre-tokenized file inside --data", _documents("t.npy", b"\x93NUMPY"), ("t.npy", "--data-path")),
    Case("data", "chat template missing", _tokenized("c.jsonl", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "six"}]}], chat=False),
         ("c.jsonl:1", "no chat template", "prompt/completion")),
    Case("data", "one-token document", _tokenized("o.jsonl", [{"text": "the cat"}, {"text": "<eos>"}]),
         ("o.jsonl:2", "1 token")),
    Case("data", "chat turn content null", _documents("n.jsonl", json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}) + "\n"),
         ("n.jsonl:1", "messages[1]", "'assistant'", "null")),
    Case("data", "token cache with half its ids zeroed", _damaged_cache(_zero_half),
         ("tokenized corpus", "cache/", "tokens.bin", "sha256", "rm -r", "rebuild")),
    Case("data", "token cache truncated", _damaged_cache(_truncate),
         ("tokenized corpus", "cache/", "tokens.bin", "bytes expected", "rm -r", "rebuild")),
    Case("data", "disk full in the cache folder", _disk_full, ("my-cache", "No space left", "--cache-dir")),
    Case("data", "model directory without a tokenizer", _model_without_tokenizer,
         ("model: no tokenizer files", "save_pretrained")),
    Case("data", "ids beyond the vocabulary", _vocab, ("v.jsonl:1", "beyond the model's vocabulary of 4")),
    Case("data", "data-path empty", _tokens("e.bin", b""), ("e.bin", "empty")),
    Case("data", "data-path one token", _tokens("one.txt", b"x"), ("one.txt", "1 token", "at least 2")),
    Case("data", "data-path ids of a larger vocabulary", _tokens("gpt2.bin", b"\x10\x27" * 8),  # 10000 as uint16
         ("gpt2.bin", "[10000, 10000]", "in [0, 256)", "--data TEXT")),  # the fix offered was a --data .bin: refused
    Case("data", "data-path negative ids", _negative_ids, ("neg.npy", "[-1, -1]", "in [0, 256)")),
    Case("data", "data-path npy not numpy", _tokens("fake.npy", b"hello, not an array"),
         ("fake.npy", "not a NumPy .npy file", "numpy.save")),
    Case("data", "long documents policy unknown", _pack(seq_len=8, long_docs="drop"), ("long_docs='drop'",)),
    Case("data", "rows shorter than two tokens", _pack(seq_len=1), ("seq_len=1",)),
    Case("data", "resume with another global batch", _resume_global_batch, ("global_batch=8", "this run 4")),
    Case("data", "micro-batches do not divide the batch", _microbatches_do_not_divide,
         ("batch_size=3", "num_microbatches=2")),
    Case("finetune", "out not writable", _unwritable_out, ("--out", "not writable")),
    Case("finetune", "out/model a file", _out_model_a_file, ("'model'", "move the file away")),
    Case("finetune", "seq-len beyond the positions", _finetune("--out", "TMP/o", "--seq-len", "5000"),
         ("--seq-len 5000", "1024 positions")),
    Case("finetune", "data without a model", _finetune("--out", "TMP/o", "--data", "TMP", "--seq-len", "64"),
         ("needs --model DIR",)),
]
