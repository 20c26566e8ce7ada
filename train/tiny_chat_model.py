"""A tiny Llama, its tokenizer (with a chat template) and chat data, to try `pipezero finetune` on a laptop.

    python -m pipezero.train.tiny_chat_model runs/tiny   # runs/tiny/model, runs/tiny/chats.jsonl, chat.jinja

Nothing is downloaded: the tokenizer is word-level over a few words (the `tokenizers` library),
the model random (2 layers, hidden 64), the chats 400 two-turn questions and answers.
chat.jinja is another chat template (a system line first) for --chat-template. In the package
(not examples/) so that the README's fine-tuning commands run from the wheel too. Needs the hf
extra: pip install "pipezero[hf]".
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

__all__ = ["main", "tokenizer"]

WORDS = "the a cat dog sat on mat ran far and then it was good bad day night what is red blue sky sea".split()
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> "
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eot>{% endgeneration %}"
            "{% else %}{{ m['content'] }} <eot>{% endif %} {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
OTHER = TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}<system> the sky is blue <eot> ")


def tokenizer(folder: Path) -> int:
    """A word-level tokenizer with TEMPLATE, saved to `folder`; its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>", "<system>", "<eot>"]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + WORDS)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=specials[4:])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return len(tok)


def main(root: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    vocab = tokenizer(root / "model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    r = random.Random(0)
    with open(root / "chats.jsonl", "w") as f:
        for _ in range(400):
            chat = [{"role": "user", "content": " ".join(r.choices(WORDS, k=6))},
                    {"role": "assistant", "content": " ".join(r.choices(WORDS, k=r.randint(2, 8)))}]
            f.write(json.dumps({"messages": chat}) + "\n")
    (root / "chat.jinja").write_text(OTHER)
    print(f"wrote {root}/model (model + tokenizer), {root}/chats.jsonl, {root}/chat.jinja")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny"))
