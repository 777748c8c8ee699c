"""How a context and a question become tokens: the context is a prefix shared by every question.

With a chat template (default when the tokenizer has one) the user turn is ``context + "\\n\\n" + question``
and the template's generation prompt follows; the template is rendered once with a marker where the
question goes and split there, so the context's tokens are the same for every question. Without one the
prompt is ``context + "\\n\\nQuestion: " + question + "\\nAnswer:"``. The two parts are tokenized
separately (a token never spans the boundary), as kvpress's pipeline does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MARKER = "\x00KVSIEVE_QUESTION\x00"
PLAIN_QUESTION = "\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class PromptFormat:
    """The context's token ids and the text a question is wrapped into."""

    context_ids: list[int]
    question_prefix: str
    question_suffix: str
    chat: bool

    def question_text(self, question: str) -> str:
        return f"{self.question_prefix}{question}{self.question_suffix}"


def prompt_format(tokenizer: Any, context: str, chat: bool | None = None) -> PromptFormat:
    """Split the prompt of ``context`` into its shared context tokens and the question's wrapper."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise ValueError("chat: the tokenizer has no chat template; pass chat=False")
    if chat is None:
        chat = has_template
    if chat:
        messages = [{"role": "user", "content": f"{context.strip()}\n\n{_MARKER}"}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, _, tail = rendered.partition(_MARKER)
        ids = list(tokenizer(head, add_special_tokens=False).input_ids)
        return PromptFormat(ids, "", tail, True)
    ids = list(tokenizer(context.rstrip(), add_special_tokens=True).input_ids)
    prefix, suffix = PLAIN_QUESTION.split("{question}")
    return PromptFormat(ids, prefix, suffix, False)
