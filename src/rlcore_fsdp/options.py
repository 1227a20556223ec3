"""The FSDP backend's settings (:class:`FSDPOptions`) and the light rules that both the checks
before start (:mod:`rlcore_fsdp.kind`) and the ranks apply: which parallel layouts it makes, and
what a checkpoint records of its model. attrs only: ``--help`` lists the flags without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, final

import attrs

from rlcore.config import option
from rlcore.specs import EvalSpec, ParallelSpec, Role

__all__ = [
    "RECORDED",
    "FSDPOptions",
    "lora_problem",
    "model_owner",
    "model_record",
    "parallel_problem",
]


def lora_problem(rank: int, alpha: int, dropout: float, modules: tuple[str, ...]) -> str | None:
    """What is wrong with the LoRA flags, naming the flag; None when they hold."""
    if rank < 0:
        return f"--lora-rank must be >= 0 (0 turns LoRA off), got {rank}"
    if not alpha > 0:
        return f"--lora-alpha must be > 0, got {alpha}"
    if dropout != 0.0:
        # The stacks keep the model in eval mode so that the loss is of the policy that sampled
        # (the engine's, and the old log-probs'): a dropout on the adapters would train another.
        return (
            f"--lora-dropout must be 0, got {dropout}: the fsdp backend trains the policy that "
            "sampled (no dropout anywhere, so the loss's log-probs are the engine's); drop it"
        )
    if isinstance(modules, str) or not modules or not all(modules):
        return f"--target-modules needs module names (or all-linear), got {modules!r}"
    if "all-linear" in modules and len(modules) > 1:
        return f"--target-modules all-linear stands alone, got {list(modules)}"
    return None


@final
@attrs.frozen
class FSDPOptions:
    """``--train-backend fsdp``: the flags below, or the ``[fsdp]`` section of ``--config``."""

    trust_remote_code: bool = option(
        False,
        "--trust-remote-code",
        "let transformers run the Python code a model folder ships (its auto_map): only for "
        "folders you trust",
    )
    gradient_checkpointing: bool = option(
        False,
        "--gradient-checkpointing",
        "recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(activation checkpointing: less memory, about one more forward of compute)",
    )
    fsdp_cpu_offload: bool = option(
        False,
        "--fsdp-cpu-offload",
        "keep the parameters, their gradients and AdamW's state in CPU memory (FSDP2's "
        "CPUOffloadPolicy): each layer is copied to the GPU for its forward and backward and "
        "AdamW steps on the CPU; for a model whose training state does not fit the GPUs",
    )
    lora_rank: int = option(
        0,
        "--lora-rank",
        "train LoRA adapters of this rank (peft) on the actor and the critic instead of all "
        "their weights (a critic's new value head trains in full); 0: off, full fine-tuning",
    )
    lora_alpha: int = option(
        16,
        "--lora-alpha",
        "LoRA's scale numerator: the adapters add (alpha / rank) B A",
    )
    lora_dropout: float = option(
        0.0,
        "--lora-dropout",
        "only 0: the model stays in eval mode so the loss is of the policy that sampled",
    )
    target_modules: tuple[str, ...] = option(
        ("all-linear",),
        "--target-modules",
        "the modules LoRA adapts, by name (repeatable: --target-modules q_proj --target-modules "
        "v_proj); all-linear: every linear layer but the output head",
        repeat=True,
    )

    def __attrs_post_init__(self) -> None:
        problem = lora_problem(
            self.lora_rank, self.lora_alpha, self.lora_dropout, self.target_modules
        )
        if problem is not None:
            raise ValueError(problem)


def model_owner(options: FSDPOptions, spec: EvalSpec) -> Role | None:
    """With LoRA the reference is the actor's base model with the adapters disabled, a view of the
    actor's model (no second copy of the weights): ``"actor"`` for it, else ``None``
    (:attr:`rlcore.backends.BackendKind.model_owner`)."""
    return "actor" if options.lora_rank > 0 and spec.model.role == "reference" else None


RECORDED: Final = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")
"""The ``config.json`` fields a checkpoint records of its model, compared when it is loaded."""


def model_record(hf_config: Mapping[str, Any], role: str) -> dict[str, object]:
    """What a checkpoint records about the model it holds: its head (a critic's value head or a
    policy's LM head) and the ``config.json`` numbers that shape its weights (:data:`RECORDED`;
    GPT-2's ``n_embd``/``n_layer`` are read as ``hidden_size``/``num_hidden_layers``)."""
    aliases = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer"}
    record: dict[str, object] = {"head": "value" if role == "critic" else "lm"}
    for key in RECORDED:
        record[key] = hf_config.get(key, hf_config.get(aliases.get(key, key)))
    return record


def parallel_problem(parallel: ParallelSpec) -> str | None:
    """FSDP shards every layer over the data-parallel ranks; it splits no layer (tensor or
    expert parallel) and cuts no pipeline stages."""
    asked = {
        "tensor": parallel.tensor,
        "expert": parallel.expert,
        "pipeline": parallel.pipeline,
    }
    over = [f"{name} parallel {size}" for name, size in asked.items() if size > 1]
    if over:
        return (
            f"the fsdp backend shards models over data-parallel ranks only (asked for "
            f"{', '.join(over)}): use --train-backend megatron for tensor, expert or pipeline "
            "parallelism"
        )
    return None
