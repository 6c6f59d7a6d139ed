"""Prompts to checked token ids: chat templating, tokenization, and the size checks around them.

What it does: `PromptEncoder.encode()` turns a typed prompt into token ids: a `TextPrompt` through the
tokenizer (BOS where the model adds one), a `ChatPrompt` through the model's chat template (with tools
and the template options) and then the tokenizer, a `TokenPrompt` as given. Before any tokenization a
cheap size check refuses a prompt whose UTF-8 size alone proves it longer than the limit: no token
covers more than `max_bytes_per_token` bytes (the longest token of the vocabulary, measured once), so
a text of B bytes has at least B / max_bytes_per_token tokens. After it the token count is checked
against the per-request limit (`max_prompt_tokens`, at most the context minus one output token).
The engine calls it for the offline API; the server calls it on its own low-priority tokenizer thread
(`specserve.server.async_engine`), so tokenization never runs on the engine thread.
What it does not do: parse HTTP (see `specserve.server`) or check output lengths (the server checks
`max_tokens` against the context; the engine stops at the context end).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from specserve.inputs import ChatPrompt, InvalidRequestError, Prompt, TextPrompt, as_prompt

logger = logging.getLogger("specserve.server")


class RequestError(InvalidRequestError):
    """A prompt the engine cannot take (empty, too long, bad token ids, a chat the template refuses, a
    duplicate request id). `param` names the request field ("prompt" or "messages"); `code` is
    "context_length_exceeded" for a prompt longer than the limit."""


def max_token_bytes(tokenizer: Any, vocab_size: int) -> int:
    """The most UTF-8 bytes one token of `tokenizer` decodes to (at least 1), over ids 0..vocab_size-1
    and the added tokens. Takes about 1 s for a 150k vocabulary."""
    n = max(vocab_size, len(tokenizer) if hasattr(tokenizer, "__len__") else 0)
    ids = [[i] for i in range(n)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        texts = backend.decode_batch(ids, skip_special_tokens=False)
    else:
        texts = [tokenizer.decode(i, skip_special_tokens=False) for i in ids]
    return max([1] + [len(t.encode("utf-8")) for t in texts])


class PromptEncoder:
    """Typed prompt -> checked token ids (see the module docstring). Not thread-safe: one per thread.

    Args:
        tokenizer: a Hugging Face tokenizer (or one with `encode`, `decode`, `apply_chat_template`).
        vocab_size: the target's vocabulary size (token ids must be below it).
        max_model_len: the context length (tokens).
        max_prompt_tokens: the per-request prompt limit (tokens); None or more than max_model_len - 1
            means max_model_len - 1.
        model_name: for messages.
        size_check: refuse prompts by their byte size before tokenizing (the server's encoder; the offline
            engine's skips it, and so never measures the vocabulary).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, max_prompt_tokens: int | None = None,
                 model_name: str = "the model", size_check: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        cap = max_model_len - 1
        self.max_prompt_tokens = cap if max_prompt_tokens is None else max(1, min(max_prompt_tokens, cap))
        self.model_name = model_name
        self.size_check = size_check
        self._max_token_bytes: int | None = None

    @property
    def max_bytes_per_token(self) -> int:
        if self._max_token_bytes is None:
            self._max_token_bytes = max_token_bytes(self.tokenizer, self.vocab_size)
        return self._max_token_bytes

    @property
    def max_prompt_bytes(self) -> int:
        """Prompts with more UTF-8 bytes than this cannot fit the limit (no tokenization needed)."""
        return self.max_prompt_tokens * self.max_bytes_per_token

    def precheck(self, prompt: Prompt) -> None:
        """The byte-size check alone, cheap enough for any thread (O(bytes), no tokenizer call); a no-op
        until `max_bytes_per_token` has been measured. Raises RequestError like `encode`."""
        if self._max_token_bytes is None:
            return
        if isinstance(prompt, TextPrompt):
            self._check_size(len(prompt.text.encode("utf-8", errors="replace")), "prompt")
        elif isinstance(prompt, ChatPrompt):
            self._check_size(_chat_bytes(prompt), "messages")

    def encode(self, prompt: str | Sequence[int] | Prompt) -> list[int]:
        """The checked token ids of a prompt.

        Raises:
            RequestError: empty prompt, token ids outside the vocabulary, a prompt over the limit (code
                "context_length_exceeded", found by the size check or after tokenization), a chat the
                template cannot render, a model without a chat template; `param` is "messages" for a
                ChatPrompt, else "prompt".
        """
        p = as_prompt(prompt)
        if isinstance(p, TextPrompt):
            param = "prompt"
            self._check_size(len(p.text.encode("utf-8", errors="replace")), param)
            ids = list(self.tokenizer.encode(p.text))
        elif isinstance(p, ChatPrompt):
            param = "messages"
            ids = self._encode_chat(p)
        else:
            param = "prompt"
            ids = list(p.token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise RequestError(f"prompt token ids must be integers in [0, {self.vocab_size})", param=param)
        if not ids:
            raise RequestError("the prompt is empty", param=param)
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(self._too_long(f"has {len(ids)} tokens"), param=param, code="context_length_exceeded")
        return ids

    def _too_long(self, what: str) -> str:
        limit = self.max_prompt_tokens
        why = (f"this model's context is {self.max_model_len} tokens (prompt + at least 1 output token)"
               if limit == self.max_model_len - 1 else f"this server takes prompts of at most {limit} tokens")
        return f"the prompt {what}; {why}"

    def _check_size(self, num_bytes: int, param: str) -> None:
        if self.size_check and num_bytes > self.max_prompt_bytes:
            raise RequestError(
                self._too_long(f"is {num_bytes} bytes, so more than {self.max_prompt_tokens} tokens "
                               f"(no token of this model covers more than {self.max_bytes_per_token} bytes)"),
                param=param, code="context_length_exceeded")

    def _encode_chat(self, p: ChatPrompt) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"model {self.model_name} has no chat template; use a completion prompt",
                               param="messages")
        self._check_size(_chat_bytes(p), "messages")
        kwargs = dict(p.template_kwargs or {})
        kwargs.update(add_generation_prompt=p.add_generation_prompt)
        if p.continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in p.messages], tools=[dict(t) for t in p.tools] if p.tools is not None else None,
                tokenize=False, **kwargs)
        except TemplateError as e:  # e.g. the template's raise_exception("roles must alternate ...")
            raise RequestError(f"the chat template cannot render these messages: {_one_line(e)}",
                               param="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError):
            # a message shape or template option the template (or transformers) does not accept: the
            # Python text is logged, not sent (it names internals)
            logger.warning("chat template failed on a request", exc_info=True)
            raise RequestError("the chat template cannot render these messages (a message field or "
                               "chat_template_kwargs value it does not accept)", param="messages") from None
        if not isinstance(text, str):
            text = text[0] if isinstance(text, list) and text and isinstance(text[0], str) else str(text)
        self._check_size(len(text.encode("utf-8", errors="replace")), "messages")
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _chat_bytes(p: ChatPrompt) -> int:
    """UTF-8 bytes of a chat's message contents and tool definitions (a lower bound of the rendered text)."""
    size = sum(len(str(m.get("content") or "").encode("utf-8", errors="replace")) for m in p.messages)
    return size + tools_json_bytes(p.tools)


def _one_line(e: BaseException, limit: int = 300) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def tools_json_bytes(tools: Sequence[dict] | None) -> int:
    """UTF-8 size of the tool definitions as JSON (they are rendered into the prompt)."""
    return len(json.dumps(list(tools or []), ensure_ascii=False).encode("utf-8")) if tools else 0
