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
    head: int = 0  # leading tokens of `context` that are the template's (system prompt, start of the user turn)

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
        n_special = len(tokenizer("", add_special_tokens=True).input_ids)
        return Prompt(head, tokenizer(tail, add_special_tokens=False).input_ids, min(n_special, len(head)))
    content = (context + SEPARATOR if context else "") + _MARK + question
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(_MARK) != 1:
        raise KVMemError("the chat template does not keep the user's message as it is; use raw=True")
    head, tail = text.split(_MARK)
    tail += answer_prefix
    encode = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731 - the template has them
    ids = encode(head)
    template_head = encode(_template_parts(tokenizer)[0])
    n_head = next((i for i, (a, b) in enumerate(zip(ids, template_head)) if a != b), min(len(ids), len(template_head)))
    return Prompt(ids, encode(tail), n_head)


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> Prompt:
    """Token ids of a chat (OpenAI-style `messages`, through the tokenizer's chat template, with the generation
    prompt), split before the last message's text: `context` holds the system prompt and the earlier turns (what
    requests of one conversation, or sharing one system prompt, have in common), `question` the last message.
    `tools` (OpenAI function specs) are rendered by the template where it renders them."""
    if tokenizer.chat_template is None:
        raise KVMemError("this model's tokenizer has no chat template; use /v1/completions with a plain prompt")
    if not messages:
        raise KVMemError("messages is empty: give at least one message")
    *earlier, last = messages
    try:
        text = tokenizer.apply_chat_template([*earlier, {**last, "content": _MARK + last["content"]}],
                                             add_generation_prompt=True, tokenize=False,
                                             **({"tools": tools} if tools else {}))
    except Exception as e:  # noqa: BLE001 - jinja raises for role orders a template refuses
        raise KVMemError(f"the chat template refuses these messages: {e}") from None
    if text.count(_MARK) != 1:
        raise KVMemError("the chat template does not keep the last message as it is")
    head, tail = text.split(_MARK)
    encode = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731 - the template has them
    ids, template_head = encode(head), encode(_template_parts(tokenizer)[0])
    n_head = next((i for i, (a, b) in enumerate(zip(ids, template_head)) if a != b), min(len(ids), len(template_head)))
    return Prompt(ids, encode(tail), n_head)


def _template_parts(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after one user message: (head, end of turn + generation prompt)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=True, tokenize=False)
    head, tail = text.split(_MARK)
    return head, tail


def user_turn_end(tokenizer, raw: bool = False) -> list[int]:
    """Tokens that close the user's turn and open the assistant's (a newline for raw prompts)."""
    if raw or tokenizer.chat_template is None:
        return tokenizer("\n", add_special_tokens=False).input_ids
    return tokenizer(_template_parts(tokenizer)[1], add_special_tokens=False).input_ids
