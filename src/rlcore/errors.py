"""The error tree. Every error rlcore raises on purpose is an :class:`RLCoreError`.

Backend errors are translated at the edge (the Megatron backend, the SGLang client) and re-raised
``from`` the original, so a user can catch one root and still read the cause.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs

__all__ = [
    "BackendContractError",
    "BackendError",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ConfigProblem",
    "DataError",
    "PlanError",
    "RLCoreError",
    "RewardError",
    "RolloutError",
    "causes",
]


class RLCoreError(Exception):
    """Root of every error rlcore raises on purpose."""


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what caused it (``raise ... from``, or the exception being handled), and so
    on down the chain."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


@attrs.frozen
class ConfigProblem:
    """One invalid setting: where it is (``optim.lr_warmup_iters``), what is wrong, what to do."""

    path: str
    message: str
    hint: str = ""
    reads: tuple[str, ...] = attrs.field(default=(), eq=False, repr=False)
    """The other settings (field paths: ``rollout.num_rollout``) whose values the broken rule
    read: the problem is derived from them, and is not reported when one of them has a problem
    of its own (:func:`rlcore.config.fields.root_problems`)."""

    @property
    def field(self) -> str:
        """The setting the problem is about, without its flag (``rollout.num_rollout``)."""
        return self.path.split(" (", 1)[0]

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text


class ConfigError(RLCoreError):
    """A configuration that cannot run. Lists *all* problems found, each with its field path."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str = "") -> None:
        self.problems: tuple[ConfigProblem, ...] = tuple(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.problems)} configuration problem(s){where}:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[tuple[ConfigProblem, ...], str]]:
        # Pickling (Ray sends a rank's errors to the driver) must rebuild from the problems: the
        # default would call ConfigError(message) and list the message one character per line.
        return (type(self), (self.problems, self.source))

    @property
    def paths(self) -> tuple[str, ...]:
        """The field paths of all problems, in the order found."""
        return tuple(p.path for p in self.problems)


class PlanError(RLCoreError):
    """A valid configuration that cannot be turned into a plan (for example an unresolved count)."""


class BackendError(RLCoreError):
    """A backend or one of its stacks broke its contract (a missing protocol method, the wrong
    number of results) or failed with an error of its own. The message names the component."""


class BackendContractError(BackendError):
    """A backend built something that is not what it was asked for: an eval stack that carries an
    optimizer, a scheduler or a training step, or a stack of the wrong kind. The message names the
    backend and what it exposed."""


class BackendUnavailableError(RLCoreError):
    """A backend or engine was asked for by name but its packages are not installed."""


class RolloutError(RLCoreError):
    """The rollout engine failed (a server died, timed out or rejected a request) or broke its
    contract (the wrong number of generations)."""


class CheckpointError(RLCoreError):
    """A checkpoint is missing, corrupt, or its parts disagree. The message names the path."""


class DataError(RLCoreError):
    """Malformed prompt data. The message names the file and line."""


class RewardError(RLCoreError):
    """A reward function raised. The message names the sample."""
