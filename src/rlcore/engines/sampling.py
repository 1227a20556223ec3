"""What the in-process engines share: sampling the next token, and copying weights into a model
held in this process (the :class:`~rlcore.weights.InProcess` sinks of
:class:`~rlcore.engines.embedded.EmbeddedEngine` and
:class:`~rlcore.engines.torch_engine.TorchEngine`).

This module imports torch; ``import rlcore`` does not import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from rlcore.errors import RolloutError
from rlcore.logits import tempered
from rlcore.samples import SamplingParams
from rlcore.weights import NamedTensors

__all__ = ["check_params", "copy_weights", "sample_next_tokens"]


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of each row and say its log-probability: ``logits: Tensor[B, V]`` ->
    ``(tokens: Tensor[B] (int64), log_probs: Tensor[B])``.

    ``temperature == 0`` is greedy (argmax). Otherwise the logits are tempered
    (:func:`rlcore.logits.tempered`), restricted to the ``top_k`` largest (``0`` = off; ties at
    the k-th value are all kept) and then to the smallest set whose probability reaches ``top_p``
    (``1.0`` = off; the most likely token is always kept), and one token is drawn with
    ``generator``: the order Hugging Face applies them. ``log_probs`` are of the whole tempered
    distribution (``log_softmax(logits / T)``), not of the truncated one: what the trainer
    computes for the same tokens.
    """
    scores = tempered(logits, params.temperature)
    if params.temperature == 0:
        tokens = scores.argmax(dim=-1)
    else:
        tokens = torch.multinomial(
            _truncated(scores, params).softmax(dim=-1), num_samples=1, generator=generator
        ).squeeze(-1)
    log_probs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs


def _truncated(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``scores: Tensor[B, V]`` with what ``params.top_k`` and ``params.top_p`` leave out set to
    ``-inf``."""
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p (keeps at least the first).
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.empty_like(scores).scatter_(-1, order, sorted_scores)
    return scores


def check_params(params: SamplingParams, engine: str) -> None:
    """Raise :class:`~rlcore.errors.RolloutError` naming ``engine`` for parameters out of range."""
    problems = []
    if params.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if not params.temperature >= 0:
        problems.append(f"temperature must be >= 0 (0 = greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        problems.append(f"top_p must be in (0, 1] (1 = off), got {params.top_p}")
    if params.top_k < 0:
        problems.append(f"top_k must be >= 0 (0 = off), got {params.top_k}")
    if problems:
        raise RolloutError(f"{engine}: bad sampling parameters: " + "; ".join(problems))


Resolve = Callable[[Mapping[str, torch.Tensor], str], "torch.Tensor | None"]
"""Where a named tensor goes in a model's ``state_dict(keep_vars=True)``, or ``None`` if nowhere."""


def _same_name(targets: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    return targets.get(name)


def copy_weights(
    targets: Mapping[str, torch.Tensor],
    weights: NamedTensors,
    *,
    what: str,
    resolve: Resolve = _same_name,
) -> None:
    """Copy each named tensor of ``weights`` into its target among ``targets`` (a model's
    ``state_dict(keep_vars=True)``), in place. Every name and shape is checked before anything is
    written, so a bad update leaves the model as it was: an unknown name or a shape mismatch
    raises :class:`~rlcore.errors.RolloutError` that starts with ``what`` and lists each offender.
    Any subset of the targets may be given, and a tensor may come as row blocks
    (:attr:`~rlcore.weights.Takes.row_blocks`)."""
    updates = []
    problems = []
    for name, tensor in weights:
        target = resolve(targets, name)
        if target is None:
            problems.append(f"unknown weight {name!r}")
            continue
        given = _as_given(target, tensor)
        if given is None:
            problems.append(
                f"{name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}"
            )
        updates.append((tensor, given))
    if problems:
        shown = "; ".join(problems[:10]) + (
            f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        )
        raise RolloutError(
            f"{what}: {shown}. Send weights under the model's names (its state_dict() keys) with "
            "matching shapes"
        )
    with torch.no_grad():
        for tensor, target in updates:
            assert target is not None  # checked above
            target.copy_(tensor)


def _as_given(target: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor | None:
    """``target`` in ``tensor``'s shape: itself, or a view of it as row blocks ``[blocks, rows,
    *rest]`` of its ``[blocks * rows, *rest]`` (:attr:`~rlcore.weights.Takes.row_blocks`);
    ``None`` when the shapes do not match so (or ``target`` cannot be viewed so)."""
    if tensor.shape == target.shape:
        return target
    blocks = tensor.shape
    if len(blocks) != target.dim() + 1 or blocks[0] * blocks[1] != target.shape[0]:
        return None
    if blocks[2:] != target.shape[1:]:
        return None
    try:
        return target.view(blocks)
    except RuntimeError:  # a strided target these rows cannot be cut from without a copy
        return None
