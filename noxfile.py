"""Sessions: ``tests`` (pytest: core, properties, Megatron on the CPU, Ray) and ``typecheck``
(``mypy --strict`` over src/, tests/typing/ and examples/). ``nox -s tests typecheck`` is the
README's test command and what CI runs.

Every install goes through ``constraints.txt`` so that pip takes the CPU torch wheel.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
CONSTRAINTS = ("-c", "constraints.txt")
DEV = ("pytest>=8", "hypothesis>=6.100", "mypy>=1.15")


def _install(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", ".[megatron]", *DEV)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (SGLang-server tests live in the ``sglang`` session)."""
    _install(session)
    env = {"HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    session.run("pytest", "-m", "not sglang", *session.posargs, env=env)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict with our stubs; no blanket ignore_missing_imports."""
    _install(session)
    session.run("mypy", *session.posargs)
