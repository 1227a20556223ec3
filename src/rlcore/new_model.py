"""A small Hugging Face model folder made from scratch: a tokenizer of your own characters or
words, and a randomly initialised decoder of any family the Megatron backend builds (``llama``,
``qwen2``, ``qwen3``, ``qwen3_moe``), both written with ``save_pretrained`` so that
``AutoTokenizer`` / ``AutoModelForCausalLM`` and ``--hf-checkpoint`` load the folder as they load
a published checkpoint. Nothing is downloaded.

From the shell (``python -m rlcore.new_model --help``)::

    python -m rlcore.new_model sort/model --family llama --alphabet "abcdefgh>"

or from Python: :func:`new_model` (tokenizer and model in one folder), or the two halves,
:func:`build_tokenizer` and :func:`build_model`.

The tokenizer: ids ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2 (:data:`SPECIAL_TOKENS`), then one
id per word (in the order given), then one per character of the alphabet. Text is cut into the
longest word that starts at each position, else one character; decoding concatenates the pieces,
so a space is a character like any other (give ``" "`` in the alphabet when the text has spaces).
Encoding prepends ``<bos>``; padding is on the left (the rollout engine left-pads prompts).
There is no unknown token: text with a character outside the vocabulary cannot be encoded
(:func:`rlcore.data.prompts.load_prompts` names the character and the line). One catch, transformers
5's: ``AutoTokenizer`` gives a ``qwen2`` folder Qwen2's own tokenizer, rebuilt from the vocabulary,
whatever the folder holds; load that one with ``PreTrainedTokenizerFast.from_pretrained`` (runs
do: :meth:`rlcore.data.hf_tokenizer.HFTokenizer.from_folder`).

This module imports torch, transformers and tokenizers when a function runs, not when it is
imported.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, get_args

import attrs

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "FAMILIES",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "Sizes",
    "Family",
    "build_char_tokenizer",
    "build_model",
    "build_tokenizer",
    "main",
    "new_model",
    "write_model",
]

PAD_ID: Final = 0
BOS_ID: Final = 1
EOS_ID: Final = 2
SPECIAL_TOKENS: Final = ("<pad>", "<bos>", "<eos>")
"""The special tokens, in id order: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2."""

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
FAMILIES: Final[tuple[Family, ...]] = get_args(Family)
"""The ``model_type`` s :func:`build_model` writes: the Megatron backend's families."""

_T = TypeVar("_T")

Name = Callable[[str], str]
"""How a problem names a parameter: as Python spells it, or as the command line does."""


def _python_name(name: str) -> str:
    return name


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------------------------
# The tokenizer


def _vocabulary_problems(
    alphabet: str, words: Sequence[str], name: Name = _python_name
) -> list[str]:
    """Why ``alphabet`` and ``words`` do not make a vocabulary (nothing given, an empty word, a
    token given twice), each naming the parameter with ``name``; empty when they do."""
    problems = []
    if not alphabet and not words:
        problems.append(
            f"give the tokens: {name('alphabet')} (characters) and/or {name('words')} "
            "(whole words, matched before single characters)"
        )
    if any(not word for word in words):
        problems.append(f"{name('words')}: a word is empty; list only non-empty words")
    tokens = [*words, *alphabet]
    repeated = sorted({t for t in tokens if t and tokens.count(t) > 1})
    if repeated:
        problems.append(
            f"{name('alphabet')} / {name('words')}: {repeated!r} given more than once; list "
            "each token once"
        )
    clash = sorted(set(SPECIAL_TOKENS) & set(tokens))
    if clash:
        problems.append(
            f"{name('words')}: {clash!r} is one of the special tokens {list(SPECIAL_TOKENS)}, "
            "which every vocabulary has already"
        )
    return problems


def build_tokenizer(
    folder: Path,
    *,
    alphabet: str = "",
    words: Sequence[str] = (),
    model_max_length: int = 128,
) -> PreTrainedTokenizerFast:
    """Build a tokenizer of ``words`` and the characters of ``alphabet`` (see the module's
    docstring for the ids and how text is cut) and ``save_pretrained`` it into ``folder``.

    Raises ``ValueError`` naming the parameter when nothing is given, a word is empty, a token
    is given twice or is one of :data:`SPECIAL_TOKENS`.
    """
    problems = _vocabulary_problems(alphabet, words)
    if problems:
        raise ValueError("; ".join(problems))
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for token in (*words, *alphabet):
        vocab[token] = len(vocab)
    # The longest word first (regex alternation takes the first that matches), then any
    # character: a character-only tokenizer's pattern is "." alone.
    pattern = "|".join([*(re.escape(w) for w in sorted(words, key=len, reverse=True)), "."])

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    tokenizer.decoder = decoders.Fuse()
    # Register the specials so that ``skip_special_tokens`` drops them when decoding.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))

    # transformers declares this constructor as ``__init__(self, *args, **kwargs)`` without
    # annotations.
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=model_max_length,
    )
    folder.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(folder))
    return wrapped


def build_char_tokenizer(
    folder: Path, alphabet: str, *, model_max_length: int = 128
) -> PreTrainedTokenizerFast:
    """:func:`build_tokenizer` of the characters of ``alphabet`` alone: ``"0123456789+= "``
    gives bench-tiny's 16-token vocabulary (its ``tokenizer.json`` byte for byte)."""
    return build_tokenizer(folder, alphabet=alphabet, model_max_length=model_max_length)


# --------------------------------------------------------------------------------------------
# The model


def _size(default: _T, help: str) -> _T:
    """A field of :class:`Sizes` with its help text (the command line's flag is its name)."""
    result: _T = attrs.field(default=default, metadata={"help": help})
    return result


@attrs.frozen
class Sizes:
    """A small model's sizes; the defaults make a 2-layer model of width 64 (``python -m
    rlcore.new_model`` has a flag for each: ``--hidden-size``, ...)."""

    hidden_size: int = _size(64, "width of the model")
    num_layers: int = _size(2, "decoder layers")
    num_heads: int = _size(4, "attention heads")
    num_kv_heads: int = _size(2, "key/value heads (grouped-query attention; divides the heads)")
    head_dim: int | None = _size(None, "width of a head (default: the width over the heads)")
    intermediate_size: int = _size(128, "width of the MLP")
    max_position_embeddings: int = _size(128, "longest prompt plus answer, in tokens")
    num_experts: int = _size(8, "qwen3_moe: experts per layer (every layer is sparse)")
    num_experts_per_tok: int = _size(2, "qwen3_moe: experts each token is routed to")
    moe_intermediate_size: int = _size(32, "qwen3_moe: width of an expert's MLP")

    def problems(self, family: str, vocab_size: int, name: Name = _python_name) -> list[str]:
        """Why these sizes do not make a ``family`` model over ``vocab_size`` tokens, each
        naming its field with ``name``; empty when they do."""
        if family not in FAMILIES:
            return [f"{name('family')}: {family!r} is not one of {', '.join(FAMILIES)}"]
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        counts = {"vocab_size": vocab_size} | {
            f.name: getattr(self, f.name)
            for f in attrs.fields(Sizes)
            if getattr(self, f.name) is not None and (family == "qwen3_moe" or f.name not in moe)
        }
        problems = [f"{name(k)} must be at least 1, got {v}" for k, v in counts.items() if v < 1]
        if problems:
            return problems
        if self.head_dim is None and self.hidden_size % self.num_heads:
            problems.append(
                f"{name('hidden_size')} {self.hidden_size} is not a multiple of "
                f"{name('num_heads')} {self.num_heads} (or give {name('head_dim')})"
            )
        if self.num_heads % self.num_kv_heads:
            problems.append(
                f"{name('num_heads')} {self.num_heads} is not a multiple of "
                f"{name('num_kv_heads')} {self.num_kv_heads}"
            )
        if family == "qwen3_moe" and self.num_experts_per_tok > self.num_experts:
            problems.append(
                f"{name('num_experts_per_tok')} {self.num_experts_per_tok} is more than "
                f"{name('num_experts')} {self.num_experts}"
            )
        return problems

    def hf_config(
        self, family: Family, vocab_size: int, tie_word_embeddings: bool
    ) -> dict[str, Any]:
        """The ``config.json`` fields of a ``family`` model of these sizes (transformers fills
        in the rest with the family's defaults)."""
        config: dict[str, Any] = {
            "model_type": family,
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": tie_word_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "pad_token_id": PAD_ID,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "dtype": "float32",
        }
        if family == "llama":
            config |= {"attention_bias": False, "mlp_bias": False}
        if self.head_dim is not None or family in ("qwen3", "qwen3_moe"):
            # Qwen3's default head_dim is 128, whatever the width: say it.
            config["head_dim"] = self.head_dim or self.hidden_size // self.num_heads
        if family == "qwen3_moe":
            config |= {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": True,  # as the published Qwen3-MoE models have it
            }
        return config


def write_model(
    folder: Path,
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    adjust: Callable[[PreTrainedModel], None] | None = None,
) -> PretrainedConfig:
    """Create a randomly initialised fp32 model of the ``config.json`` mapping ``config`` (its
    ``model_type`` names the family) and ``save_pretrained`` it into ``folder``.

    The weights depend only on ``config``, ``seed`` (``torch.manual_seed(seed)`` right before
    construction) and the torch/transformers versions; ``adjust`` may change them in place
    before they are saved (with the same seeded generator). The global torch RNG state is
    restored afterwards, so building a model does not perturb the caller's random stream. The
    folder also gets a ``generation_config.json`` with bos = 1, eos = 2, pad = 0.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    fields = dict(config)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        # transformers leaves from_config unannotated.
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            hf_config, dtype=torch.float32
        )
        if adjust is not None:
            with torch.no_grad():
                adjust(model)
    finally:
        torch.random.set_rng_state(rng_state)
    # GenerationConfig's constructor takes untyped ``**kwargs``.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    return hf_config


def build_model(
    folder: Path,
    *,
    vocab_size: int,
    family: Family = "llama",
    sizes: Sizes = Sizes(),
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> PretrainedConfig:
    """A randomly initialised fp32 ``family`` model of ``sizes`` over ``vocab_size`` tokens
    (:func:`write_model`) in ``folder``.

    Raises ``ValueError`` naming the field for a size below 1, heads that do not divide the
    width or each other, or more experts per token than experts.
    """
    problems = sizes.problems(family, vocab_size)
    if problems:
        raise ValueError("; ".join(problems))
    config = sizes.hf_config(family, vocab_size, tie_word_embeddings)
    return write_model(folder, config, seed=seed)


def new_model(
    folder: Path,
    family: Family = "llama",
    *,
    alphabet: str = "",
    words: Sequence[str] = (),
    sizes: Sizes = Sizes(),
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """A whole model folder: :func:`build_tokenizer` of ``words`` and ``alphabet`` (its
    ``model_max_length`` is ``sizes.max_position_embeddings``), then :func:`build_model` of
    ``family`` over its vocabulary. Returns ``folder``."""
    tokenizer = build_tokenizer(
        folder, alphabet=alphabet, words=words, model_max_length=sizes.max_position_embeddings
    )
    build_model(
        folder,
        vocab_size=len(tokenizer),
        family=family,
        sizes=sizes,
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
    )
    return folder


# --------------------------------------------------------------------------------------------
# python -m rlcore.new_model

_DESCRIPTION = (
    "Write a small, randomly initialised Hugging Face model folder (config.json, "
    "model.safetensors, a tokenizer of your characters or words) that transformers and "
    "--hf-checkpoint load. Nothing is downloaded."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rlcore.new_model", description=_DESCRIPTION)
    parser.add_argument("folder", type=Path, help="where to write the model (new or empty)")
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="model_type")
    parser.add_argument(
        "--alphabet", default="", help='characters, one token each (e.g. "abcdefgh>")'
    )
    parser.add_argument("--words", nargs="+", default=[], metavar="WORD", help="whole-word tokens")
    parser.add_argument(
        "--words-file", type=Path, default=None, help="whole-word tokens, one a line"
    )
    for field in attrs.fields(Sizes):
        what, default = field.metadata["help"], field.default
        shown = f" ({default})" if default is not None else ""
        parser.add_argument(
            _flag_name(field.name), type=int, default=default, metavar="N", help=what + shown
        )
    parser.add_argument(
        "--tie-word-embeddings", action="store_true", help="share input and output embeddings"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights (0)")
    return parser


def _read_words(parser: argparse.ArgumentParser, path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--words-file: cannot read {path}: {exc}")
    return [line for line in lines if line]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlcore.new_model``; exits 2 (argparse's usage error) with every problem of
    the arguments, each naming its flag, before anything is written."""
    parser = _parser()
    args = parser.parse_args(argv)
    words = [*args.words, *_read_words(parser, args.words_file)]
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in attrs.fields(Sizes)})
    problems = _vocabulary_problems(args.alphabet, words, _flag_name)
    vocab_size = len(SPECIAL_TOKENS) + len(words) + len(args.alphabet)
    problems += sizes.problems(args.family, vocab_size, _flag_name)
    folder: Path = args.folder
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        problems.append(f"{folder} exists and is not an empty folder; choose a new folder")
    if problems:
        parser.error("\n  ".join(problems))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated there
    new_model(
        folder,
        args.family,
        alphabet=args.alphabet,
        words=words,
        sizes=sizes,
        tie_word_embeddings=args.tie_word_embeddings,
        seed=args.seed,
    )
    print(
        f"wrote a {args.family} model with a vocabulary of {vocab_size} tokens "
        f"({len(SPECIAL_TOKENS)} special, {len(words)} words, {len(args.alphabet)} characters) "
        f"to {folder}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
