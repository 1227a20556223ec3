"""Samples as right-padded tensors, and the per-token quantities read off a model's output.

A :class:`~rlcore.samples.TrainBatch` holds ragged tuples; a torch backend needs rectangles. Each
sample's prompt and response are concatenated and right-padded to the longest sequence ``S``;
per-response-token quantities (advantages, log-probs, ...) are right-padded to the longest
response ``T``. Shapes used throughout (``B`` sequences)::

    tokens          LongTensor[B, S]    prompt + response, then pad_id
    attention_mask  BoolTensor[B, S]    True on prompt and response tokens
    response_index  LongTensor[B, T]    position of the logits that predict each response token
    response_mask   BoolTensor[B, T]    True on real response tokens
    loss_mask       BoolTensor[B, T]    True on response tokens the model generated (a property:
                                        response_mask without a multi-turn episode's
                                        environment tokens); every loss reduces over it
    advantages ...  Tensor[B, T]        float, 0 on padding

A causal LM's logits at position ``p`` predict the token at ``p + 1``, so response token ``j`` of a
sample with a ``P``-token prompt (sequence position ``P + j``) is predicted by the logits at
``P + j - 1``; ``response_index[i, j] = P_i + j - 1``. This is the shift OpenRLHF and slime apply
with ``logits[:, -num_actions - 1:-1]``; holding it as an index makes it correct for every row of
a batch with prompts of different lengths. Padding entries of ``response_index`` are clamped into
``[0, S - 1]`` so that a gather with them is always valid; their results are zeroed by
``response_mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs
import torch

from rlcore.logits import tempered
from rlcore.samples import Sample, TrainBatch

__all__ = [
    "TensorBatch",
    "entropy_from_logits",
    "gather_response",
    "tensorize",
    "tensorize_samples",
    "token_log_probs",
    "unpad",
]


@final
@attrs.frozen(eq=False)  # tensors: compare fields explicitly, not with ==
class TensorBatch:
    """A batch of samples as right-padded tensors (shapes in the module docstring).

    ``returns``, ``old_log_probs``, ``ref_log_probs`` and ``old_values`` are ``None`` when the
    :class:`~rlcore.samples.TrainBatch` field they come from is empty, and so is
    ``rollout_log_probs`` (the engine's, for the mismatch metric and correction).
    Build one with :func:`tensorize` or :func:`tensorize_samples`.
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    response_index: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    """The rollout engine's log-probs of the response tokens, for the mismatch metric and the
    importance-sampling correction."""
    model_token_mask: torch.Tensor | None = None
    """``BoolTensor[B, T]``: True on response tokens the model generated, False on environment
    tokens and padding; ``None`` when every response token is the model's (read
    :attr:`loss_mask`, which falls back to ``response_mask``)."""

    @property
    def loss_mask(self) -> torch.Tensor:
        """``BoolTensor[B, T]``, True on the tokens every loss, advantage and metric reduces over:
        the model's own response tokens (environment observations inside a multi-turn episode are
        context, not actions)."""
        return self.response_mask if self.model_token_mask is None else self.model_token_mask

    def __attrs_post_init__(self) -> None:
        b, s = self.tokens.shape
        if self.attention_mask.shape != (b, s):
            raise ValueError(
                f"TensorBatch.attention_mask has shape {tuple(self.attention_mask.shape)}, "
                f"tokens {(b, s)}"
            )
        per_token = {
            "response_mask": self.response_mask,
            "advantages": self.advantages,
            "returns": self.returns,
            "old_log_probs": self.old_log_probs,
            "ref_log_probs": self.ref_log_probs,
            "old_values": self.old_values,
            "rollout_log_probs": self.rollout_log_probs,
            "model_token_mask": self.model_token_mask,
        }
        want = tuple(self.response_index.shape)
        if len(want) != 2 or want[0] != b:
            raise ValueError(f"TensorBatch.response_index has shape {want}, expected ({b}, T)")
        for name, x in per_token.items():
            if x is not None and tuple(x.shape) != want:
                raise ValueError(
                    f"TensorBatch.{name} has shape {tuple(x.shape)}, response_index {want}"
                )

    @property
    def num_sequences(self) -> int:
        """``B``, the number of sequences."""
        return int(self.tokens.shape[0])

    def select(self, index: slice | torch.Tensor) -> TensorBatch:
        """The sequences picked by ``index`` along the batch dimension (a slice, an index tensor or
        a boolean mask), for micro-batching. ``S`` and ``T`` are kept, so a micro-batch's tensors
        line up with the full batch's."""

        def pick(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[index]

        return attrs.evolve(
            self,
            tokens=self.tokens[index],
            attention_mask=self.attention_mask[index],
            response_index=self.response_index[index],
            response_mask=self.response_mask[index],
            advantages=self.advantages[index],
            returns=pick(self.returns),
            old_log_probs=pick(self.old_log_probs),
            ref_log_probs=pick(self.ref_log_probs),
            old_values=pick(self.old_values),
            rollout_log_probs=pick(self.rollout_log_probs),
            model_token_mask=pick(self.model_token_mask),
        )


def tensorize(batch: TrainBatch, pad_id: int, device: torch.device | str = "cpu") -> TensorBatch:
    """``batch`` as a :class:`TensorBatch` on ``device``; per-token floats become ``float32``.

    Raises ``ValueError`` when a sample with a non-empty response has an empty prompt (its first
    response token would have no logits to predict it).
    """
    base = tensorize_samples(batch.samples, pad_id, device)
    mask = base.response_mask.cpu()

    def floats(rows: tuple[tuple[float, ...], ...]) -> torch.Tensor | None:
        if not rows:
            return None
        return _pad_floats(rows, mask, device)

    advantages = floats(batch.advantages)
    return attrs.evolve(
        base,
        advantages=base.advantages if advantages is None else advantages,
        returns=floats(batch.returns),
        old_log_probs=floats(batch.old_log_probs),
        ref_log_probs=floats(batch.ref_log_probs),
        old_values=floats(batch.old_values),
        rollout_log_probs=floats(batch.rollout_log_probs),
    )


def tensorize_samples(
    samples: Sequence[Sample], pad_id: int, device: torch.device | str = "cpu"
) -> TensorBatch:
    """``samples`` as a :class:`TensorBatch` with zero advantages and no optional fields but the
    model-token mask (set when some sample's generation has a loss mask), for forward-only passes
    (reference log-probs, critic values)."""
    prompts = [s.prompt.token_ids for s in samples]
    responses = [s.response.token_ids for s in samples]
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if r and not p:
            raise ValueError(
                f"sample {i} has an empty prompt: no logits predict its first response token "
                "(prompts need at least one token, e.g. <bos>)"
            )
    prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    resp_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    seq_len = int((prompt_len + resp_len).max()) if samples else 0
    width = int(resp_len.max()) if samples else 0

    # Each row's valid entries are a prefix, so a boolean-mask assignment of the concatenated
    # rows fills them in order: no Python loop over padded positions.
    attention_mask = torch.arange(seq_len) < (prompt_len + resp_len).unsqueeze(1)
    tokens = torch.full((len(samples), seq_len), pad_id, dtype=torch.long)
    tokens[attention_mask] = torch.tensor(
        [t for p, r in zip(prompts, responses, strict=True) for t in (*p, *r)], dtype=torch.long
    )
    positions = torch.arange(width)
    response_index = (prompt_len.unsqueeze(1) + positions - 1).clamp(0, max(seq_len - 1, 0))
    response_mask = positions < resp_len.unsqueeze(1)
    model_token_mask = None
    if any(s.response.loss_mask for s in samples):
        model_token_mask = torch.zeros_like(response_mask)
        model_token_mask[response_mask] = torch.tensor(
            [bool(m) for s in samples for m in s.response.model_mask], dtype=torch.bool
        )
    return TensorBatch(
        tokens=tokens.to(device),
        attention_mask=attention_mask.to(device),
        response_index=response_index.to(device),
        response_mask=response_mask.to(device),
        advantages=torch.zeros(len(samples), width, dtype=torch.float32, device=device),
        model_token_mask=None if model_token_mask is None else model_token_mask.to(device),
    )


def _pad_floats(
    rows: Sequence[Sequence[float]], mask: torch.Tensor, device: torch.device | str
) -> torch.Tensor:
    """Ragged float rows as a ``float32`` tensor shaped like ``mask`` (``[B, T]``, True on each
    row's prefix of ``len(row)`` entries), 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[mask] = torch.tensor([x for row in rows for x in row], dtype=torch.float32)
    return out.to(device)


def _response_rows(x: torch.Tensor, batch: TensorBatch) -> torch.Tensor:
    """The rows of ``x[B, S, ...]`` at ``batch.response_index``: ``[B, T, ...]``."""
    index = batch.response_index
    if x.dim() == 2:
        return x.gather(1, index)
    expanded = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(
        *index.shape, *x.shape[2:]
    )
    return x.gather(1, expanded)


def _response_targets(batch: TensorBatch) -> torch.Tensor:
    """The response token ids, ``LongTensor[B, T]`` (clamped positions on padding)."""
    last = max(batch.tokens.shape[1] - 1, 0)
    return batch.tokens.gather(1, (batch.response_index + 1).clamp(max=last))


def token_log_probs(
    logits: torch.Tensor, batch: TensorBatch, temperature: float = 1.0, *, at_response: bool = False
) -> torch.Tensor:
    """``log_softmax(logits / T)`` at each response token: ``Tensor[B, T]``, 0 on padding.

    ``logits`` is ``Tensor[B, S, V]`` from a causal LM over ``batch.tokens``; ``temperature`` is
    the rollout engine's sampling temperature (:func:`rlcore.logits.tempered`: the policy that
    sampled is the one scored; 0, greedy, scores at 1). Only the ``B * T`` rows that predict
    response tokens are gathered, and the log-probability is computed as
    ``z[target] - logsumexp(z)`` over those rows, so no ``[B, S, V]`` log-softmax is ever
    materialised. Half-precision logits are upcast to ``float32`` (only the gathered rows).
    Differentiable with respect to ``logits``.

    ``at_response``: ``logits`` is ``Tensor[B, T, V]``, the rows at ``batch.response_index``
    already (a model that computed its output head there only, e.g. transformers'
    ``logits_to_keep``): the same log-probs without the ``[B, S, V]`` logits.
    """
    rows = _policy_rows(logits, batch, temperature, at_response)  # [B, T, V]
    targets = _response_targets(batch).unsqueeze(-1)  # [B, T, 1]
    picked = rows.gather(-1, targets).squeeze(-1) - torch.logsumexp(rows, dim=-1)
    return picked.masked_fill(~batch.response_mask, 0.0)


def entropy_from_logits(
    logits: torch.Tensor, batch: TensorBatch, temperature: float = 1.0, *, at_response: bool = False
) -> torch.Tensor:
    """Entropy of the next-token distribution that samples each response token: ``Tensor[B, T]``.

    ``logits`` is ``Tensor[B, S, V]``; the distribution is ``softmax(logits / T)`` as in
    :func:`token_log_probs`. ``H = logsumexp(z) - sum softmax(z) * z`` over the gathered rows
    (as verl's ``entropy_from_logits``); 0 on padding. Differentiable. ``at_response`` as in
    :func:`token_log_probs`.
    """
    rows = _policy_rows(logits, batch, temperature, at_response)  # [B, T, V]
    log_z = torch.logsumexp(rows, dim=-1)
    probs = torch.softmax(rows, dim=-1)
    entropy = log_z - (probs * rows).sum(dim=-1)
    return entropy.masked_fill(~batch.response_mask, 0.0)


def gather_response(values: torch.Tensor, batch: TensorBatch) -> torch.Tensor:
    """A critic's per-position values ``Tensor[B, S]`` at the response tokens: ``Tensor[B, T]``.

    Reads the *predicting* position ``P_i + j - 1`` (``batch.response_index``), i.e. the value of
    the state after the prompt and the first ``j`` response tokens, before response token ``j`` is
    emitted: ``V(s_j)`` as GAE needs it. This is the same shift as OpenRLHF's critic
    (``values[:, -num_actions - 1:-1]``). 0 on padding.
    """
    return _response_rows(values, batch).masked_fill(~batch.response_mask, 0.0)


def unpad(x: torch.Tensor, batch: TensorBatch) -> list[tuple[float, ...]]:
    """``x: Tensor[B, T]`` as ragged rows of Python floats, one per sample, each as long as its
    response (the inverse of the padding :func:`tensorize` applies)."""
    lengths = batch.response_mask.sum(dim=1).tolist()
    rows = x.detach().cpu().tolist()
    return [tuple(row[:n]) for row, n in zip(rows, lengths, strict=True)]


def _policy_rows(
    logits: torch.Tensor, batch: TensorBatch, temperature: float, at_response: bool
) -> torch.Tensor:
    """The logits that predict the response tokens, in at least ``float32`` and tempered:
    ``Tensor[B, T, V]``, what the log-probs and the entropy are read from. ``at_response``:
    ``logits`` holds those rows already (:func:`token_log_probs`)."""
    if at_response:
        want = tuple(batch.response_index.shape)
        if tuple(logits.shape[:2]) != want:
            raise ValueError(
                f"logits at the response positions have shape {tuple(logits.shape)}, "
                f"response_index {want}"
            )
        rows = logits
    else:
        rows = _response_rows(logits, batch)
    return tempered(_upcast(rows), temperature)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least ``float32``: log-softmax over a vocabulary in bf16/fp16 loses digits."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x
