"""How a Ray rank group's failures are told: :class:`RayGroupError` (and :class:`RankLostError`,
what ``--max-restarts`` restarts on), and :func:`death`, a dead actor's account in a sentence.
:mod:`rlcore.launch.ray.ranks` says when each is raised."""

from __future__ import annotations

import re

from ray.exceptions import OutOfMemoryError, RayError

from rlcore.errors import RLCoreError

__all__ = ["RankLostError", "RayGroupError", "death"]


class RayGroupError(RLCoreError):
    """A Ray rank group could not start, a rank's actor died, or a call on it failed or timed out.

    Errors the stacks raise on purpose (a :class:`~rlcore.errors.CheckpointError`, ...) pass
    through as themselves; this wraps everything else, ``from`` Ray's exception.
    """


class RankLostError(RayGroupError):
    """A rank's actor died (killed, out of memory, its machine gone) or stopped answering (a call
    timed out): the group cannot go on, but nothing says that a new one would fail the same way.
    ``--max-restarts`` rebuilds the run's groups from the latest checkpoint on this error only.
    """


def death(exc: RayError) -> str:
    """Ray's page-long account of a dead actor, in a sentence (the whole one stays in the
    exception's ``__cause__``)."""
    text = str(exc)
    if isinstance(exc, OutOfMemoryError) or "low on memory" in text or "memory pressure" in text:
        return (
            "Ray's memory monitor killed it: the machine ran low on memory. Lower "
            "--micro-batch-size or --rollout-batch-size, run fewer ranks per machine, or give "
            "the run more memory"
        )
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    return first + (f" (worker exit type {exit_type.group(1)})" if exit_type else "")
