"""Plain data that flows through a run: prompts, generations, scored samples, training batches.

Nothing here imports torch: token ids and per-token floats are tuples, so the core (and its fakes)
stay light. Torch backends turn a batch into padded tensors with
:func:`rlcore.algorithms.batching.tensorize`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

__all__ = [
    "EvalSet",
    "FinishReason",
    "Generation",
    "Prompt",
    "Sample",
    "SamplingParams",
    "TrainBatch",
    "TrainMetrics",
]

TokenIds = tuple[int, ...]
TokenFloats = tuple[float, ...]
FinishReason = Literal["stop", "length", "abort"]


@attrs.frozen
class Prompt:
    """One prompt, already tokenized (``token_ids`` include any BOS). ``index`` is its position in
    its dataset; ``label`` the reference answer a reward function compares with."""

    index: int
    text: str
    token_ids: TokenIds
    label: str = ""
    target_token_ids: TokenIds = ()
    """The reference completion tokenized, ending with the stop token: what a supervised warm
    start (``--sft-warmup-rollouts``) trains on. Empty when the data has no label."""


@attrs.frozen
class EvalSet:
    """A named set of prompts evaluated with the rollout engine
    (``--eval-prompt-data NAME PATH``)."""

    name: str
    prompts: tuple[Prompt, ...]


@attrs.frozen
class SamplingParams:
    """How the rollout engine samples. ``top_k = 0`` and ``top_p = 1.0`` mean "off"."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: TokenIds = ()


@attrs.frozen
class Generation:
    """What the engine produced for one prompt.

    ``token_ids`` are the response tokens (a stop token, when emitted, is the last one);
    ``log_probs[t]`` is the engine's log-probability of ``token_ids[t]`` under the sampling
    distribution's logits at temperature 1; ``text`` is the decoded response without special tokens.
    """

    token_ids: TokenIds
    log_probs: TokenFloats
    text: str
    finish_reason: FinishReason = "length"
    weight_version: int = 0

    def __attrs_post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"Generation has {len(self.token_ids)} tokens but {len(self.log_probs)} log-probs"
            )


@attrs.frozen
class Sample:
    """A prompt, one generation for it and its reward. ``group`` numbers the prompt's samples
    (the ``n_samples_per_prompt`` generations of one prompt share a group)."""

    prompt: Prompt
    response: Generation
    reward: float
    group: int


@attrs.frozen
class TrainBatch:
    """What a training stack's ``train_step`` consumes: samples plus per-response-token targets.

    Every per-token field has one entry per sample, each as long as that sample's response.
    ``advantages`` drive the policy loss, ``returns`` the value loss; ``old_log_probs`` are the
    behaviour policy's log-probs (empty when the actor should use its own detached log-probs,
    i.e. one optimizer step per rollout, where the ratio is exactly 1); ``ref_log_probs`` are the
    reference model's (empty when no KL loss is used); ``old_values`` the critic's values at rollout
    time (empty without a critic); ``rollout_log_probs`` the rollout engine's, copied from each
    sample's :class:`Generation` (empty when no engine sampled the tokens, as in a supervised warm
    start: then nothing is corrected for the engine/trainer mismatch).
    """

    samples: tuple[Sample, ...]
    advantages: tuple[TokenFloats, ...]
    returns: tuple[TokenFloats, ...] = ()
    old_log_probs: tuple[TokenFloats, ...] = ()
    ref_log_probs: tuple[TokenFloats, ...] = ()
    old_values: tuple[TokenFloats, ...] = ()
    rollout_id: int = 0
    rollout_log_probs: tuple[TokenFloats, ...] = ()

    def __attrs_post_init__(self) -> None:
        lengths = [len(s.response.token_ids) for s in self.samples]
        for name in (
            "advantages",
            "returns",
            "old_log_probs",
            "ref_log_probs",
            "old_values",
            "rollout_log_probs",
        ):
            rows: tuple[TokenFloats, ...] = getattr(self, name)
            if not rows and name != "advantages":
                continue
            if [len(r) for r in rows] != lengths:
                raise ValueError(f"TrainBatch.{name} does not match the samples' response lengths")


@attrs.frozen
class TrainMetrics:
    """What one ``train_step`` reports. ``extra`` holds loss parts (``pg_loss``, ``kl``, ...)."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    extra: Mapping[str, float] = attrs.field(factory=dict)

    def as_dict(self, prefix: str) -> dict[str, float]:
        """Namespaced for a metrics sink: ``{prefix}/loss``, ``{prefix}/grad_norm``, ..."""
        out = {
            f"{prefix}/loss": self.loss,
            f"{prefix}/grad_norm": self.grad_norm,
            f"{prefix}/lr": self.lr,
            f"{prefix}/tokens": float(self.tokens),
        }
        out.update({f"{prefix}/{k}": v for k, v in self.extra.items()})
        return out
