"""What rlcore needs from a tokenizer, and from one with a chat template.

A :class:`Tokenizer` encodes prompts and decodes responses (its pad and eos ids pad batches and
end responses); a :class:`ChatTokenizer` also renders a conversation of :data:`Message` s through
its chat template (``apply_chat_template=True``). :class:`rlcore.data.hf_tokenizer.HFTokenizer`
adapts a Hugging Face tokenizer to both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["ChatTokenizer", "Message", "Tokenizer"]

Message = Mapping[str, str]
"""One chat message: ``{"role": "user", "content": "..."}``."""


@runtime_checkable
class Tokenizer(Protocol):
    """What rlcore needs from a tokenizer."""

    @property
    def pad_token_id(self) -> int:
        """The id used to left-pad prompts in a batch."""
        ...

    @property
    def eos_token_id(self) -> int:
        """The end-of-sequence id: the rollout engine's default stop token."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` including the tokenizer's special prefix (``<bos>``), if any."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` with special tokens (pad, bos, eos) left out."""
        ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer with a chat template (needed for ``apply_chat_template=True``)."""

    def render_chat(self, messages: Sequence[Message]) -> str:
        """The conversation as prompt text, ending where the assistant's reply begins
        (``add_generation_prompt``). The text already holds any special prefix the template
        writes."""
        ...

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of rendered chat text, adding no special tokens (the template wrote them)."""
        ...
