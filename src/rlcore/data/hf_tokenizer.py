"""A Hugging Face tokenizer as rlcore's :class:`~rlcore.protocols.tokenizer.ChatTokenizer`.

:class:`HFTokenizer` wraps ``AutoTokenizer.from_pretrained(...)`` (or the tokenizer of a local model
folder, :meth:`HFTokenizer.from_folder`): it fills in a missing pad token, refuses a tokenizer
without an eos token, and turns a chat template's failures into :class:`~rlcore.errors.DataError`.
The part of ``transformers`` it uses is typed here as a protocol, so this module imports
transformers only inside :meth:`HFTokenizer.from_folder`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, final

from rlcore.errors import DataError
from rlcore.protocols.tokenizer import Message

__all__ = ["HFTokenizer"]


class _HFTokenizerLike(Protocol):
    """The part of a ``transformers`` tokenizer :class:`HFTokenizer` uses (typed here so this
    module does not import transformers). Results are checked at run time, so the types are
    loose."""

    @property
    def pad_token_id(self) -> object: ...

    @property
    def eos_token_id(self) -> object: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> object: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> object: ...


@final
class HFTokenizer:
    """Adapts a Hugging Face tokenizer (``AutoTokenizer.from_pretrained(...)``) to
    :class:`~rlcore.protocols.tokenizer.ChatTokenizer`.

    A tokenizer without a pad token pads with its eos token (the usual choice for decoder-only
    models; padded positions are masked anyway). One without an eos token is refused: the rollout
    engine would have no default stop token.
    """

    def __init__(self, tokenizer: _HFTokenizerLike) -> None:
        eos = tokenizer.eos_token_id
        if not isinstance(eos, int):
            raise DataError(
                f"HFTokenizer: {type(tokenizer).__name__} has no eos token; set one "
                "(tokenizer.eos_token = ...) so the rollout engine knows where a response ends"
            )
        pad = tokenizer.pad_token_id
        self._tokenizer = tokenizer
        self._eos = eos
        self._pad = pad if isinstance(pad, int) else eos

    @classmethod
    def from_folder(cls, folder: Path) -> HFTokenizer:
        """The tokenizer of a local model folder (never a model hub lookup): ``AutoTokenizer``'s,
        except that a folder whose ``tokenizer_config.json`` names the generic class
        (``TokenizersBackend`` or ``PreTrainedTokenizerFast``: ``rlcore.new_model`` writes one)
        gets that class; transformers 5 replaces it by some families' own (``qwen2``: a BPE
        rebuilt from the vocabulary, which cuts other text differently)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            declared = json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
        except (OSError, ValueError, KeyError, TypeError):
            declared = None
        loader = (
            PreTrainedTokenizerFast
            if declared in ("TokenizersBackend", "PreTrainedTokenizerFast")
            else AutoTokenizer
        )
        return cls(loader.from_pretrained(str(folder), local_files_only=True))

    @property
    def pad_token_id(self) -> int:
        return self._pad

    @property
    def eos_token_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def render_chat(self, messages: Sequence[Message]) -> str:
        try:
            rendered = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
        except ValueError as exc:  # transformers' "tokenizer.chat_template is not set"
            raise DataError(
                f"HFTokenizer: cannot apply the chat template ({exc}); set tokenizer.chat_template "
                "or load prompts without apply_chat_template"
            ) from exc
        if not isinstance(rendered, str):
            raise DataError(
                f"HFTokenizer: apply_chat_template returned {type(rendered).__name__}, not text; "
                "does this tokenizer have a chat template?"
            )
        return rendered

    def encode_rendered(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))
