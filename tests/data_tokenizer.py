"""A tiny word-level tokenizer built locally (the `tokenizers` library), saved as a model directory.

Nothing is downloaded: the vocabulary is the words of a fixed text plus the chat roles, and the
chat template marks the assistant turns with {% generation %} so transformers' own
return_assistant_tokens_mask (what TRL's assistant-only loss reads) can serve as the reference.
"""

from __future__ import annotations

from pathlib import Path

WORDS = ("the a cat dog sat on mat ran far and then it was good bad day night what is two plus four six "
         "answer question why because red blue green sky sea").split()
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] == 'assistant' %}<assistant> {% generation %}{{ m['content'] }} <eot>"
                 "{% endgeneration %}"
                 "{% else %}<{{ m['role'] }}> {{ m['content'] }} <eot>{% endif %} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def make_tokenizer(folder: Path, chat: bool = True) -> Path:
    """Save a PreTrainedTokenizerFast to `folder` (with a chat template unless chat=False); return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>", "<eot>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": specials[4:]})
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return folder


BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_BPE_TEXT = ["def f(x): return None", "if x: return x", "ret", "urn", "return the answer", "None of it",
             "system user assistant", "the cat sat on the mat", "what is two plus four", "six"]


def make_bpe_tokenizer(folder: Path, chat_template: str | None = None) -> Path:
    """A byte-level BPE tokenizer trained here on a few lines (GPT-2's kind: "ret" + "urn" merge into
    "return"), ChatML's special tokens, `chat_template` if given; saved to `folder`, returned."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.train_from_iterator(_BPE_TEXT * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=BPE_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  bos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": BPE_SPECIALS[1:]})
    if chat_template is not None:
        tok.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return folder
