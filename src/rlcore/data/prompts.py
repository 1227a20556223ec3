"""Prompts read from a file and tokenized: :func:`load_prompts` and :func:`load_eval_sets`.

Each record holds the prompt under ``input_key`` (a string, or with ``apply_chat_template`` a list
of chat messages) and, optionally, the reference answer under ``label_key``. Anything malformed
(a record that is not an object, a missing key, a wrongly typed value, a character the tokenizer
cannot encode, a file without prompts) raises :class:`~rlcore.errors.DataError` naming the file,
the 1-based line (or row) and what to do, before a single rollout runs. The files themselves are
read by :mod:`rlcore.data.files`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, overload

from rlcore.data.files import read_records
from rlcore.errors import DataError
from rlcore.protocols.tokenizer import ChatTokenizer, Message, Tokenizer
from rlcore.samples import EvalSet, Prompt

__all__ = ["load_eval_sets", "load_prompts"]

_EXCERPT = 80


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "..."


def _prompt_input(
    where: str, value: object, input_key: str, apply_chat_template: bool
) -> str | list[Message]:
    if isinstance(value, str):
        return value
    if apply_chat_template and isinstance(value, list):
        messages: list[Message] = []
        for message in value:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise DataError(
                    f"{where}: {input_key!r} holds a message list with an entry that is not "
                    f'{{"role": str, "content": str}}: {_excerpt(message)}'
                )
            messages.append({"role": message["role"], "content": message["content"]})
        if messages:
            return messages
    accepted = (
        "a string or a non-empty list of chat messages" if apply_chat_template else "a string"
    )
    raise DataError(
        f"{where}: {input_key!r} must be {accepted}, got {type(value).__name__} "
        f"{_excerpt(value)}; fix the record or choose another --input-key"
    )


def _label(where: str, value: object, label_key: str) -> str:
    if isinstance(value, str):
        return value
    # Numbers are common labels in math sets; keep their JSON spelling. bool is not a label.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return json.dumps(value)
    raise DataError(
        f"{where}: {label_key!r} must be a string or a number, got {type(value).__name__} "
        f"{_excerpt(value)}; fix the record or choose another --label-key"
    )


@overload
def load_prompts(
    path: Path,
    *,
    tokenizer: Tokenizer,
    input_key: str = ...,
    label_key: str | None = ...,
    apply_chat_template: Literal[False] = ...,
    max_prompt_len: int | None = ...,
    dropped: list[str] | None = ...,
    flag: str = ...,
) -> tuple[Prompt, ...]: ...


@overload
def load_prompts(
    path: Path,
    *,
    tokenizer: ChatTokenizer,
    input_key: str = ...,
    label_key: str | None = ...,
    apply_chat_template: bool,
    max_prompt_len: int | None = ...,
    dropped: list[str] | None = ...,
    flag: str = ...,
) -> tuple[Prompt, ...]: ...


def load_prompts(
    path: Path,
    *,
    tokenizer: Tokenizer,
    input_key: str = "input",
    label_key: str | None = "label",
    apply_chat_template: bool = False,
    max_prompt_len: int | None = None,
    dropped: list[str] | None = None,
    flag: str = "--prompt-data",
) -> tuple[Prompt, ...]:
    """Read and tokenize every prompt in ``path`` (``.jsonl`` or ``.parquet``).

    Each record must be an object with a string under ``input_key`` and, unless ``label_key`` is
    ``None``, a string or number under ``label_key`` (numbers keep their JSON spelling, ``42`` ->
    ``"42"``). With ``apply_chat_template`` the input may also be a list of ``{"role", "content"}``
    messages; a plain string becomes one user message; the prompt's ``text`` is the rendered
    conversation. Blank lines in JSON lines files are skipped. Prompts of more than
    ``max_prompt_len`` tokens are left out (slime's ``--rollout-max-prompt-len``), each one's
    place (``"path:line (N tokens)"``) appended to ``dropped`` when given. ``Prompt.index`` is
    the prompt's 0-based position among those kept. ``flag`` is the setting that named the file,
    for the messages.

    Raises :class:`DataError` naming the file and 1-based line (or row) for: a missing file, an
    unknown extension, invalid JSON, a record that is not an object, a missing key, a wrongly
    typed value, a character the tokenizer cannot encode, a file without any record, or one
    whose every prompt is too long.
    """
    return _load_prompts(
        path, tokenizer, input_key, label_key, apply_chat_template, max_prompt_len, dropped, flag
    )


def _target_ids(prompt_ids: Sequence[int], full_ids: Sequence[int], eos: int) -> tuple[int, ...]:
    """The label's tokens as they follow the prompt, plus eos: ``encode(prompt + label)`` minus the
    prompt's own tokens (so the label is tokenized in context). Empty when tokenization merges
    across the boundary, since then no continuation of exactly the prompt's tokens spells the
    label."""
    n = len(prompt_ids)
    if len(full_ids) <= n or list(full_ids[:n]) != list(prompt_ids):
        return ()
    return (*full_ids[n:], eos)


def _encoded(
    encode: Callable[[str], list[int]], text: str, where: str, key: str, start: int = 0
) -> list[int]:
    """``encode(text)``, or :class:`DataError` naming the record, the key and the first character
    of ``text[start:]`` (the key's value) that the tokenizer refuses. A word-level vocabulary
    without an unknown token raises a bare ``Exception`` for any character it lacks."""
    try:
        return encode(text)
    except Exception as exc:
        value = text[start:]
        bad = next((c for c in dict.fromkeys(value) if not _encodes(encode, c)), None)
        which = (
            ""
            if bad is None
            else f": {bad!r} (U+{ord(bad):04X}) at character {value.index(bad) + 1}"
        )
        raise DataError(
            f"{where}: the tokenizer cannot encode {key!r}{which} ({type(exc).__name__}: {exc}); "
            "remove the character from the data, or use a tokenizer whose vocabulary has it"
        ) from exc


def _encodes(encode: Callable[[str], list[int]], text: str) -> bool:
    try:
        encode(text)
    except Exception:
        return False
    return True


def _load_prompts(
    path: Path,
    tokenizer: Tokenizer,
    input_key: str,
    label_key: str | None,
    apply_chat_template: bool,
    max_prompt_len: int | None = None,
    dropped: list[str] | None = None,
    flag: str = "--prompt-data",
) -> tuple[Prompt, ...]:
    if apply_chat_template and not isinstance(tokenizer, ChatTokenizer):
        raise DataError(
            f"{path}: apply_chat_template needs a tokenizer with a chat template; "
            f"{type(tokenizer).__name__} has no render_chat/encode_rendered (wrap a Hugging Face "
            "tokenizer in rlcore.data.HFTokenizer)"
        )
    prompts: list[Prompt] = []
    too_long: list[str] = []
    for where, record in read_records(path):
        if not isinstance(record, dict):
            raise DataError(
                f"{where}: expected a JSON object, got {type(record).__name__} {_excerpt(record)}"
            )
        for key in (input_key, label_key):
            if key is not None and key not in record:
                raise DataError(
                    f"{where}: missing key {key!r} (the record has {sorted(record)}); "
                    "add it or pass the right --input-key / --label-key"
                )
        value = _prompt_input(where, record[input_key], input_key, apply_chat_template)
        label = "" if label_key is None else _label(where, record[label_key], label_key)
        if apply_chat_template:
            assert isinstance(tokenizer, ChatTokenizer)  # checked above
            messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
            text = tokenizer.render_chat(messages)
            encode: Callable[[str], list[int]] = tokenizer.encode_rendered
        else:
            assert isinstance(value, str)  # _prompt_input accepts only strings without a template
            text = value
            encode = tokenizer.encode
        ids = _encoded(encode, text, where, input_key)
        full = _encoded(encode, text + label, where, label_key or input_key, start=len(text))
        if not ids:
            raise DataError(f"{where}: the prompt {_excerpt(text)} encodes to no tokens")
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            too_long.append(f"{where} ({len(ids)} tokens)")
            continue
        prompts.append(
            Prompt(
                index=len(prompts),
                text=text,
                token_ids=tuple(ids),
                label=label,
                target_token_ids=_target_ids(ids, full, tokenizer.eos_token_id) if label else (),
            )
        )
    if dropped is not None:
        dropped += too_long
    if not prompts and too_long:
        raise DataError(
            f"{path}: every prompt is longer than {max_prompt_len} tokens (the first: "
            f"{too_long[0]}); raise --rollout-max-prompt-len (within the model's positions, less "
            "--rollout-max-response-len) or shorten the prompts"
        )
    if not prompts:
        raise DataError(f"{path}: the file holds no prompts; point {flag} at a non-empty file")
    return tuple(prompts)


@overload
def load_eval_sets(
    pairs: Sequence[tuple[str, Path]],
    *,
    tokenizer: Tokenizer,
    input_key: str = ...,
    label_key: str | None = ...,
    apply_chat_template: Literal[False] = ...,
    max_prompt_len: int | None = ...,
    dropped: list[str] | None = ...,
) -> tuple[EvalSet, ...]: ...


@overload
def load_eval_sets(
    pairs: Sequence[tuple[str, Path]],
    *,
    tokenizer: ChatTokenizer,
    input_key: str = ...,
    label_key: str | None = ...,
    apply_chat_template: bool,
    max_prompt_len: int | None = ...,
    dropped: list[str] | None = ...,
) -> tuple[EvalSet, ...]: ...


def load_eval_sets(
    pairs: Sequence[tuple[str, Path]],
    *,
    tokenizer: Tokenizer,
    input_key: str = "input",
    label_key: str | None = "label",
    apply_chat_template: bool = False,
    max_prompt_len: int | None = None,
    dropped: list[str] | None = None,
) -> tuple[EvalSet, ...]:
    """Load each ``(name, path)`` pair (``--eval-prompt-data NAME PATH ...``) as an
    :class:`EvalSet`, in order, as :func:`load_prompts` does. Names must be unique (they
    namespace the metrics, ``eval/NAME/...``)."""
    seen: dict[str, Path] = {}
    for name, path in pairs:
        if not name:
            raise DataError(f"{path}: an eval set needs a non-empty name")
        if name in seen:
            raise DataError(
                f"eval set name {name!r} is used twice ({seen[name]} and {path}); "
                "names must be unique"
            )
        seen[name] = path
    return tuple(
        EvalSet(
            name=name,
            prompts=_load_prompts(
                path,
                tokenizer,
                input_key,
                label_key,
                apply_chat_template,
                max_prompt_len,
                dropped,
                "--eval-prompt-data",
            ),
        )
        for name, path in pairs
    )
