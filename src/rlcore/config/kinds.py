"""Settings that name a kind found by name, whose options are the kind's own: the rollout engine
(``--rollout-engine``, :mod:`rlcore.engines`) and the training backend (``--train-backend``,
:mod:`rlcore.backends`).

Why the options live with the kind and not in :class:`~rlcore.config.RunConfig`: the core cannot
name the fields of engines and backends it does not know, and each kind checks its own settings.
The config holds the chosen kind's options as an opaque value (``RolloutConfig.engine_options``,
``ModelConfig.backend_options``) that :func:`rlcore.config.flags.load_config` builds from the
kind's flags or its config-file section (``[sglang]``, ``[megatron]``), and that the kind
type-checks when it uses them. Both choices are described once here, in :data:`CHOICES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

import attrs

from rlcore.backends import KNOWN_BACKENDS, load_backend_kind
from rlcore.engines import KNOWN_ENGINES, load_engine
from rlcore.errors import BackendUnavailableError, ConfigProblem
from rlcore.imports import Registry

__all__ = ["CHOICES", "KindChoice", "options_problem"]


@final
@attrs.frozen
class KindChoice:
    """A setting ``section.field`` (flag ``flag``) naming a ``what`` of ``registry``, whose
    options go in ``section.options_field``; ``load`` finds a kind by name (it has an
    ``options_type``)."""

    section: str
    field: str
    options_field: str
    flag: str
    what: str
    registry: Registry
    load: Callable[[str], Any]

    def chosen(self, config: object) -> str:
        """The name ``config`` (a :class:`~rlcore.config.RunConfig`) chooses."""
        name: str = getattr(getattr(config, self.section), self.field)
        return name

    def with_options(self, config: Any, options: object) -> Any:
        """``config`` with the chosen kind's options set to ``options``."""
        section = getattr(config, self.section)
        changed = attrs.evolve(section, **{self.options_field: options})
        return attrs.evolve(config, **{self.section: changed})

    def options_types(self) -> dict[str, type[Any]]:
        """Name -> options class, for the installed kinds whose options have flags."""
        out: dict[str, type[Any]] = {}
        for name in self.registry:
            try:
                options_type = self.load(name).options_type
            except BackendUnavailableError:
                continue
            if any("flag" in f.metadata for f in attrs.fields(options_type)):
                out[name] = options_type
        return out


CHOICES: tuple[KindChoice, ...] = (
    KindChoice(
        "rollout", "engine", "engine_options", "--rollout-engine", "rollout engine",
        KNOWN_ENGINES, load_engine,
    ),
    KindChoice(
        "model", "train_backend", "backend_options", "--train-backend", "backend",
        KNOWN_BACKENDS, load_backend_kind,
    ),
)  # fmt: skip
"""The rollout engine and the training backend, each found by name with options of its own."""


def options_problem(choice: KindChoice, section: object) -> tuple[ConfigProblem | None, Any]:
    """Whether the config section ``section`` (``choice.section``'s) names a known, installed
    kind whose options (if set) are of its type: ``(problem, kind)``, the kind ``None`` when
    there is a problem."""
    name: str = getattr(section, choice.field)
    where = f"{choice.section}.{choice.field} ({choice.flag})"
    if name not in choice.registry:
        known = ", ".join(sorted(choice.registry))
        return ConfigProblem(where, f"unknown {choice.what} {name!r}", f"use one of: {known}"), None
    try:
        kind = choice.load(name)
    except BackendUnavailableError as exc:
        return ConfigProblem(where, str(exc)), None
    options = getattr(section, choice.options_field)
    if options is not None and not isinstance(options, kind.options_type):
        return (
            ConfigProblem(
                f"{choice.section}.{choice.options_field}",
                f"{choice.what} {name!r} takes {kind.options_type.__name__}, "
                f"got {type(options).__name__}",
            ),
            None,
        )
    return None, kind
