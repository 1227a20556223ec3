"""What generates: the rollout engine, its optional capabilities, and a distillation teacher.

A :class:`RolloutEngine` generates from the current policy weights and takes new ones through the
sinks it hands out (:class:`~rlcore.weights.WeightSink`); a :class:`PartialRolloutEngine` takes
them mid-generation (``--partial-rollout``) and a :class:`RestartingEngine` restarts a server that
died (``--use-fault-tolerance``). The functions at the end ask an engine for those capabilities
without the caller testing for them. A :class:`TeacherServer` scores rollouts for on-policy
distillation and is not a stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from rlcore.errors import RolloutError
from rlcore.samples import Generation, Prompt, Sample, SamplingParams
from rlcore.weights import WeightSink, WeightSource

__all__ = [
    "PartialRolloutEngine",
    "RestartingEngine",
    "RolloutEngine",
    "TeacherServer",
    "keep_weight_source",
    "receive_weights_midway",
    "takes_weights_midway",
]


class RolloutEngine(Protocol):
    """Generates responses from the current policy weights.

    ``generate`` returns exactly one :class:`Generation` per prompt, in order (repeat a prompt to
    sample it several times). ``receive_weights(version)`` opens a weight update: it yields the
    sinks that must each receive the full new weights (see :class:`WeightSink`), and when the
    block ends without an error the engine serves them as ``version`` (later generations carry
    it). When the block raises, the engine does not record the version. The caller never has to
    hold the weights: a :class:`WeightSource` sends them. Failures raise
    :class:`~rlcore.errors.RolloutError`; nothing waits forever.
    """

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]: ...

    def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]: ...

    @property
    def weight_version(self) -> int: ...

    def close(self) -> None:
        """Release servers, processes and memory. Safe to call twice."""
        ...


@runtime_checkable
class PartialRolloutEngine(RolloutEngine, Protocol):
    """A rollout engine that takes new weights while ``generate`` runs in another thread: the
    partial rollouts of an off-policy schedule (``--partial-rollout``).

    ``receive_weights_interrupting(version)`` interrupts every in-flight request at a token
    boundary and yields the sinks, like ``receive_weights``; once they hold the new weights, the
    requests continue from the tokens already made, sampled from ``version`` (the context is
    recomputed with the new weights). A generation's ``first_weight_version`` and
    ``weight_version`` say which versions made its first and last token, and each token's log-prob
    is the one the version that sampled it gave. ``interrupts_generation`` is ``True`` when it
    does so (a wrapper answers for the engine it wraps); ``receive_weights`` alone, from another
    thread, waits for in-flight requests to finish instead.
    """

    @property
    def interrupts_generation(self) -> bool: ...

    def receive_weights_interrupting(
        self, version: int
    ) -> AbstractContextManager[Sequence[WeightSink]]: ...


@runtime_checkable
class RestartingEngine(RolloutEngine, Protocol):
    """A rollout engine that restarts a server that died or stopped answering and resubmits the
    requests it held (``--use-fault-tolerance``). A restarted server starts from the model
    folder, so the engine must get the weights it serves again: ``restore_weights_from(source)``
    names the :class:`WeightSource` that holds them (the loop passes the policy each time it
    pushes its weights, which in the synchronous schedule stay the served ones while the engine
    generates), or ``None`` when no source holds them (a restart then fails, naming why).
    """

    def restore_weights_from(self, source: WeightSource | None) -> None: ...


class TeacherServer(Protocol):
    """A distillation teacher served outside the run (``--opd-type sglang``): the loop asks it
    for the teacher's log-probs of every rollout as the rollout is made
    (:func:`rlcore.loop.rollouts.rollout_source`). It is not a stack: nothing of it can be trained,
    loaded or synced."""

    def score(self, samples: Sequence[Sample], temperature: float) -> list[tuple[float, ...]]:
        """Per response token of each sample: its log-probability under the teacher tempered
        at ``temperature`` (the rollout's: ``softmax(logits / T)``, as the student's log-probs
        are; :func:`rlcore.logits.tempered`), given the sample's prompt and the response tokens
        before it. Raises :class:`~rlcore.errors.RolloutError` naming the server when it cannot
        answer."""
        ...


def takes_weights_midway(engine: RolloutEngine) -> bool:
    """Whether ``engine`` takes new weights mid-generation
    (:class:`~rlcore.protocols.engine.PartialRolloutEngine`)."""
    return isinstance(engine, PartialRolloutEngine) and engine.interrupts_generation


def receive_weights_midway(
    engine: RolloutEngine, version: int
) -> AbstractContextManager[Sequence[WeightSink]]:
    """``engine.receive_weights_interrupting(version)``; a
    :class:`~rlcore.errors.RolloutError` naming the engine when it cannot take weights
    mid-generation."""
    if not isinstance(engine, PartialRolloutEngine) or not engine.interrupts_generation:
        raise RolloutError(
            f"rollout engine {type(engine).__name__} cannot take new weights mid-generation "
            "(--partial-rollout); use the embedded or SGLang engine, or drop --partial-rollout"
        )
    return engine.receive_weights_interrupting(version)


def keep_weight_source(engine: RolloutEngine, source: WeightSource | None) -> None:
    """Tell an engine that restarts servers (:class:`RestartingEngine`) where the weights it now
    serves are; nothing for other engines."""
    if isinstance(engine, RestartingEngine):
        engine.restore_weights_from(source)
