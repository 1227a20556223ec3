"""The model families the Megatron backend builds, read from a Hugging Face ``config.json``.

Supported (``model_type``): ``llama`` (Llama 2/3.x, including ``rope_type: llama3`` frequency
scaling), ``qwen2`` (Qwen2/2.5: biases on q, k and v), ``qwen3`` (QK-norm: RMSNorm over each
head of q and k; ``head_dim`` free of ``hidden_size / heads``) and ``qwen3_moe`` (Qwen3 attention
with sparse mixture-of-experts MLPs). All are pre-norm decoders with RMSNorm, SwiGLU, RoPE
(non-interleaved) and grouped-query attention, with tied or untied embeddings.

Every field of the config is accounted for: either it is read (and checked), or it is known not
to change the model's forward pass (token ids, dtype, caching flags, ...). Anything else, a value
the backend does not implement or a field it does not know, is a :class:`ConfigError` naming the
field: the backend never builds a silently different model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal, final, get_args

import attrs

from rlcore.errors import ConfigError, ConfigProblem
from rlcore.specs import Role

__all__ = [
    "Family",
    "ModelArch",
    "MoEArch",
    "RopeScaling",
    "arch_from_hf_config",
    "model_info",
    "read_hf_config",
]

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe"]
SUPPORTED_MODEL_TYPES: Final[tuple[Family, ...]] = get_args(Family)

ARCHITECTURES: Final[Mapping[Family, str]] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""The transformers class of each family (``architectures`` of an exported ``config.json``)."""

# Fields that cannot change a decoder-only model's forward pass: special token ids, the stored
# dtype, bookkeeping, output and caching flags, labels of classification heads. ``pad_token_id``
# and ``initializer_range`` are read below; ``torch_dtype``/``dtype`` only say how the weights are
# stored.
_NO_EFFECT: Final = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "tokenizer_class",
        # Llama: the weights were once split over this many ranks; HF recombines them.
        "pretraining_tp",
    }
)

# What each family reads, on top of the fields every family reads (``_COMMON``). A field in no
# list is refused.
_COMMON: Final = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
        "attention_dropout",
    }
)
_SLIDING: Final = frozenset(
    {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
)
_FAMILY_FIELDS: Final[Mapping[Family, frozenset[str]]] = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "qwen2": _SLIDING | {"use_mrope"},
    "qwen3": _SLIDING | {"attention_bias"},
    "qwen3_moe": _SLIDING
    | {
        "attention_bias",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        # transformers' own training loss; the Megatron router's is --moe-aux-loss-coeff.
        "output_router_logits",
        "router_aux_loss_coef",
    },
}

VOCAB_DIVISIBLE_BY: Final = 128
"""Megatron's ``make_vocab_size_divisible_by``: the vocabulary is padded to a multiple of this
times the tensor-parallel size (slime and Megatron-LM pad the same way)."""

_LLAMA3_ROPE_KEYS: Final = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@final
@attrs.frozen
class RopeScaling:
    """Llama 3's RoPE frequency scaling (``rope_type: llama3``): wavelengths above
    ``original_max_position_embeddings / low_freq_factor`` are stretched by ``factor``, those
    below ``... / high_freq_factor`` kept, and those between interpolated (Meta's Llama 3.1)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@final
@attrs.frozen
class MoEArch:
    """The sparse MLPs of a mixture-of-experts model (Qwen3-MoE).

    A token's router scores the ``num_experts`` experts (softmax over all of them), takes the
    ``top_k`` best and, when ``norm_topk_prob``, renormalises their weights to sum to 1; its MLP
    output is the weighted sum of those experts' SwiGLU MLPs (each ``ffn_hidden_size`` wide).
    ``moe_layers[i]`` says whether layer ``i`` is sparse; the others are dense MLPs of the model's
    ``intermediate_size``.
    """

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]


@final
@attrs.frozen
class ModelArch:
    """The architecture of a supported model, read from its HF ``config.json``.

    ``hf_config`` keeps the whole original mapping so an exported checkpoint carries it unchanged.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    pad_token_id: int
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    moe: MoEArch | None = None
    hf_config: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def architecture(self) -> str:
        """The transformers class that loads this model (``Qwen3ForCausalLM``, ...)."""
        return ARCHITECTURES[self.family]

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``VOCAB_DIVISIBLE_BY * tp_size``, as
        Megatron-LM pads it (the TP ranks split it evenly; the extra rows are zero and their
        logits are cut off)."""
        multiple = VOCAB_DIVISIBLE_BY * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple


class _Reader:
    """Reads fields of one config mapping, collecting every problem instead of stopping at the
    first (the user fixes them all in one go)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.problems: list[ConfigProblem] = []

    def problem(self, field: str, message: str, hint: str = "") -> None:
        self.problems.append(ConfigProblem(field, message, hint))

    def get(self, field: str, default: Any) -> Any:
        """The field's value; ``default`` when it is absent or null."""
        value = self.cfg.get(field)
        return default if value is None else value

    def positive_int(self, field: str, default: int | None = None) -> int:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.problem(field, f"must be a positive integer, got {value!r}")
            return 1
        return value

    def number(self, field: str, default: float) -> float:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.problem(field, f"must be a number, got {value!r}")
            return default
        return float(value)

    def flag(self, field: str, default: bool) -> bool:
        value = self.get(field, default)
        if not isinstance(value, bool):
            self.problem(field, f"must be true or false, got {value!r}")
            return default
        return value

    def need(self, field: str, expected: object, hint: str) -> None:
        """``field`` may be absent or hold ``expected``; any other value is not implemented."""
        value = self.cfg.get(field, expected)
        if value != expected and not (expected is False and value is None):
            self.problem(field, f"{value!r} is not supported (expected {expected!r})", hint)


def _rope(r: _Reader) -> tuple[float, RopeScaling | None]:
    """``rope_theta`` and the Llama 3 scaling from either config style: transformers 5's
    ``rope_parameters`` (theta inside) or the Hub's ``rope_scaling`` beside ``rope_theta``; a
    config with both must say the same in each."""
    theta = r.number("rope_theta", 10000.0)
    found = {
        field: _rope_field(r, field, theta)
        for field in ("rope_parameters", "rope_scaling")
        if r.cfg.get(field) is not None
    }
    if len(found) == 2 and found["rope_parameters"] != found["rope_scaling"]:
        r.problem(
            "rope_scaling",
            f"{r.cfg['rope_scaling']!r} disagrees with rope_parameters "
            f"{r.cfg['rope_parameters']!r}",
            "keep one of the two",
        )
    return next(iter(found.values()), (theta, None))


def _rope_field(r: _Reader, field: str, theta: float) -> tuple[float, RopeScaling | None]:
    params = r.cfg[field]
    if not isinstance(params, Mapping):
        r.problem(field, f"must be a mapping or null, got {params!r}")
        return theta, None
    if "rope_theta" in params:
        value = params["rope_theta"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            r.problem(f"{field}.rope_theta", f"must be a number, got {value!r}")
        else:
            theta = float(value)
    rope_type = params.get("rope_type", params.get("type", "default"))
    known = {"rope_type", "type", "rope_theta"}
    if rope_type == "llama3":
        known |= set(_LLAMA3_ROPE_KEYS)
    for key in sorted(set(params) - known):
        if key == "partial_rotary_factor" and params[key] == 1.0:
            continue
        r.problem(
            f"{field}.{key}",
            f"{params[key]!r} is not supported with rope_type {rope_type!r}",
            "the backend implements default RoPE and rope_type llama3",
        )
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        r.problem(
            f"{field}.rope_type",
            f"RoPE scaling {rope_type!r} is not supported",
            "the backend implements default RoPE and rope_type llama3",
        )
        return theta, None
    missing = [k for k in _LLAMA3_ROPE_KEYS if not isinstance(params.get(k), int | float)]
    for key in missing:
        r.problem(f"{field}.{key}", f"rope_type llama3 needs a number, got {params.get(key)!r}")
    if missing:
        return theta, None
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    if not scaling.high_freq_factor > scaling.low_freq_factor > 0 or scaling.factor <= 0:
        r.problem(
            field,
            f"llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor > 0, got "
            f"{dict(params)!r}",
        )
    return theta, scaling


def _full_attention_only(r: _Reader) -> None:
    """Qwen's sliding-window attention is off unless ``use_sliding_window``; then
    ``sliding_window`` and ``max_window_layers`` say nothing. ``layer_types`` (transformers 5)
    must list full attention only."""
    r.need("use_sliding_window", False, "sliding-window attention is not implemented")
    layer_types = r.cfg.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or set(layer_types) != {"full_attention"}
    ):
        r.problem(
            "layer_types",
            f"{layer_types!r}: only full_attention layers are implemented",
            "sliding-window attention is not implemented",
        )


def _moe(r: _Reader, num_layers: int) -> MoEArch | None:
    """Qwen3-MoE's sparse blocks: layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
    ``(i + 1) % decoder_sparse_step != 0`` (transformers' rule); ``None`` when no layer is."""
    cfg = r.cfg
    experts_field = "num_experts" if "num_experts" in cfg else "num_local_experts"
    num_experts = r.get(experts_field, 128)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 0:
        r.problem(experts_field, f"must be an integer >= 0, got {num_experts!r}")
        return None
    step = r.positive_int("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and 0 <= i < num_layers for i in dense
    ):
        r.problem("mlp_only_layers", f"must list layer indices in [0, {num_layers}), got {dense!r}")
        dense = []
    moe_layers = tuple(
        num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
    )
    top_k = r.positive_int("num_experts_per_tok", 8)
    ffn = r.positive_int("moe_intermediate_size", 768)
    norm_topk_prob = r.flag("norm_topk_prob", False)
    if not any(moe_layers):
        return None
    if top_k > num_experts:
        r.problem(
            "num_experts_per_tok", f"{top_k} is more than the {num_experts} experts of the model"
        )
    return MoEArch(
        num_experts=num_experts,
        top_k=top_k,
        ffn_hidden_size=ffn,
        norm_topk_prob=norm_topk_prob,
        moe_layers=moe_layers,
    )


def _family_rules(family: Family, r: _Reader, num_layers: int) -> tuple[bool, bool, MoEArch | None]:
    """Check ``family``'s own fields; returns ``(qkv_bias, qk_norm, moe)``."""
    if family == "llama":
        r.need("attention_bias", False, "biases in attention are not implemented for llama")
        r.need("mlp_bias", False, "biases in the MLP are not implemented")
        return False, False, None
    _full_attention_only(r)
    if family == "qwen2":
        r.need("use_mrope", False, "multimodal RoPE (Qwen2-VL) is not implemented")
        return True, False, None
    r.need("attention_bias", False, "biases in Qwen3 attention are not implemented")
    return False, True, _moe(r, num_layers) if family == "qwen3_moe" else None


def arch_from_hf_config(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArch:
    """Validate an HF config mapping; every unsupported field is listed in one ``ConfigError``."""
    r = _Reader(cfg)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        r.problem(
            "model_type",
            f"{model_type!r} is not supported",
            f"the Megatron backend builds {', '.join(SUPPORTED_MODEL_TYPES)} models",
        )
        raise ConfigError(r.problems, source)
    family: Family = model_type
    known = _NO_EFFECT | _COMMON | _FAMILY_FIELDS[family]
    for field in sorted(set(cfg) - known):
        r.problem(
            field,
            f"{cfg[field]!r}: not a {family} field the Megatron backend implements",
            "remove it if it does not change the model; otherwise this model is not supported",
        )
    r.need("hidden_act", "silu", "the backend implements SwiGLU (silu) MLPs")
    r.need("attention_dropout", 0.0, "attention dropout is not implemented")
    vocab = r.positive_int("vocab_size")
    hidden = r.positive_int("hidden_size")
    ffn = r.positive_int("intermediate_size")
    layers = r.positive_int("num_hidden_layers")
    heads = r.positive_int("num_attention_heads")
    kv_heads = r.positive_int("num_key_value_heads", heads)
    head_dim = r.positive_int("head_dim", max(1, hidden // heads))
    if cfg.get("head_dim") is None and hidden % heads:
        r.problem("head_dim", f"not given, and hidden_size {hidden} is not a multiple of {heads}")
    if heads % kv_heads:
        r.problem("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    rope_theta, rope_scaling = _rope(r)
    norm_eps = r.number("rms_norm_eps", 1e-6)
    max_positions = r.positive_int("max_position_embeddings", 2048)
    tie = r.flag("tie_word_embeddings", False)
    qkv_bias, qk_norm, moe = _family_rules(family, r, layers)
    if r.problems:
        raise ConfigError(r.problems, source)
    pad = cfg.get("pad_token_id")
    return ModelArch(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else 0,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        rope_scaling=rope_scaling,
        moe=moe,
        hf_config=dict(cfg),
    )


def read_hf_config(folder: Path) -> ModelArch:
    """Read ``folder/config.json``; raises ``ConfigError`` naming each unsupported field."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "config.json",
                    f"cannot read {path}: {exc}",
                    "point ModelSpec.hf_checkpoint at an HF model folder",
                )
            ],
            str(path),
        ) from exc
    if not isinstance(cfg, dict):
        raise ConfigError([ConfigProblem("config.json", "must hold a JSON object")], str(path))
    return arch_from_hf_config(cfg, str(path))


def model_info(arch: ModelArch, role: Role) -> dict[str, object]:
    """What a checkpoint records about the model (``rollout.json``'s ``model``), checked when it
    is loaded, and before a run starts for a distillation teacher's checkpoint."""
    return {
        "head": "value" if role == "critic" else "lm",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_layers": arch.num_layers,
        "num_heads": arch.num_heads,
        "num_kv_heads": arch.num_kv_heads,
        "tie_word_embeddings": arch.tie_word_embeddings and role != "critic",
    }
