"""One SGLang server as rlcore sees it: an HTTP endpoint and, when we launched it, its process.

:class:`SGLangServer` is the only place that speaks HTTP to SGLang (stdlib ``urllib``, so the client
side needs neither ``requests`` nor ``sglang``) and the only place that starts or stops
``python -m sglang.launch_server``. Every call has a timeout; every failure becomes a
:class:`~rlcore.errors.RolloutError` that names the server and, for a server we launched, quotes
the tail of its log. :mod:`rlcore.engines.sglang` builds the data-parallel engine on top.
"""

from __future__ import annotations

import atexit
import collections
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Final, TypeVar, final

import attrs

from rlcore.errors import RolloutError

__all__ = [
    "LaunchSettings",
    "SGLangHTTPError",
    "SGLangServer",
    "ServerTimeoutError",
    "ServerUnreachableError",
    "first_error",
    "free_port",
    "run_all",
    "start_all",
    "wait_all",
]

LOG_TAIL_LINES: Final = 40
_POLL_S: Final = 0.5
_T = TypeVar("_T")


@final
@attrs.frozen
class LaunchSettings:
    """How to start ``python -m sglang.launch_server`` (one process per data-parallel server).

    ``port = 0`` picks a free port per server. ``device="cpu"`` also sets
    ``SGLANG_USE_CPU_ENGINE=1``; on the CPU keep ``max_total_tokens`` small (SGLang otherwise
    sizes its KV pool from free RAM, about 14 GB). ``python`` is the interpreter that has SGLang
    installed (default: this one).
    ``log_dir`` receives ``sglang-<i>.log`` per server (default: a fresh temporary folder).
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` is always set so that returned log-probs are at
    temperature 1, as :class:`~rlcore.samples.Generation` promises.
    ``sleep_on_idle`` (SGLang's ``--sleep-on-idle``) lets the scheduler block on its sockets
    instead of spinning a core while no request is pending (measured on the CPU: 1.0 CPU-second
    per second idle without it, 0.02 with it). An RL run leaves its servers idle during every
    train step, often on the trainer's machine, where a spinning scheduler takes CPU from it.
    """

    model_path: Path
    tokenizer_path: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_total_tokens: int | None = 8192
    tp_size: int = 1
    random_seed: int = 1234
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict)
    startup_timeout_s: float = 600.0
    log_dir: Path | None = None
    sleep_on_idle: bool = True

    def command(self, port: int, base_gpu_id: int) -> list[str]:
        """The argv that starts one server on ``port`` (GPU servers start at ``base_gpu_id``)."""
        cmd = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--host", self.host,
            "--port", str(port),
            "--device", self.device,
            "--dtype", self.dtype,
            "--tp-size", str(self.tp_size),
            "--random-seed", str(self.random_seed),
            # The warmup request sends text through the tokenizer; rlcore only sends token ids.
            "--skip-server-warmup",
        ]  # fmt: skip
        if self.tokenizer_path is not None:
            cmd += ["--tokenizer-path", str(self.tokenizer_path)]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.device != "cpu":
            cmd += ["--base-gpu-id", str(base_gpu_id)]
        if self.sleep_on_idle:
            cmd.append("--sleep-on-idle")
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        if self.model_path.is_dir():  # a local folder: never a model hub lookup
            env["HF_HUB_OFFLINE"] = "1"
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.update(self.env)
        return env


class ServerUnreachableError(RolloutError):
    """The call never reached the server's HTTP handler: the connection was refused, reset or
    could not be made (a call that connected but got no answer in time is a
    :class:`ServerTimeoutError`)."""


class ServerTimeoutError(RolloutError):
    """The server accepted the call but did not answer in time (not retried: it may still run)."""


class SGLangHTTPError(RolloutError):
    """The server answered with an HTTP error status; ``status`` and ``body`` say what it said."""

    def __init__(self, message: str, status: int, body: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@final
class SGLangServer:
    """An SGLang HTTP endpoint; owns its process and log when :meth:`launch` started it."""

    def __init__(
        self,
        url: str,
        *,
        process: subprocess.Popen[bytes] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path
        self._log_file: IO[bytes] | None = None
        self._stopped = False

    # -- launching and stopping -------------------------------------------------------------

    @classmethod
    def launch(cls, settings: LaunchSettings, index: int = 0) -> SGLangServer:
        """Start one server process (non-blocking); call :meth:`wait_until_healthy` next."""
        port = settings.port + index if settings.port else free_port(settings.host)
        log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="rlcore-sglang-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"sglang-{index}.log"
        log_file = log_path.open("wb")
        cmd = settings.command(port, base_gpu_id=index * settings.tp_size)
        try:
            # A new session: SGLang forks a scheduler and a detokenizer; we stop the whole group.
            process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=settings.environment(),
                start_new_session=True,
            )
        except OSError as exc:
            log_file.close()
            raise RolloutError(
                f"could not start SGLang server {index} with {settings.python!r}: {exc}; "
                "pass LaunchSettings(python=...) pointing at an interpreter with sglang installed"
            ) from exc
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        server = cls(f"http://{host}:{port}", process=process, log_path=log_path)
        server._log_file = log_file
        # The server runs in its own session, so it would outlive a run that dies without
        # closing its engine: stop it at interpreter exit too (a no-op once shut down).
        atexit.register(server.shutdown, 10.0)
        return server

    def wait_until_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; raise with the log tail if the process dies or
        ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            self.raise_if_exited("while starting")
            try:
                self.get("/health", timeout_s=5.0)
                return
            except RolloutError as exc:
                last = str(exc).splitlines()[0]
            time.sleep(_POLL_S)
        raise RolloutError(
            f"{self.describe()} was not healthy after {timeout_s:.0f} s (last: {last}); "
            "raise LaunchSettings.startup_timeout_s or check the server's log"
            + self.log_tail_text()
        )

    def raise_if_exited(self, doing: str) -> None:
        """Raise a :class:`RolloutError` with the log tail when our server process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise RolloutError(
                f"{self.describe()} exited with code {self.process.returncode} {doing}"
                + self.log_tail_text()
            )

    def is_alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop a launched server's process group (SIGTERM, then SIGKILL). Safe to call twice;
        a no-op for servers we only connected to."""
        if self._stopped:
            return
        self._stopped = True
        process = self.process
        if process is not None and process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=timeout_s)
        if process is not None:
            # Children (scheduler, detokenizer) may outlive the parent: end the group anyway.
            _signal_group(process, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # -- diagnostics -------------------------------------------------------------------------

    def describe(self) -> str:
        if self.process is None:
            return f"SGLang server {self.url}"
        return f"SGLang server {self.url} (pid {self.process.pid}, log {self.log_path})"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last ``lines`` lines of a launched server's log (empty when connected by URL)."""
        if self.log_path is None or not self.log_path.exists():
            return []
        if self._log_file is not None:
            self._log_file.flush()
        with self.log_path.open("rb") as f:
            tail = collections.deque(f, maxlen=lines)
        return [line.decode("utf-8", "replace").rstrip("\n") for line in tail]

    def log_tail_text(self) -> str:
        tail = self.log_tail()
        if not tail:
            if self.process is None:
                return "\n(connected by URL: see the server's own log)"
            return "\n(the server's log is empty)"
        return "\n--- last lines of the server log ---\n" + "\n".join(tail)

    # -- HTTP --------------------------------------------------------------------------------

    def get(self, path: str, *, timeout_s: float) -> str:
        return self._request("GET", path, None, timeout_s)

    def post(self, path: str, payload: Mapping[str, object], *, timeout_s: float) -> object:
        """POST ``payload`` as JSON and return the decoded JSON answer (or the text when it is
        not JSON). Raises :class:`ServerUnreachableError` or :class:`SGLangHTTPError`."""
        text = self._request("POST", path, json.dumps(payload).encode(), timeout_s)
        try:
            decoded: object = json.loads(text)
        except json.JSONDecodeError:
            return text
        return decoded

    def _request(self, method: str, path: str, body: bytes | None, timeout_s: float) -> str:
        request = urllib.request.Request(
            self.url + path,
            data=body,
            method=method,
            headers={"Content-Type": "application/json"} if body is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return bytes(response.read()).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            raise SGLangHTTPError(
                f"{self.describe()} answered {method} {path} with HTTP {exc.code}: {text[:2000]}",
                exc.code,
                text,
            ) from exc
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError):
                raise ServerTimeoutError(
                    f"{self.describe()} did not answer {method} {path} within {timeout_s:g} s; "
                    "raise the timeout (EngineOptions.request_timeout_s / weight_sync_timeout_s) "
                    "if the server is just slow"
                ) from exc
            raise ServerUnreachableError(
                f"{self.describe()} could not be reached for {method} {path}: {reason!r}"
            ) from exc


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- calls to several servers at once -------------------------------------------------------


def start_all(calls: Sequence[Callable[[], object]]) -> list[Future[None]]:
    """Run each call in its own daemon thread; the futures complete with its outcome."""
    futures: list[Future[None]] = []
    for call in calls:
        future: Future[None] = Future()

        def run(call: Callable[[], object] = call, future: Future[None] = future) -> None:
            try:
                call()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(None)

        threading.Thread(target=run, daemon=True).start()
        futures.append(future)
    return futures


def first_error(futures: Sequence[Future[None]]) -> BaseException | None:
    for future in futures:
        if future.done() and future.exception() is not None:
            return future.exception()
    return None


def wait_all(futures: Sequence[Future[None]], *, swallow: bool = False) -> None:
    """Wait for every future (each HTTP call has its own timeout) and re-raise the first error."""
    first: BaseException | None = None
    for future in futures:
        exc = future.exception()
        if exc is not None and first is None:
            first = exc
    if first is not None and not swallow:
        raise first


def run_all(calls: Sequence[Callable[[], _T]], max_workers: int) -> list[_T]:
    """Run ``calls`` on a bounded pool; return results in order or raise the first failure
    (cancelling what has not started)."""
    if not calls:
        return []
    if len(calls) == 1:
        return [calls[0]()]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
