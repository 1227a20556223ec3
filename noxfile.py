"""Sessions: ``lint`` (ruff check + ruff format --check, and the import contracts of
pyproject.toml's ``[tool.importlinter]``), ``tests`` (pytest: core, properties,
Megatron on the CPU, Ray), ``typecheck`` (``mypy --strict`` over the whole tree, and stubtest of
stubs/megatron against the installed megatron-core), ``sglang`` (tests against real SGLang servers
on the CPU, and stubtest of stubs/sglang) and ``bench`` (every benchmark, one table of ratios; not
part of CI). ``nox -s lint tests typecheck`` and ``nox -s sglang`` are what CI runs.

Every install goes through ``constraints.txt`` (the pinned versions CI uses; on a CPU-only
package index that means the CPU torch wheel). The dev tools come from pyproject.toml's
``[dependency-groups]``: they are listed there once.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
CONSTRAINTS = ("-c", "constraints.txt")
PYPROJECT = nox.project.load_toml("pyproject.toml")


def _groups(*names: str) -> tuple[str, ...]:
    """The requirements of pyproject.toml's dependency groups ``names``."""
    return tuple(nox.project.dependency_groups(PYPROJECT, *names))


def _install(session: nox.Session, *groups: str) -> None:
    session.install(*CONSTRAINTS, "-e", ".[megatron,fsdp,wandb,plot]", *_groups(*groups))


def _stubtest(session: nox.Session, package: str) -> None:
    """mypy's stubtest: ``stubs/<package>`` against the installed package, so a stub that lies
    (a name that does not exist, a parameter that is not there) fails. What the stubs leave out
    on purpose is listed, with the reason, in ``stubs/<package>-allowlist.txt``."""
    session.run(
        "python",
        "-m",
        "mypy.stubtest",
        "--mypy-config-file",
        "stubs/stubtest.ini",
        "--ignore-missing-stub",
        "--allowlist",
        f"stubs/{package}-allowlist.txt",
        package,
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff, with the settings in pyproject.toml: lint, then check the formatting; then
    import-linter's contracts (the layers of rlcore's rooms, no circle anywhere), read from the
    source tree without installing it."""
    session.install(*CONSTRAINTS, *_groups("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports", env={"PYTHONPATH": "src"})


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the test suite (SGLang-server tests live in the ``sglang`` session)."""
    _install(session, "test")
    env = {"HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    session.run("pytest", "-m", "not sglang", *session.posargs, env=env)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the whole tree with our stubs (no blanket ignore_missing_imports),
    then stubtest of stubs/megatron."""
    _install(session, "test", "typecheck")
    session.run("mypy", *session.posargs)
    _stubtest(session, "megatron")


SGLANG_VERSION = "0.5.23"
SGLANG_SHIMS = "tools/sglang_shims"


def _install_sglang(session: nox.Session, nox_dir: str) -> None:
    """SGLang's wheel requires CUDA-only packages, so it is installed without them: CPU torch
    first, SGLang's other requirements with torch pinned, SGLang itself with ``--no-deps``, and
    the test-only shims in tools/sglang_shims put on ``sys.path`` of this virtualenv by a
    ``.pth`` file (see tools/sglang_shims/README.md)."""
    session.env["PIP_CACHE_DIR"] = os.path.join(nox_dir, "sglang-pip-cache")
    session.install(*CONSTRAINTS, "torch")
    cpu_pins = ("-c", f"{SGLANG_SHIMS}/constraints-cpu.txt")
    session.install(*cpu_pins, "-r", f"{SGLANG_SHIMS}/requirements-cpu.txt")
    session.install("--no-deps", f"sglang=={SGLANG_VERSION}")
    # The Megatron extra too: the CLI end-to-end test runs
    # `rlcore_megatron.run --rollout-engine sglang`.
    session.install(*cpu_pins, "-e", ".[megatron]", *_groups("test", "typecheck"))
    site_packages = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    assert isinstance(site_packages, str)
    pth = os.path.join(site_packages.strip(), "rlcore-sglang-shims.pth")
    with open(pth, "w") as f:
        f.write(os.path.abspath(SGLANG_SHIMS) + "\n")


def _nox_dir(session: nox.Session) -> str:
    return os.path.abspath(os.path.join(session.virtualenv.location, os.pardir))


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """SGLang integration tests against real SGLang servers on the CPU (tests/sglang), after mypy
    over them and stubtest of stubs/sglang against the installed SGLang. Caches stay under .nox/.
    """
    nox_dir = _nox_dir(session)
    _install_sglang(session, nox_dir)
    cache = os.path.join(nox_dir, "sglang-cache")
    env = {
        "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        "SGLANG_CACHE_DIR": cache,
        "XDG_CACHE_HOME": cache,
    }
    # Its own cache: this mypy sees different third-party versions than the typecheck session's.
    mypy_cache = os.path.join(nox_dir, "sglang-mypy-cache")
    session.run("mypy", "--cache-dir", mypy_cache, "stubs/sglang", "tests/sglang")
    _stubtest(session, "sglang")
    session.run(
        "pytest",
        "tests/sglang",
        "-p",
        "no:cacheprovider",
        "--durations=10",
        *session.posargs,
        env=env,
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Every benchmark under benchmarks/, then one table of their ratios (not part of CI: the
    numbers need an otherwise idle machine). Arguments after ``--`` go to ``benchmarks.run_all``
    (``--quick`` for a short smoke run). The ``bench`` dependency group adds TRL, which
    rl_step times rlcore against."""
    _install(session, "bench")
    session.run("python", "-m", "benchmarks.run_all", *session.posargs)
