"""Plain data that flows through a run: prompts, generations, scored samples, training batches.

Nothing here imports torch: token ids and per-token floats are tuples, so the core (and its fakes)
stay light. Torch backends turn a batch into padded tensors with
:func:`rlcore.algorithms.batching.tensorize`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, final

import attrs

__all__ = [
    "EvalSet",
    "FinishReason",
    "ForwardRows",
    "Generation",
    "Prompt",
    "Sample",
    "SamplingParams",
    "TrainBatch",
    "TrainMetrics",
    "Turn",
]

TokenIds = tuple[int, ...]
TokenFloats = tuple[float, ...]
FinishReason = Literal["stop", "length", "abort"]
TurnRole = Literal["model", "environment"]


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
    ignore_eos: bool = False
    """Generate exactly ``max_new_tokens`` tokens: no token ends a response, neither eos nor
    ``stop_token_ids`` (SGLang's ``ignore_eos``; fixed lengths, e.g. for benchmarks)."""


@attrs.frozen
class Turn:
    """One turn of a multi-turn episode: the model's (``role="model"``, sampled by the engine) or
    an environment's observation (``role="environment"``: a tool's result, already formatted as
    the chat template renders it). ``text`` is ``token_ids`` decoded."""

    role: TurnRole
    token_ids: TokenIds
    text: str


@attrs.frozen
class Generation:
    """What the engine produced for one prompt.

    ``token_ids`` are the response tokens (a stop token, when emitted, is the last one);
    ``log_probs[t]`` is the engine's log-probability of ``token_ids[t]`` under the tempered
    distribution it sampled from, ``softmax(logits / T)`` (:func:`rlcore.logits.tempered`: the
    whole distribution, before top-k or top-p cut it; greedy decoding scores at ``T = 1``), as
    the trainer computes it; ``text`` is the decoded response without special tokens.
    """

    token_ids: TokenIds
    log_probs: TokenFloats
    text: str
    finish_reason: FinishReason = "length"
    weight_version: int = 0
    """The weight version that generated the last token."""
    loss_mask: tuple[int, ...] = ()
    """Per response token: 1 where the model generated it, 0 where an environment or tool inserted
    it (a multi-turn episode's observations). Empty means every token is the model's. Training
    reduces every per-token quantity over the 1s only; ``log_probs`` are 0.0 where it is 0 (the
    engine did not sample those tokens)."""
    turns: tuple[Turn, ...] = ()
    """A multi-turn episode's turns in order (their ``token_ids`` concatenate to ``token_ids``),
    so that a reward function can see the tool calls and results; empty for a single turn."""
    env_reward: float | None = None
    """The environment's own reward for the episode (the sum of what its steps returned), or
    ``None`` when it gave none; ``--env-reward`` says whether it replaces or adds to the reward
    function's."""
    first_weight_version: int = attrs.field()
    """The weight version that generated the first token (the oldest): the same as
    ``weight_version`` unless new weights arrived mid-generation (a partial rollout). A sample's
    staleness is the trainer's version minus this."""

    @first_weight_version.default
    def _same_version(self) -> int:
        return self.weight_version

    def __attrs_post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"Generation has {len(self.token_ids)} tokens but {len(self.log_probs)} log-probs"
            )
        if self.loss_mask:
            if len(self.loss_mask) != len(self.token_ids):
                raise ValueError(
                    f"Generation has {len(self.token_ids)} tokens but a loss mask of "
                    f"{len(self.loss_mask)} entries"
                )
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("Generation.loss_mask entries must be 0 or 1")
        if self.turns and sum(len(t.token_ids) for t in self.turns) != len(self.token_ids):
            raise ValueError("Generation.turns' token ids do not add up to its token_ids")
        if self.first_weight_version > self.weight_version:
            raise ValueError(
                f"Generation.first_weight_version {self.first_weight_version} is after its "
                f"weight_version {self.weight_version} (the last token's)"
            )

    @property
    def model_mask(self) -> tuple[int, ...]:
        """``loss_mask``, or all 1s when it is empty: one entry per response token."""
        return self.loss_mask if self.loss_mask else (1,) * len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        """How many response tokens the model generated (the loss counts these)."""
        return sum(self.loss_mask) if self.loss_mask else len(self.token_ids)


@attrs.frozen
class Sample:
    """A prompt, one generation for it and its reward. ``group`` numbers the prompt's samples
    (the ``n_samples_per_prompt`` generations of one prompt share a group).
    ``teacher_log_probs``: with a served distillation teacher (``--opd-type sglang``), its
    log-probability of each response token, recorded when the rollout was made; else empty."""

    prompt: Prompt
    response: Generation
    reward: float
    group: int
    teacher_log_probs: TokenFloats = ()


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
    """What one ``train_step`` reports. ``extra`` holds loss parts (``pg_loss``, ``kl``, ...).

    ``sequence_tokens`` and ``padded_tokens``: the prompt + response tokens the whole
    ``train_step`` ran through the model (every optimizer step, every data-parallel rank) and the
    positions they took with padding; 0 when the backend does not say. The loop reads them as
    ``perf/`` metrics (throughput and padding fraction), not as training metrics."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    extra: Mapping[str, float] = attrs.field(factory=dict)
    sequence_tokens: int = 0
    padded_tokens: int = 0

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


@final
class ForwardRows(list[TokenFloats]):
    """What a stack's ``forward`` returns when it can say what it ran: the rows (a list, one
    tuple per sample, as any ``forward`` returns) and, as :class:`TrainMetrics` has them for a
    train step, ``sequence_tokens`` (the prompt + response tokens of the samples scored) and
    ``padded_tokens`` (the positions the model ran over them, padding and throwaway passes
    included; 0 when not said), summed over the data-parallel ranks that shared the pass. The
    loop reads them as ``perf/NAME_padding``, ``1 - sequence_tokens / padded_tokens``.
    :func:`rlcore.algorithms.train_step.score_samples` returns one; a plain list says nothing."""

    def __init__(
        self, rows: Iterable[TokenFloats] = (), *, sequence_tokens: int = 0, padded_tokens: int = 0
    ) -> None:
        super().__init__(rows)
        if sequence_tokens < 0 or (padded_tokens and padded_tokens < sequence_tokens):
            raise ValueError(
                f"ForwardRows: {sequence_tokens} tokens cannot take {padded_tokens} positions "
                "(padded_tokens is 0, unsaid, or at least sequence_tokens)"
            )
        self.sequence_tokens = sequence_tokens
        self.padded_tokens = padded_tokens

    @classmethod
    def joined(
        cls, rows: Iterable[TokenFloats], parts: Iterable[Sequence[TokenFloats]]
    ) -> list[TokenFloats]:
        """``rows`` (the results of ``parts`` put together) with the tokens and positions of
        every part summed, when every part says them (is a :class:`ForwardRows`); a plain list
        when one does not."""
        said = list(parts)
        counted = [part for part in said if isinstance(part, ForwardRows)]
        if len(counted) < len(said):
            return list(rows)
        return cls(
            rows,
            sequence_tokens=sum(part.sequence_tokens for part in counted),
            padded_tokens=sum(part.padded_tokens for part in counted),
        )

    def __repr__(self) -> str:
        return (
            f"ForwardRows({list.__repr__(self)}, sequence_tokens={self.sequence_tokens}, "
            f"padded_tokens={self.padded_tokens})"
        )
