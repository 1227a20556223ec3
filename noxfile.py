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
DEV = ("pytest>=8", "hypothesis>=6.100", "mypy>=1.15", "types-psutil")


def _install(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", ".[megatron,wandb]", *DEV)


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


SGLANG_VERSION = "0.5.23"
SGLANG_SHIMS = "tools/sglang_shims"


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """SGLang integration tests against real SGLang servers on the CPU (tests/sglang).

    SGLang's wheel requires CUDA-only packages, so it is installed without them: CPU torch first,
    SGLang's other requirements with torch pinned, SGLang itself with ``--no-deps``, and the
    test-only shims in tools/sglang_shims put on ``sys.path`` of this virtualenv by a ``.pth``
    file (see tools/sglang_shims/README.md). Caches stay under .nox/.
    """
    nox_dir = os.path.abspath(os.path.join(session.virtualenv.location, os.pardir))
    session.env["PIP_CACHE_DIR"] = os.path.join(nox_dir, "sglang-pip-cache")
    session.install(*CONSTRAINTS, "torch")
    cpu_pins = ("-c", f"{SGLANG_SHIMS}/constraints-cpu.txt")
    session.install(*cpu_pins, "-r", f"{SGLANG_SHIMS}/requirements-cpu.txt")
    session.install("--no-deps", f"sglang=={SGLANG_VERSION}")
    # The Megatron extra too: the CLI end-to-end test runs
    # `rlcore_megatron.run --rollout-engine sglang`.
    session.install(*cpu_pins, "-e", ".[megatron]", *DEV)
    site_packages = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    assert isinstance(site_packages, str)
    pth = os.path.join(site_packages.strip(), "rlcore-sglang-shims.pth")
    with open(pth, "w") as f:
        f.write(os.path.abspath(SGLANG_SHIMS) + "\n")

    cache = os.path.join(nox_dir, "sglang-cache")
    env = {
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        "SGLANG_CACHE_DIR": cache,
        "XDG_CACHE_HOME": cache,
    }
    # Its own cache: this mypy sees different third-party versions than the typecheck session's.
    mypy_cache = os.path.join(nox_dir, "sglang-mypy-cache")
    session.run("mypy", "--cache-dir", mypy_cache, "stubs/sglang", "tests/sglang")
    session.run(
        "pytest",
        "tests/sglang",
        "-p",
        "no:cacheprovider",
        "--durations=10",
        *session.posargs,
        env=env,
    )
