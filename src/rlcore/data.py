"""Prompt data: reading prompt files, tokenizing them, and handing them out batch by batch.

Files are JSON lines (``.jsonl``) or Parquet (``.parquet``, needs ``pyarrow``: ``pip install
'rlcore[data]'``). Each record holds the prompt under ``input_key`` and, optionally, the reference
answer under ``label_key``. Anything malformed raises :class:`~rlcore.errors.DataError` naming the
file, the 1-based line (or row) and what to do, before a single rollout runs.

The tokenizer comes in through the small :class:`~rlcore.protocols.tokenizer.Tokenizer` protocol
(re-exported here), so this module imports neither transformers nor torch; :class:`HFTokenizer`
adapts a Hugging Face tokenizer to it.

:class:`PromptSampler` keeps its whole position in one integer, ``consumed``, so a checkpoint that
records it resumes the prompt stream exactly where it stopped.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal, Protocol, cast, final, overload

from rlcore.errors import DataError
from rlcore.protocols.tokenizer import ChatTokenizer, Message, Tokenizer
from rlcore.samples import EvalSet, Prompt

__all__ = [
    "ChatTokenizer",
    "HFTokenizer",
    "PromptSampler",
    "Tokenizer",
    "load_eval_sets",
    "load_prompts",
]

_EXCERPT = 80


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
    :class:`ChatTokenizer`.

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


# --------------------------------------------------------------------------------------------
# Reading prompt files


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "..."


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    """Yields ``(where, record)`` for each non-blank line; ``where`` is ``"path:line"``."""
    try:
        # Bytes, decoded line by line, so a bad byte is reported on its own line (a text-mode file
        # decodes whole chunks and would blame the chunk's first line).
        handle = path.open("rb")
    except OSError as exc:
        raise DataError(
            f"{path}: cannot open prompt file ({exc.strerror}); check the path"
        ) from exc
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                    "re-encode the file as UTF-8"
                ) from exc
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line must hold one JSON object"
                ) from exc
            yield where, record


class _ParquetTable(Protocol):
    def to_pylist(self) -> list[dict[str, object]]: ...


class _ParquetModule(Protocol):
    """The part of ``pyarrow.parquet`` used here; pyarrow ships no type information, and this
    keeps the import lazy (only Parquet files need it)."""

    def read_table(self, source: str) -> _ParquetTable: ...


def _read_parquet(path: Path) -> Iterator[tuple[str, object]]:
    """Yields ``(where, record)`` per row; ``where`` is ``"path:row N"`` (1-based)."""
    try:
        pq = cast(_ParquetModule, importlib.import_module("pyarrow.parquet"))
    except ImportError as exc:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow; install it with pip install 'rlcore[data]' "
            "or convert the file to JSON lines"
        ) from exc
    try:
        table = pq.read_table(str(path))
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot read as Parquet ({exc}); check the file") from exc
    for row_no, record in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {row_no}", record


def _read_records(path: Path) -> Iterator[tuple[str, object]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(
        f"{path}: unknown prompt file extension {path.suffix!r}; use .jsonl (one JSON object per "
        "line) or .parquet"
    )


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
    for where, record in _read_records(path):
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


# --------------------------------------------------------------------------------------------
# Sampling batches


@final
class PromptSampler:
    """Hands out batches of prompts, epoch after epoch, each epoch in its own seeded order.

    The stream is the concatenation of the epoch orders: epoch ``e`` is a shuffle of all prompts
    seeded by ``(seed, e)``. ``next_batch`` returns the next ``batch_size`` prompts of that stream.
    **Wrap-around:** a batch that runs past the end of an epoch is completed with the first prompts
    of the next epoch's order (as slime does), so no prompt is dropped and every epoch shows each
    prompt exactly once; such a batch can hold a prompt twice when ``batch_size`` is close to or
    above the number of prompts.

    ``consumed`` (prompts handed out so far) is the whole state: ``PromptSampler(prompts,
    batch_size, seed, consumed=n)`` continues exactly where a sampler that had handed out ``n``
    prompts stopped.
    """

    def __init__(
        self, prompts: Sequence[Prompt], batch_size: int, seed: int, consumed: int = 0
    ) -> None:
        if not prompts:
            raise DataError("PromptSampler: no prompts to sample from; check the prompt data")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        if consumed < 0:
            raise ValueError(f"PromptSampler: consumed must be >= 0, got {consumed}")
        self._prompts = tuple(prompts)
        self._batch_size = batch_size
        self._seed = seed
        self._consumed = consumed
        self._order_epoch = -1
        self._order: tuple[int, ...] = ()

    @property
    def consumed(self) -> int:
        """How many prompts have been handed out: the state a checkpoint records."""
        return self._consumed

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0-based)."""
        return self._consumed // len(self._prompts)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """The positions of the prompts in epoch ``epoch``'s order (a permutation)."""
        if epoch != self._order_epoch:
            order = list(range(len(self._prompts)))
            # A string seed is hashed with SHA-512 by ``random``: stable across processes and
            # Python versions, and (seed, epoch) pairs never collide as seed + epoch would.
            random.Random(f"rlcore.PromptSampler:{self._seed}:{epoch}").shuffle(order)
            self._order_epoch, self._order = epoch, tuple(order)
        return self._order

    def next_batch(self) -> tuple[Prompt, ...]:
        """The next ``batch_size`` prompts; advances ``consumed`` by ``batch_size``."""
        return self.take(self._batch_size)

    def take(self, count: int) -> tuple[Prompt, ...]:
        """The next ``count`` prompts of the stream (dynamic sampling takes rounds of any size);
        advances ``consumed`` by ``count``. Satisfies
        :class:`~rlcore.protocols.rollout.PromptSource`."""
        if count < 0:
            raise ValueError(f"PromptSampler.take: count must be >= 0, got {count}")
        n = len(self._prompts)
        batch: list[Prompt] = []
        position = self._consumed
        while len(batch) < count:
            epoch, offset = divmod(position, n)
            take = min(count - len(batch), n - offset)
            order = self.epoch_order(epoch)
            batch.extend(self._prompts[i] for i in order[offset : offset + take])
            position += take
        self._consumed = position
        return tuple(batch)

    def __iter__(self) -> Iterator[tuple[Prompt, ...]]:
        """Endless batches (``itertools.islice`` it)."""
        while True:
            yield self.next_batch()
