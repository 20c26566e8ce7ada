"""train/data/masks.py: the SFT loss masks equal TRL 1.16's own, token for token.

The reference is TRL's own preparation, `SFTTrainer._prepare_dataset` (what SFTTrainer's
constructor runs on a dataset: EOS added, prompt/completion or chat tokenized, labels built), called on
the same records with the same tokenizer, with the options SFTTrainer's constructor sets:
completion-only loss for prompt/completion, assistant-only loss for chats (a template without
`{% generation %}` marks swapped for TRL's training variant, as its constructor does). The mask
compared is TRL's `labels != -100`. The tokenizer is a byte-level BPE trained here (tests/data_tokenizer.py),
so "ret" + "urn" merge into "return" as in GPT-2's; the templates are TRL's own files.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from data_tokenizer import make_bpe_tokenizer
from pipezero.train.data import encode, load_tokenizer, read_documents

trl = pytest.importorskip("trl")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"

CHATS = [
    [{"role": "user", "content": "what is two plus four"}, {"role": "assistant", "content": "six"},
     {"role": "user", "content": "why"}, {"role": "assistant", "content": "return None"}],
    [{"role": "system", "content": "the cat"}, {"role": "user", "content": "what"},
     {"role": "assistant", "content": "six"}],
    [{"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "what"},  # assistant first
     {"role": "assistant", "content": "six"}],
]


@pytest.fixture(scope="module")
def trl_sft(tmp_path_factory):
    """TRL 1.16's SFT preparation of `records`: [(input_ids, mask)] (mask: labels != -100)."""
    from datasets import Dataset
    from trl import SFTConfig
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    from trl.trainer.sft_trainer import SFTTrainer

    out = tmp_path_factory.mktemp("trl")

    def prepare(tok, records: list[dict]) -> list[tuple[list[int], list[int]]]:
        chat = "messages" in records[0]
        args = SFTConfig(output_dir=str(out), assistant_only_loss=chat, max_length=None, use_cpu=True, bf16=False,
                         report_to=[])
        swap = get_training_chat_template(tok) if chat and not has_generation_markers(tok.chat_template) else None
        trainer = SimpleNamespace(_tokenizer=tok, completion_only_loss="prompt" in records[0], chat_template=swap)
        rows = SFTTrainer._prepare_dataset(trainer, Dataset.from_list(records), tok, args, False, None, "train")
        return [(row["input_ids"], [int(label != -100) for label in row["labels"]]) for row in rows]
    return prepare


def _ours(tok, folder: Path, records: list[dict]) -> list[tuple[list[int], list[int]]]:
    path = folder / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [tuple(a.tolist() for a in encode(tok, doc)) for doc in read_documents(path)]


def test_prompt_completion_masks_equal_trls_where_boundary_tokens_merge(tmp_path, trl_sft):
    """The completion starts where the tokenized prompt and prompt + completion first differ: with
    prompt "...: ret" and completion "urn None", "return" and "None" are trained (the prompt's own
    token count left only EOS trained before)."""
    tok = load_tokenizer(make_bpe_tokenizer(tmp_path / "bpe"))
    records = [{"prompt": "def f(x): ret", "completion": "urn None"}, {"prompt": "if x: ", "completion": "return x"},
               {"prompt": "what is two plus four", "completion": " six"}]
    ours = _ours(tok, tmp_path, records)
    assert ours == trl_sft(tok, records)
    ids, mask = ours[0]
    assert tok.convert_ids_to_tokens([t for t, m in zip(ids, mask) if m]) == ["Ġreturn", "ĠNone", "<|endoftext|>"]
    text = [{"text": "def f(x): return None"}, {"text": "the cat sat<|endoftext|>"}]
    assert _ours(tok, tmp_path, text) == trl_sft(tok, text)


@pytest.mark.parametrize("template", ["qwen2_5_training", "llama3_training", "qwen2_5_vl", "llama3"])
def test_chat_masks_equal_trls_with_its_own_templates(tmp_path, trl_sft, template):
    """Marked templates (TRL's training variants: qwen2_5's trains the newline after the role, which the
    generation prompt holds) take transformers' own mask; unmarked ones (qwen2_5_vl and llama3, which TRL
    swaps for their training variants) the rendered one. Assistant-first chats train no header, and
    no default system prompt (qwen2_5's and qwen2_5_vl's), as transformers' mask."""
    tok = load_tokenizer(make_bpe_tokenizer(tmp_path / "bpe", (TEMPLATES / f"{template}.jinja").read_text()))
    records = [{"messages": chat} for chat in CHATS]
    ours, theirs = _ours(tok, tmp_path, records), trl_sft(tok, records)
    assert [ids for ids, _ in ours] == [ids for ids, _ in theirs]
    assert [mask for _, mask in ours] == [mask for _, mask in theirs]
    ids, mask = ours[2]
    header = "<|im_start|>system" if "qwen" in template else "<|start_header_id|>assistant"
    assert header in tok.decode(ids) and header not in tok.decode([t for t, m in zip(ids, mask) if m])
