"""Where a sampling temperature meets a model's logits: the one place the scaling is computed.

A rollout engine at temperature ``T`` samples each token from ``softmax(logits / T)``. That is
the policy that acted, so it is the policy rlcore trains, as slime (``get_log_probs_and_entropy``
with ``--rollout-temperature``) and verl (``dp_actor``: ``logits.div_(temperature)``) do: every
log-prob and entropy in a run (the engine's behaviour log-probs, the actor's, the old policy's,
the reference model's, a distillation teacher's) is of :func:`tempered` logits, with the
rollout's ``T``. Without it the trainer would differentiate the untempered policy on samples
drawn from the tempered one, with no correction.

top-k and top-p restrict what is sampled but not the log-probs: those are of the whole tempered
distribution, not of the truncated one renormalised (slime, verl and SGLang do the same).
Greedy decoding (``T = 0``) samples from no distribution; its log-probs are of the logits as
they are (``T = 1``), as SGLang's are.

The functions take any object with ``/`` (a ``torch.Tensor``); this module imports nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["logprob_temperature", "tempered"]


def logprob_temperature(temperature: float) -> float:
    """The temperature whose distribution the log-probs of a rollout sampled at ``temperature``
    are of: ``temperature`` itself, or 1 for greedy decoding (``temperature == 0``)."""
    return temperature if temperature > 0 else 1.0


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T`` with ``T = logprob_temperature(temperature)``: the logits whose softmax a
    rollout sampled at ``temperature`` drew from (module docstring). ``logits`` itself when
    ``T == 1``. Any shape; differentiable."""
    scale = logprob_temperature(temperature)
    return logits if scale == 1.0 else logits / scale
