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
