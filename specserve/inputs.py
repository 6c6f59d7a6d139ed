"""What a request brings to the engine: a typed prompt, and the error for a request that is invalid.

What it does: `TextPrompt`, `TokenPrompt` and `ChatPrompt` are the three ways to give a prompt (vLLM's
`TextPrompt` / `TokensPrompt`, plus chat messages that the engine renders with the model's chat
template); `as_prompt()` turns the offline API's plain `str` / token id list into one of them.
`InvalidRequestError` is the base of every error a caller causes (bad sampling value, prompt too long,
unknown token id): it carries `param` (the request field at fault, as the OpenAI API names it) and
`code`, and the server answers it with 400 by its type alone.
What it does not do: tokenize (see `LLMEngine.encode`) or parse HTTP bodies (see `specserve.server.protocol`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union


class InvalidRequestError(ValueError):
    """A request the caller must change; never the server's fault (HTTP 400).

    Attributes:
        param: the request field at fault ("temperature", "prompt", "messages", ...), or None.
        code: a machine-readable reason ("context_length_exceeded", ...), or None.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class TextPrompt:
    """Raw text, tokenized as the model expects (BOS added where the tokenizer adds one)."""

    text: str


@dataclass(frozen=True)
class TokenPrompt:
    """Token ids, used as given."""

    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (OpenAI shape, content as text) and optional tool definitions, rendered with the
    model's chat template.

    Attributes:
        add_generation_prompt: end with the assistant's turn header (default; vLLM's option).
        continue_final_message: leave the last (assistant) message open so the model continues it.
        template_kwargs: extra variables for the template (vLLM's `chat_template_kwargs`).
    """

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        if self.tools is not None:
            object.__setattr__(self, "tools", tuple(self.tools))


Prompt = Union[TextPrompt, TokenPrompt, ChatPrompt]


def as_prompt(prompt: str | Sequence[int] | Prompt) -> Prompt:
    """A `str` is a TextPrompt, a sequence of ints a TokenPrompt; typed prompts pass through.

    Raises:
        TypeError: anything else.
    """
    if isinstance(prompt, (TextPrompt, TokenPrompt, ChatPrompt)):
        return prompt
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if isinstance(prompt, Sequence):
        return TokenPrompt(tuple(prompt))
    raise TypeError(f"a prompt is text, token ids or a typed prompt, got {type(prompt).__name__}")
