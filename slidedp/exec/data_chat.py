"""Chat data: a conversation through the tokenizer's chat template, labels on assistant tokens only.

A conversation is a list of messages {"role": ..., "content": ...}. Its tokens are the template's
rendering (add_generation_prompt off) tokenized without special tokens added, as
`apply_chat_template(tokenize=True)` does; its labels are the token ids where a token belongs to
an assistant message and -100 elsewhere (system, user, tool messages, the template's headers).
Which characters belong to an assistant message:
  - a template with {% generation %} tags: what the tags enclose (transformers'
    return_assistant_tokens_mask);
  - any other template: for assistant message i, from the end of the rendering of messages
    [0, i) with the generation prompt to the end of the rendering of messages [0, i], i.e. the
    message, its end-of-turn token and what the template writes after it, never the assistant
    header. This needs each such rendering to be a prefix of the whole conversation's; a
    template for which it is not (e.g. one that drops earlier turns' reasoning) is refused with
    the conversation's location: add {% generation %} tags to it.
A token is an assistant token when its characters overlap such a span (transformers' rule for
the generation mask). Needs a fast tokenizer (character offsets).
"""

from __future__ import annotations

import re

import numpy as np

from slidedp.exec.packing import IGNORE, Document
from slidedp.spec.errors import SpecError

MESSAGES = "a list of {role, content} messages"
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_tags(tokenizer) -> bool:
    return GENERATION_TAG.search(tokenizer.get_chat_template()) is not None


def check_chat_tokenizer(tokenizer, where: str) -> None:
    """A chat template and character offsets, or a SpecError naming the tokenizer."""
    try:
        tokenizer.get_chat_template()
    except ValueError:
        raise SpecError(where, "chat_template", "a chat template (--chat renders each "
                        "conversation with it); this tokenizer has none") from None
    if not getattr(tokenizer, "is_fast", False):
        raise SpecError(where, "tokenizer", "a fast tokenizer (tokenizer.json: --chat maps "
                        "assistant characters to tokens)")


def _check_messages(messages, where: str, field: str) -> None:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
        for m in messages)
    if not ok:
        raise SpecError(where, field, f"{MESSAGES}, got {str(messages)[:80]!r}")


def assistant_spans(tokenizer, messages, where: str) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, assistant character spans) by rendering prefixes (module docstring)."""
    def render(msgs, prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise SpecError(where, "messages", "a conversation that does not open with an "
                            "assistant message (its prompt is rendered from the messages before)")
        start, end = render(messages[:i], True), render(messages[: i + 1], False)
        if not (end.startswith(start) and text.startswith(end)):
            raise SpecError(where, "chat_template", "a template whose rendering of a "
                            "conversation's first messages begins its rendering of the whole "
                            "conversation, or {% generation %} tags around assistant messages")
        spans.append((len(start), len(end)))
    return text, spans


def chat_document(tokenizer, messages, where: str, field: str, tags: bool) -> Document:
    """The conversation's tokens and labels (assistant tokens only); `tags`:
    has_generation_tags(tokenizer), decided once per data set."""
    _check_messages(messages, where, field)
    if tags:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        mask = out["assistant_masks"]
    else:
        text, spans = assistant_spans(tokenizer, messages, where)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [any(s < e_tok and s_tok < e for s, e in spans)
                for s_tok, e_tok in enc["offset_mapping"]]
    labels = [t if keep else IGNORE for t, keep in zip(ids, mask, strict=True)]
    return Document(np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32))
