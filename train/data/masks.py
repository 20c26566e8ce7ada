"""A document's token ids and loss mask, token for token as TRL 1.16's SFT preparation makes them.

- text: the text with the EOS token's text appended when it does not end with it (TRL's
  `add_eos`), tokenized; every token is trained.
- prompt/completion: EOS appended to the completion likewise; the prompt and the prompt +
  completion are tokenized, and the completion starts where the two token lists first differ
  (their common prefix, TRL's `common_prefix_length`). Where the boundary's characters merge
  into one token (prompt "...: ret", completion "urn None": "return"), that token opens the
  completion and is trained, and the prompt's own last token ("ret") is not in the sequence.
- chat, template with `{% generation %}` marks: transformers' own mask
  (`apply_chat_template(..., return_assistant_tokens_mask=True)`), what TRL's
  assistant-only loss trains on: the marked stretches, nothing else (no header, no system prompt).
- chat, template without the marks: each assistant turn from the end of its header (the
  generation prompt the template writes before it) to the end of its own rendering, the
  end-of-turn text included; a first turn's header is found inside its rendering. TRL 1.16
  refuses such a template or swaps in its own marked variant (trl/chat_templates/*_training.jinja):
  the masks agree where that variant's marks open after the generation prompt; saved as the
  model's template, a marked variant gives TRL's masks exactly.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from pipezero.train.data.sources import Document
from pipezero.train.log import get_logger

__all__ = ["encode", "has_generation_marks"]

log = get_logger("data")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MERGED: list[str] = []  # the first record whose prompt and completion merged (the warning is said once)
_PROBE = [{"role": "user", "content": "x"}]  # a history whose generation prompt is the assistant's header


def encode(tokenizer: Any, doc: Document) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, loss mask uint8: 1 where the token is trained on) of one document."""
    if doc.kind == "chat":
        ids, mask = _chat(tokenizer, doc)
    elif doc.kind == "completion":
        ids, mask = _completion(tokenizer, doc)
    else:
        ids = tokenizer(_with_eos(tokenizer, doc.text))["input_ids"]
        mask = [1] * len(ids)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def has_generation_marks(template: Any) -> bool:
    """Whether a chat template (a string, or named variants: the `default` one) marks the assistant's output."""
    if isinstance(template, dict):
        template = template.get("default", "")
    return isinstance(template, str) and _GENERATION.search(template) is not None


def _with_eos(tokenizer: Any, text: str) -> str:
    eos = tokenizer.eos_token
    return text if eos is None or text.endswith(eos) else text + eos


def _completion(tokenizer: Any, doc: Document) -> tuple[list[int], list[int]]:
    prompt = tokenizer(doc.text)["input_ids"]
    ids = tokenizer(doc.text + _with_eos(tokenizer, doc.completion))["input_ids"]
    start = _common_prefix(prompt, ids)
    if start < len(prompt) and not _MERGED:
        _MERGED.append(doc.origin)
        log.warning("%s: the prompt's last %d token(s) %r merge with the completion's first; the completion "
                    "starts where the two tokenizations differ, as TRL does (said once; likely true of other "
                    "records: end prompts on a token boundary, e.g. a space or newline, to train on the context "
                    "inference sees)", doc.origin, len(prompt) - start, tokenizer.decode(prompt[start:]))
    if start == len(ids):
        raise ValueError(f"{doc.origin}: the completion adds no token to the prompt's, so nothing would be trained "
                         f"on; give the record a longer completion or drop it")
    return ids, [0] * start + [1] * (len(ids) - start)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _chat(tokenizer: Any, doc: Document) -> tuple[list[int], np.ndarray]:
    template = tokenizer.chat_template
    if not template:
        raise ValueError(f"{doc.origin}: a chat record, but the tokenizer has no chat template (its "
                         f"tokenizer_config.json lacks 'chat_template'); add the model's template there, or write "
                         f"the data as prompt/completion pairs")
    messages = list(doc.messages)
    try:
        if has_generation_marks(template):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=np.uint8)
        else:
            ids, mask = _rendered_mask(tokenizer, doc, messages)
    except ValueError:
        raise
    except Exception as err:  # jinja's TemplateError and the template's own raise_exception
        raise ValueError(f"{doc.origin}: the tokenizer's chat template refused this conversation ({err}); "
                         f"fix the record's roles/contents") from err
    if not mask.any():
        raise ValueError(f"{doc.origin}: the chat template marks no token of the assistant turns for training "
                         f"(its {{% generation %}} block renders nothing here); put the assistant's output inside "
                         f"{{% generation %}}...{{% endgeneration %}} in the template, or drop the record")
    return ids, mask


def _rendered_mask(tokenizer: Any, doc: Document, messages: list) -> tuple[list[int], np.ndarray]:
    """A template without marks: each assistant turn's characters from the end of its header to the end of its
    rendering, then every token overlapping them (the rule transformers applies to the marked stretches)."""
    render: Callable[..., str] = lambda msgs, gen=False: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tokenize=False, add_generation_prompt=gen)
    full = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through, before = render(messages[:i + 1]), render(messages[:i], gen=True) if i else ""
        start = len(before) if i else _first_header_end(render, doc, message, through)
        if not (full.startswith(through) and full.startswith(before)):
            raise ValueError(f"{doc.origin}: the chat template renders the conversation's beginning differently "
                             f"from the whole, so assistant turns cannot be located; add {{% generation %}} marks "
                             f"around the assistant's output in the template, or use prompt/completion pairs")
        spans.append((start, len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for a, b in spans:
        mask |= ((offsets[:, 0] < b) & (offsets[:, 1] > a)).astype(np.uint8)
    return list(enc["input_ids"]), mask


def _first_header_end(render: Callable[..., str], doc: Document, message: dict, through: str) -> int:
    """Where a conversation's first turn, an assistant's, begins its output: after the header the template's
    generation prompt writes (whatever the template puts before it, a default system prompt, stays untrained)."""
    probe, prompted = render(_PROBE), render(_PROBE, gen=True)
    header = prompted[len(probe):] if prompted.startswith(probe) else None
    content = message.get("content")
    found = through.rfind(content) if isinstance(content, str) and content else -1
    at = through.rfind(header, 0, found if found >= 0 else len(through)) if header is not None else -1
    if at < 0:
        raise ValueError(f"{doc.origin}: the conversation opens with an assistant turn and the template's "
                         f"generation prompt is not found before it, so its header cannot be told from its output; "
                         f"add {{% generation %}} marks around the assistant's output in the template, or open the "
                         f"conversation with a user (or system) turn")
    return at + len(header)
