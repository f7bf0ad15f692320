"""Prompts for instruct models: a document and a question, split where a reusable cache ends.

Both embedded models are instruct models and fail tasks they can do unless they are prompted through
their chat template. `build_prompt` puts the document and the question in one user turn and returns
the tokens in two parts:

* `context`: everything before the question's text (template head, document, separator). This is what
  a query-agnostic cache holds and compresses, and what a store would keep and reuse.
* `question`: the question, the end of the user turn, the generation prompt and an optional answer
  prefix (the start of the assistant's reply). It is fed after the context.

The two parts are tokenized separately, as they would be when a stored context is reused with a new
question. `raw=True` is for base models: the document (after the tokenizer's special tokens) and the
question as plain text, no template.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.errors import KVMemError

SEPARATOR = "\n\n"  # between the document and the question, inside the user turn
_MARK = "\u2063KVMEM-QUESTION\u2063"  # an invisible separator no document contains


@dataclass(frozen=True)
class Prompt:
    context: list[int]  # compressed (and reusable) part
    question: list[int]  # fed after the context; the model's answer continues it

    @property
    def ids(self) -> list[int]:
        return self.context + self.question


def build_prompt(tokenizer, context: str, question: str, answer_prefix: str = "", raw: bool = False) -> Prompt:
    """Token ids of `context` and `question` for `tokenizer`'s chat template (see module doc)."""
    question, answer_prefix = question.strip(), answer_prefix.strip()
    if not question:
        raise KVMemError("the question is empty")
    if raw or tokenizer.chat_template is None:
        if not raw:
            raise KVMemError("this tokenizer has no chat template; pass raw=True (--raw-prompt) for a base model")
        head = tokenizer(context, add_special_tokens=True).input_ids if context else []
        tail = ("\n" if context else "") + question + (" " + answer_prefix if answer_prefix else "")
        return Prompt(head, tokenizer(tail, add_special_tokens=False).input_ids)
    content = (context + SEPARATOR if context else "") + _MARK + question
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(_MARK) != 1:
        raise KVMemError("the chat template does not keep the user's message as it is; use raw=True")
    head, tail = text.split(_MARK)
    tail += answer_prefix
    encode = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731 - the template has them
    return Prompt(encode(head), encode(tail))
