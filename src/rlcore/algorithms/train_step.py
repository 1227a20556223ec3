"""What every backend's ``train_step`` shares: cutting a rollout's batch into optimizer steps and
each step's global batch into this rank's micro-batches, the loss normaliser of the global batch,
and the step's metrics summed over micro-batches and reduced over data-parallel ranks.

The contract (:meth:`rlcore.protocols.stacks.TrainingStack.train_step`): every rank of a multi-rank
stack receives the *whole* rollout batch. Each optimizer step takes the next
``global_batch_size`` samples; data-parallel rank ``r`` of ``D`` trains on its own share of
them, cut into micro-batches (:func:`step_micro_batches`): a contiguous share in micro-batches of
``micro_batch_size`` sequences (:func:`local_micro_batches`), or with a token budget
(``--use-dynamic-batch-size``) a share balanced by tokens in micro-batches of at most
``max_tokens_per_gpu`` padded tokens (:func:`budget_micro_batches`). Each micro-batch's loss
numerator (:mod:`rlcore.algorithms.losses`) is divided by the *global* batch's normaliser
(:attr:`StepMetrics.normalizer`, which every rank computes from the whole global batch, so no
collective is needed) and the gradients are summed over micro-batches and ranks, so the update is
the global batch's aggregate whatever the split, in every aggregation mode. The metrics follow
the same rule (:class:`StepMetrics`): loss parts weighted by their micro-batch's share of the
normaliser, token means by its tokens, maxima by ``max``; summed over the data-parallel ranks by
the backend's all-reduce, they are the global batch's values exactly.

A backend supplies the model, the optimizer and the collectives; this module owns the
arithmetic, so that no two backends write it twice (a test checks the split-independence once,
here, and each backend's conformance run checks it holds for its stacks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

import attrs
import torch

from rlcore.algorithms.batching import (
    TensorBatch,
    entropy_from_logits,
    gather_response,
    tensorize,
    tensorize_samples,
    token_log_probs,
    unpad,
)
from rlcore.algorithms.losses import LossOut, actor_loss, critic_loss, loss_normalizer
from rlcore.algorithms.token_budget import (
    forward_groups,
    in_input_order,
    padded_positions,
    rank_micro_batches,
    sequence_lengths,
    split_largest,
)
from rlcore.errors import PlanError
from rlcore.samples import ForwardRows, Generation, Prompt, Sample, TrainBatch, TrainMetrics
from rlcore.specs import LossAggMode, ModelSpec, TrainSpec

__all__ = [
    "Reduce",
    "StepMetrics",
    "budget_micro_batches",
    "local_micro_batches",
    "micro_batch_loss",
    "optimizer_step_batches",
    "optimizer_steps",
    "score_samples",
    "step_micro_batches",
    "step_tokens",
    "trimmed",
]

Reduce = Callable[[list[float]], list[float]]
"""An all-reduce over the data-parallel ranks of a list of floats (every rank passes a list of
the same length and gets the element-wise sum, or maximum, back); ``None`` for one rank."""


def optimizer_step_batches(
    batch: TrainBatch, spec: TrainSpec, pad_id: int, device: torch.device | str = "cpu"
) -> list[TensorBatch]:
    """``batch`` as tensors, cut into ``spec.steps_per_rollout`` global batches of
    ``spec.global_batch_size`` samples each, in order: one per optimizer step. Tensorized once,
    so every global batch has the whole rollout's padded widths. Raises :class:`PlanError` when
    the batch holds another number of samples."""
    n = len(batch.samples)
    if n != spec.steps_per_rollout * spec.global_batch_size:
        raise PlanError(
            f"TrainBatch has {n} samples but TrainSpec asks for steps_per_rollout="
            f"{spec.steps_per_rollout} x global_batch_size={spec.global_batch_size} "
            f"(the plan's rollout batch size must equal their product)"
        )
    whole = tensorize(batch, pad_id, device)
    size = spec.global_batch_size
    return [whole.select(slice(start, start + size)) for start in range(0, n, size)]


def optimizer_steps(
    batch: TrainBatch,
    spec: TrainSpec,
    pad_id: int,
    device: torch.device | str,
    optimizer_step: Callable[[TensorBatch], TrainMetrics],
) -> TrainMetrics:
    """A backend's whole ``train_step``: ``optimizer_step`` (the backend's one update over a
    global batch, cutting it with :func:`step_micro_batches`) on each of
    :func:`optimizer_step_batches`; the last step's metrics, with the tokens and padded positions
    of every step (:func:`step_tokens`) for the throughput and padding metrics."""
    metrics = TrainMetrics(loss=0.0, grad_norm=0.0, lr=0.0, tokens=0)
    sequence = padded = 0
    for global_batch in optimizer_step_batches(batch, spec, pad_id, device):
        metrics = optimizer_step(global_batch)
        real, positions = step_tokens(global_batch, spec)
        sequence, padded = sequence + real, padded + positions
    return attrs.evolve(metrics, sequence_tokens=sequence, padded_tokens=padded)


def local_micro_batches(
    global_batch: TensorBatch,
    micro_batch_size: int,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
) -> list[TensorBatch]:
    """Data-parallel rank ``data_parallel_rank``'s contiguous share of ``global_batch``, in
    micro-batches of ``micro_batch_size`` sequences (the last may be shorter). A
    :class:`~rlcore.specs.TrainSpec` guarantees the global batch splits into whole micro-batches
    on every rank (:func:`~rlcore.specs.batch_split_problem`); this function checks only that
    the ranks' shares are whole."""
    if not 0 <= data_parallel_rank < data_parallel_size or micro_batch_size < 1:
        raise ValueError(
            f"local_micro_batches: rank {data_parallel_rank} of {data_parallel_size}, "
            f"micro-batches of {micro_batch_size}"
        )
    total = global_batch.num_sequences
    if total % data_parallel_size:
        raise ValueError(
            f"a global batch of {total} sequences does not split over "
            f"{data_parallel_size} data-parallel ranks"
        )
    per_rank = total // data_parallel_size
    first = data_parallel_rank * per_rank
    end = first + per_rank
    return [
        global_batch.select(slice(s, min(s + micro_batch_size, end)))
        for s in range(first, end, micro_batch_size)
    ]


def step_micro_batches(
    global_batch: TensorBatch,
    spec: TrainSpec,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
) -> list[TensorBatch]:
    """This rank's micro-batches of ``global_batch``, as ``spec`` cuts them: by its token budget
    (:func:`budget_micro_batches`) when it has one, else :func:`local_micro_batches` of
    ``spec.micro_batch_size`` sequences. What a backend's ``train_step`` loops over."""
    if spec.max_tokens_per_gpu is None:
        return local_micro_batches(
            global_batch, spec.micro_batch_size, data_parallel_rank, data_parallel_size
        )
    return budget_micro_batches(
        global_batch, spec.max_tokens_per_gpu, data_parallel_rank, data_parallel_size
    )


def step_tokens(global_batch: TensorBatch, spec: TrainSpec) -> tuple[int, int]:
    """The prompt + response tokens of ``global_batch`` and the positions that
    :func:`step_micro_batches` gives them with padding, over all of ``spec``'s data-parallel
    ranks: ``(sequence tokens, padded tokens)``, for the throughput and padding metrics."""
    lengths = [int(n) for n in global_batch.attention_mask.sum(dim=1).tolist()]
    if spec.max_tokens_per_gpu is None:  # every micro-batch has the rollout's width
        return sum(lengths), len(lengths) * int(global_batch.tokens.shape[1])
    plans = rank_micro_batches(lengths, spec.max_tokens_per_gpu, spec.model.parallel.data)
    return sum(lengths), sum(padded_positions(lengths, plan) for plan in plans)


def budget_micro_batches(
    global_batch: TensorBatch,
    max_tokens: int,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
) -> list[TensorBatch]:
    """Data-parallel rank ``data_parallel_rank``'s micro-batches of ``global_batch`` by a token
    budget (:func:`rlcore.algorithms.token_budget.rank_micro_batches`: ranks balanced by tokens,
    each micro-batch at most ``max_tokens`` padded tokens unless one sequence is longer, the same
    count on every rank), each :func:`trimmed` to its own longest sequence."""
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"budget_micro_batches: rank {data_parallel_rank} of {data_parallel_size}")
    lengths = global_batch.attention_mask.sum(dim=1).tolist()
    plan = rank_micro_batches(lengths, max_tokens, data_parallel_size)[data_parallel_rank]
    device = global_batch.tokens.device
    return [
        trimmed(global_batch.select(torch.tensor(group, dtype=torch.long, device=device)))
        for group in plan
    ]


def trimmed(batch: TensorBatch) -> TensorBatch:
    """``batch`` with the padding beyond its own longest sequence (``S``) and longest response
    (``T``) cut off: what :func:`~rlcore.algorithms.batching.tensorize_samples` would give for
    its samples alone (padding positions of ``response_index`` clamped into the shorter ``S``)."""
    seq = max(int(batch.attention_mask.sum(dim=1).max()), 1)
    width = int(batch.response_mask.sum(dim=1).max())

    def cut(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[:, :width]

    return attrs.evolve(
        batch,
        tokens=batch.tokens[:, :seq],
        attention_mask=batch.attention_mask[:, :seq],
        response_index=batch.response_index[:, :width].clamp(max=seq - 1),
        response_mask=batch.response_mask[:, :width],
        advantages=batch.advantages[:, :width],
        returns=cut(batch.returns),
        old_log_probs=cut(batch.old_log_probs),
        ref_log_probs=cut(batch.ref_log_probs),
        old_values=cut(batch.old_values),
        rollout_log_probs=cut(batch.rollout_log_probs),
        model_token_mask=cut(batch.model_token_mask),
    )


@final
class StepMetrics:
    """One optimizer step's loss scale and metrics on one rank (module docstring).

    Per micro-batch: ``backward`` the micro-batch's loss divided by :attr:`normalizer` (the
    global batch's), then :meth:`add` its :class:`~rlcore.algorithms.losses.LossOut`. After the
    last one, :meth:`reduce` sums (and takes maxima) over the data-parallel ranks and returns the
    global batch's means: every metric of the losses, ``"loss"`` among them, each loss part over
    the normaliser and each token mean over the global batch's tokens; :attr:`tokens` is then
    the global batch's token count. Every rank must call :meth:`reduce` (it is a collective when
    the reductions are), with the same keys: the same loss on the same kind of batch gives them.
    """

    def __init__(self, global_batch: TensorBatch, agg_mode: LossAggMode) -> None:
        self.normalizer = loss_normalizer(agg_mode, global_batch.loss_mask)
        self._global_tokens = max(int(global_batch.loss_mask.sum()), 1)
        self._sums: dict[str, float] = {}
        self._maxima: dict[str, float] = {}
        self._token_keys: set[str] = set()
        self.tokens = 0

    def add(self, out: LossOut) -> None:
        """Count one micro-batch's metrics (loss parts by its normaliser share, token means by
        its tokens, maxima by ``max``)."""
        for key, value in out.metrics.items():
            weight = out.tokens if key in out.token_metrics else out.normalizer
            self._sums[key] = self._sums.get(key, 0.0) + value * weight
        self._token_keys |= out.token_metrics
        for key, value in out.maxima.items():
            self._maxima[key] = max(self._maxima.get(key, value), value)
        self.tokens += out.tokens

    def reduce(
        self, all_sum: Reduce | None = None, all_max: Reduce | None = None
    ) -> dict[str, float]:
        """The global batch's metrics (class docstring); ``all_sum`` / ``all_max`` are the
        data-parallel all-reduces (``None`` on one rank)."""
        keys, max_keys = sorted(self._sums), sorted(self._maxima)
        totals = [self._sums[k] for k in keys] + [float(self.tokens)]
        peaks = [self._maxima[k] for k in max_keys]
        if all_sum is not None:
            totals = all_sum(totals)
        if all_max is not None and peaks:
            peaks = all_max(peaks)
        self.tokens = int(totals[-1])
        means = {
            k: totals[i] / (self._global_tokens if k in self._token_keys else self.normalizer)
            for i, k in enumerate(keys)
        }
        means.update(zip(max_keys, peaks, strict=True))
        return means


def score_samples(
    output: Callable[[TensorBatch], torch.Tensor],
    samples: Sequence[Sample],
    spec: ModelSpec,
    pad_id: int,
    device: torch.device | str,
    micro_batch: int,
    all_max: Reduce | None = None,
    *,
    at_response: bool = False,
) -> ForwardRows:
    """Per response token of each sample: log-probs at ``spec.temperature`` (a policy) or values
    (a critic), one tuple per sample in ``samples``' order (none for no samples), without
    gradients, with the samples' tokens and the positions run over them (each micro-batch padded
    to its own longest sequence, a throwaway forward one position; :class:`ForwardRows`, for the
    pass's padding metric); in micro-batches of ``micro_batch`` samples, or by
    ``spec.log_probs_max_tokens_per_gpu`` tokens when set
    (:func:`~rlcore.algorithms.token_budget.forward_groups`, longest first). ``output`` is the
    backend's model: logits ``[B, S, V]`` (or a critic's values ``[B, S]``) in fp32 for a
    micro-batch's tokens; with ``at_response``, a policy's logits ``[B, T, V]`` at the
    positions that predict the response tokens only
    (:func:`~rlcore.algorithms.batching.token_log_probs`).

    ``all_max``: for a model whose forward is a collective over the data-parallel ranks (FSDP's
    gathers), the all-reduce (maximum) over them; every rank must then call this, with its own
    samples, none included. The ranks agree on the most micro-batches any of them forms; one
    with fewer splits its largest (:func:`~rlcore.algorithms.token_budget.split_largest`) and,
    when it holds too few samples for that, runs a throwaway forward of one token for each pass
    still missing."""
    lengths = sequence_lengths(samples)
    groups = forward_groups(lengths, spec.log_probs_max_tokens_per_gpu, micro_batch)
    passes = len(groups)
    if all_max is not None:
        passes = int(all_max([float(passes)])[0])
        groups = split_largest(groups, passes)
    rows: list[list[tuple[float, ...]]] = []
    with torch.no_grad():
        for group in groups:
            tb = tensorize_samples([samples[i] for i in group], pad_id, device)
            out = output(tb)
            if spec.role == "critic":
                per_token = gather_response(out, tb)
            else:
                per_token = token_log_probs(out, tb, spec.temperature, at_response=at_response)
            rows.append(unpad(per_token, tb))
        for _ in range(passes - len(groups)):
            output(_one_token(pad_id, device))
    return ForwardRows(
        in_input_order(groups, rows),
        sequence_tokens=sum(lengths),
        padded_tokens=padded_positions(lengths, groups) + passes - len(groups),
    )


def _one_token(pad_id: int, device: torch.device | str) -> TensorBatch:
    """A batch of one sequence of one token (``pad_id``) and no response: a throwaway forward."""
    idle = Sample(Prompt(-1, "", (pad_id,)), Generation((), (), ""), 0.0, 0)
    return tensorize_samples([idle], pad_id, device)


def micro_batch_loss(
    out: torch.Tensor, mb: TensorBatch, spec: TrainSpec, *, at_response: bool = False
) -> LossOut:
    """A micro-batch's loss from the model's fp32 output ``out`` for it (logits ``[B, S, V]``, or
    ``[B, T, V]`` at the response positions only with ``at_response``, or a critic's values
    ``[B, S]``): the critic's value loss, or the actor's policy loss on the log-probs at the
    spec's temperature, with the entropy only when a coefficient asks for it."""
    if spec.model.role == "critic":
        return critic_loss(gather_response(out, mb), mb, spec.loss)
    temperature = spec.model.temperature
    log_probs = token_log_probs(out, mb, temperature, at_response=at_response)
    wants_entropy = spec.loss.entropy_coef > 0
    entropy = (
        entropy_from_logits(out, mb, temperature, at_response=at_response)
        if wants_entropy
        else None
    )
    return actor_loss(log_probs, mb, spec.loss, entropy)
