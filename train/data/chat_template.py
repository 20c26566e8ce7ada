"""A model directory's tokenizer with the user's chat template instead of its own, as a tokenizer folder.

Everything downstream names a tokenizer by its folder: the tokenizing workers load it from there
and the token cache keys on its files (tokenize.py's tokenizer_hash, chat_template.jinja among
them). So the template is not patched into a loaded tokenizer but saved with it into a folder of
its own, named by a hash of the base tokenizer and the template: another template is another
folder, another cache key, another cache. Every rank may call it at once: each writes a private
folder and renames it into place; the first rename wins and the others' copies are dropped.

    folder = with_chat_template("./my-llama", "chatml.jinja", "runs/x/tokenizer")
    tokenized_corpus("chats.jsonl", folder)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from pipezero.train.data.tokenize import load_tokenizer, tokenizer_hash

__all__ = ["read_chat_template", "with_chat_template"]


def read_chat_template(path: str | os.PathLike) -> str:
    """A chat template file's text; a ValueError names the file if it cannot be read or is empty."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template {path}: cannot read it ({err}); pass a Jinja template file") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty; pass a Jinja chat template")
    return text


def _check_syntax(tokenizer: Any, path: str | os.PathLike) -> None:
    """Render a two-turn chat with the template (transformers' own Jinja environment, {% generation %}
    included): a syntax error names the file and line now, not in the middle of tokenizing."""
    import jinja2

    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    try:
        tokenizer.apply_chat_template(chat, tokenize=False)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"--chat-template {path}:{err.lineno}: not a Jinja template ({err.message}); fix the "
                         f"template (transformers renders it with Jinja)") from None


def with_chat_template(model_dir: str | os.PathLike, template_file: str | os.PathLike,
                       root: str | os.PathLike) -> Path:
    """The folder under `root` of `model_dir`'s tokenizer with `template_file`'s chat template (made once)."""
    text = read_chat_template(template_file)
    key = hashlib.sha256(f"{tokenizer_hash(model_dir)}\0{text}".encode()).hexdigest()[:16]
    final = Path(root) / key
    if final.is_dir():  # renamed into place whole: complete
        return final
    tmp = Path(root) / f".{key}.{socket.gethostname()}.{os.getpid()}.tmp"
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = text
    _check_syntax(tokenizer, template_file)
    tokenizer.save_pretrained(str(tmp))
    try:
        os.rename(tmp, final)
    except OSError:  # another rank renamed its copy first
        shutil.rmtree(tmp, ignore_errors=True)
    if not final.is_dir():
        raise OSError(f"{final}: could not write the tokenizer with --chat-template {template_file} there")
    return final
