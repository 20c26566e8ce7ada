"""train/data: documents from files, tokenization and SFT masks as TRL's, the cache, packing."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from data_tokenizer import make_tokenizer
from pipezero.train.data import (IGNORE, MemoryCorpus, data_files, encode, load_tokenizer, pack, read_documents,
                                 tokenized_corpus)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_sources_read_every_format_in_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("the cat sat")
    _jsonl(tmp_path / "b" / "c.jsonl", [{"prompt": "what is two plus four", "completion": "six"}] * 2)
    pq.write_table(pa.table({"body": ["red sky", "blue sea"]}), tmp_path / "b" / "d.parquet")
    table = pa.table({"body": ["green sea"]})  # a `datasets` save_to_disk folder: Arrow stream + metadata
    with pa.OSFile(str(tmp_path / "b" / "e.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (tmp_path / "b" / "dataset_info.json").write_text("{}")
    _jsonl(tmp_path / "b" / "f.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                           {"from": "gpt", "value": "six"}]}])  # ShareGPT
    docs = list(read_documents(tmp_path / "a.txt")) + list(read_documents(tmp_path / "b", text_field="body"))
    assert [d.kind for d in docs] == ["text", "completion", "completion", "text", "text", "text", "chat"]
    assert docs[0].text == "the cat sat" and docs[2].origin.endswith("c.jsonl:2") and docs[4].text == "blue sea"
    assert docs[4].origin.endswith("d.parquet:2") and docs[5].text == "green sea"
    assert docs[6].messages == ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "six"})


def test_sft_masks_equal_trl_semantics(tok_dir):
    """prompt/completion: TRL's completion mask (EOS appended; here no token merges across the boundary:
    tests/test_data_masks.py has those, against TRL's own code); chat: transformers' own assistant mask from
    the template's {% generation %} marks (what TRL's assistant_only_loss trains on)."""
    tok = load_tokenizer(tok_dir)
    doc = next(iter(read_documents(_jsonl(tok_dir / "pc.jsonl", [{"prompt": "what is two plus four ",
                                                                   "completion": "six"}]))))
    ids, mask = encode(tok, doc)
    prompt = tok("what is two plus four ")["input_ids"]
    full = tok("what is two plus four six")["input_ids"] + [tok.eos_token_id]
    assert ids.tolist() == full and mask.tolist() == [0] * len(prompt) + [1] * (len(full) - len(prompt))
    chat = [{"role": "system", "content": "good day"}, {"role": "user", "content": "what is two plus four"},
            {"role": "assistant", "content": "six"}, {"role": "user", "content": "why"},
            {"role": "assistant", "content": "because it was"}]
    doc = next(iter(read_documents(_jsonl(tok_dir / "chat.jsonl", [{"messages": chat}]))))
    ids, mask = encode(tok, doc)
    ref = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(ref["input_ids"]) and mask.tolist() == list(ref["assistant_masks"])
    assert 0 < mask.sum() < len(mask)


def test_cache_is_built_once_and_shared(tmp_path, tok_dir, monkeypatch):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat on the mat"}, {"text": "a dog ran far"}] * 3)
    corpus = tokenized_corpus(data, tok_dir, cache_dir=tmp_path / "cache", workers=2)
    assert corpus.num_docs == 6 and corpus.meta["tokens"] == 6 * 0 + 3 * (7 + 5)
    ids, mask = corpus.doc(1)
    assert ids.tolist() == load_tokenizer(tok_dir)("a dog ran far")["input_ids"] + [2] and mask.all()
    import pipezero.train.data.cache as cache

    monkeypatch.setattr(cache, "encode_many", lambda *a, **k: pytest.fail("tokenized again"))
    again = tokenized_corpus(data, tok_dir, cache_dir=tmp_path / "cache")
    assert again.folder == corpus.folder and np.array_equal(again.tokens, corpus.tokens)
    assert corpus.label_counts().tolist() == [6, 4] * 3  # tokens past the first, all trained
    corpus.check_vocab(100)
    with pytest.raises(ValueError, match=r"d.jsonl:1: token id 16 is beyond the model's vocabulary of 5"):
        corpus.check_vocab(5)


def test_packing_rows_labels_positions_and_long_documents(caplog):
    docs = MemoryCorpus([np.arange(10, 15), (np.arange(20, 24), [0, 0, 1, 1]), np.arange(30, 43)])
    with caplog.at_level(logging.WARNING, logger="pipezero"):
        layout = pack(docs, seq_len=8)
    assert "1 of 3 documents are longer than seq_len=8" in caplog.text
    rows = [layout.row(r, docs) for r in range(layout.num_rows)]
    assert [r.ids.tolist() for r in rows] == [[10, 11, 12, 13, 14, 0, 0, 0], [20, 21, 22, 23, 0, 0, 0, 0],
                                              [30, 31, 32, 33, 34, 35, 36, 37], [38, 39, 40, 41, 42, 0, 0, 0]]
    assert rows[0].labels.tolist() == [11, 12, 13, 14, IGNORE, IGNORE, IGNORE, IGNORE]
    assert rows[1].labels.tolist() == [IGNORE, 22, 23, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]  # SFT mask
    assert rows[0].positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2] and rows[0].segments.tolist() == [0] * 5 + [1] * 3
    assert layout.trained_tokens(docs).tolist() == [4, 2, 7, 4] and layout.efficiency() == 22 / 32
    short = pack(MemoryCorpus([np.arange(3), np.arange(4)]), seq_len=8)
    assert short.num_rows == 1 and short.row(0, None if False else MemoryCorpus([np.arange(3), np.arange(4)])) \
        .segments.tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    cut = pack(docs, seq_len=8, long_docs="truncate", packing=False)
    assert [cut.row_length(r) for r in range(cut.num_rows)] == [5, 4, 8]
    gen = np.random.default_rng(0)
    many = MemoryCorpus([(gen.integers(0, 9, n), gen.random(n) > 0.3) for n in gen.integers(2, 40, 100)])
    for layout in (pack(many, 16), pack(many, 16, packing=False, long_docs="truncate")):
        assert layout.trained_tokens(many).tolist() == [int((layout.row(r, many).labels != IGNORE).sum())
                                                        for r in range(layout.num_rows)]


def test_a_dataset_dict_folder_is_refused_naming_its_splits(tmp_path):
    """A DatasetDict's save_to_disk folder holds train and test: read whole, the test split was trained on."""
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        _jsonl(tmp_path / split / "data.jsonl", [{"text": f"a {split} row"}])
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match=r"DatasetDict with the splits \['train', 'test'\].*--data '.*/train'"):
        data_files(tmp_path)
    assert [d.text for d in read_documents(tmp_path / "train")] == ["a train row"]


@pytest.mark.parametrize("name, content, words", [
    ("x.jsonl", '{"text": "the cat"}\n{"body": "a dog"}\n', ["x.jsonl:2", "'text'", "--text-field"]),
    ("e.jsonl", "", ["e.jsonl", "empty"]),
    ("b.txt", b"\x00\x01\x02binary", ["b.txt", "binary"]),
    ("j.jsonl", '{"text": "ok"}\n{oops\n', ["j.jsonl:2", "not valid JSON"]),
    ("c.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n', ["c.jsonl:1", "no assistant turn"]),
])
def test_bad_documents_name_file_line_and_fix(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as err:
        list(read_documents(path))
    for word in words:
        assert word in str(err.value)


def test_chat_without_template_and_one_token_documents_are_refused(tmp_path, tok_dir):
    plain = make_tokenizer(tmp_path / "plain", chat=False)
    chat = _jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "six"}]}])
    with pytest.raises(ValueError, match=r"c.jsonl:1: a chat record, but the tokenizer has no chat template"):
        tokenized_corpus(chat, plain, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"raised while tokenizing"):  # a waiting rank: the same error, no hang
        os.environ["LOCAL_RANK"] = "1"
        try:
            tokenized_corpus(chat, plain, cache_dir=tmp_path / "cache", wait_s=5)
        finally:
            del os.environ["LOCAL_RANK"]
    one = _jsonl(tmp_path / "one.jsonl", [{"text": "the cat"}, {"text": "<eos>"}])
    with pytest.raises(ValueError, match=r"one.jsonl:2: tokenizes to 1 token"):
        tokenized_corpus(one, tok_dir, cache_dir=tmp_path / "cache")


def test_a_dead_builders_lock_is_taken_over(tmp_path, tok_dir):
    """A builder killed mid-build (a preempted job: SIGTERM runs no `finally`) leaves its lock; the rerun's
    LOCAL_RANK 0 used to wait for it until wait_s (two hours by default) and then fail. A live builder's
    lock, or another host's, is still waited for."""
    import socket
    import subprocess
    import sys

    from pipezero.train.data import cache_key

    data = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}, {"text": "a dog ran"}])
    lock = tmp_path / "cache" / f"{cache_key(data, tok_dir)}.lock"
    lock.parent.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid}))
    assert tokenized_corpus(data, tok_dir, cache_dir=tmp_path / "cache", wait_s=5).num_docs == 2
    assert not lock.exists()
    other = _jsonl(tmp_path / "e.jsonl", [{"text": "red sky"}, {"text": "blue sea"}])
    lock = lock.with_name(f"{cache_key(other, tok_dir)}.lock")
    for holder in ({"host": socket.gethostname(), "pid": os.getppid()}, {"host": "elsewhere", "pid": gone.pid}):
        lock.write_text(json.dumps(holder))
        with pytest.raises(TimeoutError, match="another process builds"):
            tokenized_corpus(other, tok_dir, cache_dir=tmp_path / "cache", wait_s=0.3)


def test_an_earlier_launchs_error_does_not_stop_the_rerun(tmp_path, tok_dir):
    """A build that failed for a reason of its own (^C, a killed tokenizer worker) leaves its error file for
    the waiting ranks; the rerun's waiting ranks used to raise that old error before their LOCAL_RANK 0
    removed it and built the corpus. Now they wait for this launch's build; this launch's errors still stop
    them (test_chat_without_template_and_one_token_documents_are_refused)."""
    import socket
    import time

    from pipezero.train.data import cache_key

    data = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}, {"text": "a dog ran"}])
    error = tmp_path / "cache" / f"{cache_key(data, tok_dir)}.error"
    error.parent.mkdir()
    error.write_text(json.dumps({"host": socket.gethostname(), "time": time.time() - 3600}) +
                     "\nRuntimeError\nKeyboardInterrupt: ")
    waiter, got = _waiting_rank(data, tok_dir, tmp_path / "cache", wait_s=30)
    assert tokenized_corpus(data, tok_dir, cache_dir=tmp_path / "cache").num_docs == 2  # LOCAL_RANK 0 builds
    waiter.join(30)
    assert got == {"docs": 2}, got


def _waiting_rank(data, tok_dir, cache, wait_s: float):
    """A LOCAL_RANK 1 asking for the corpus in a thread, once it has read its rank: (thread, its result)."""
    import threading
    import time

    got = {}

    def wait():
        try:
            got["docs"] = tokenized_corpus(data, tok_dir, cache_dir=cache, wait_s=wait_s).num_docs
        except Exception as err:  # noqa: BLE001 - reported by the caller's assert
            got["error"] = err
    os.environ["LOCAL_RANK"] = "1"
    try:
        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.5)  # the waiting rank has read its LOCAL_RANK and looks first
    finally:
        del os.environ["LOCAL_RANK"]
    return waiter, got


def test_the_waiting_ranks_wait_for_a_long_build_while_the_builder_makes_progress(tmp_path, tok_dir):
    """A corpus may take hours to tokenize: the waiting ranks used to give up after a fixed wait_s (two
    hours). Now they give up only after wait_s without a touch of the lock (the builder touches it as
    documents come out of the tokenizer): here a build lasting well past wait_s is waited for; an
    untouched lock still times out (test_a_dead_builders_lock_is_taken_over)."""
    import time

    from pipezero.train.data import cache_key
    from pipezero.train.data.cache import _Beat

    data = _jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}, {"text": "a dog ran"}])
    lock = tmp_path / "cache" / f"{cache_key(data, tok_dir)}.lock"
    lock.parent.mkdir()
    lock.write_text("{}")  # this process plays the builder: it holds the lock
    waiter, got = _waiting_rank(data, tok_dir, tmp_path / "cache", wait_s=1.5)
    beat = _Beat(lock, every_s=0.1)
    for _ in range(40):  # a long build (4 s, well past wait_s), documents coming out all along
        time.sleep(0.1)
        beat()
    lock.unlink()
    assert tokenized_corpus(data, tok_dir, cache_dir=tmp_path / "cache").num_docs == 2
    waiter.join(30)
    assert got == {"docs": 2}, got


def test_unpacked_rows_report_the_padding_their_batches_carry():
    """--no-packing pads each micro-batch to its longest row; its efficiency was reported as 100.0%.
    Now it is the real tokens over the slots of the epoch's padded batches, counted here from the batches."""
    from pipezero.train.data import PackedBatches

    lengths = [2, 8, 4, 4, 6, 2, 8, 3]
    corpus = MemoryCorpus([np.arange(n) for n in lengths])
    layout = pack(corpus, 8, packing=False)
    for pad in ("microbatch", "step"):
        ranks = [PackedBatches(layout, corpus, 4, 2, data_rank=r, data_degree=2, seed=3, pad=pad) for r in range(2)]
        slots = 0
        for rank in ranks:  # one epoch: one step of 2 ranks x 4 rows
            inputs, _ = rank.next_batch()
            slots += sum(i[0].numel() for i in inputs) if pad == "microbatch" else inputs[0].numel()
        assert ranks[0].efficiency() == pytest.approx(sum(lengths) / slots) and slots > sum(lengths)
    packed = PackedBatches(pack(corpus, 8), corpus, batch_size=1)
    assert packed.efficiency() == pack(corpus, 8).efficiency()
