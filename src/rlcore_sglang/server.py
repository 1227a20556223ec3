"""One SGLang server as rlcore sees it: an HTTP endpoint and, when we launched it, its process.

:class:`SGLangServer` is the only place that speaks HTTP to SGLang (stdlib ``urllib``, so neither
``requests`` nor ``sglang`` is needed). Every call has a timeout; every failure becomes a
:class:`~rlcore.errors.RolloutError` that names the server and, for a server we launched, quotes
the tail of its log. A launched server's process is a
:class:`~rlcore.protocols.hosts.HostedProcess`: on this machine or on a cluster node
(:mod:`rlcore_sglang.launcher` starts it). Also here: the helpers that call several servers at once.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Final, TypeVar, final

import attrs

from rlcore.engines.hosts import free_port
from rlcore.errors import RolloutError
from rlcore.protocols.hosts import HostedProcess

__all__ = [
    "CallPolicy",
    "SGLangHTTPError",
    "SGLangServer",
    "ServerTimeoutError",
    "ServerUnreachableError",
    "first_error",
    "free_port",
    "message_of",
    "on_all",
    "post_ok",
    "post_with_retries",
    "run_all",
    "start_all",
    "wait_all",
]

LOG_TAIL_LINES: Final = 40
_POLL_S: Final = 0.5
_T = TypeVar("_T")


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


@final
class SGLangServer:
    """An SGLang HTTP endpoint; with ``process``, also the server process we launched (on this
    machine or a cluster node, see :mod:`rlcore_sglang.launcher`), which :meth:`shutdown` stops.

    ``log_path`` is where that process writes its log, on its host (for messages).
    """

    def __init__(
        self,
        url: str,
        *,
        process: HostedProcess | None = None,
        log_path: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path
        self._stopped = False

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
        code = self.process.poll() if self.process is not None else None
        if code is not None:
            raise RolloutError(
                f"{self.describe()} exited with code {code} {doing}" + self.log_tail_text()
            )

    def is_alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop a launched server's process group (SIGTERM, then SIGKILL). Safe to call twice;
        a no-op for servers we only connected to."""
        if self._stopped:
            return
        self._stopped = True
        if self.process is not None:
            self.process.stop(timeout_s)

    # -- diagnostics -------------------------------------------------------------------------

    def describe(self) -> str:
        if self.process is None:
            return f"SGLang server {self.url}"
        return f"SGLang server {self.url} (pid {self.process.pid}, log {self.log_path})"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last ``lines`` lines of a launched server's log (empty when connected by URL)."""
        return self.process.log_tail(lines) if self.process is not None else []

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

    def info(self, *, timeout_s: float) -> Mapping[str, object]:
        """The server's ``/server_info`` (empty if it has none that rlcore can read)."""
        try:
            info = json.loads(self.get("/server_info", timeout_s=timeout_s))
        except (RolloutError, json.JSONDecodeError):
            return {}
        return info if isinstance(info, dict) else {}

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


# -- calls that must succeed ------------------------------------------------------------------


@final
@attrs.frozen
class CallPolicy:
    """How hard a call is tried: transport-level failures (and HTTP 503) are retried
    ``retries`` times with exponential backoff; a call the server accepted but did not answer
    within the timeout is not (it may still be running)."""

    retries: int = 3
    backoff_s: float = 0.5


def post_with_retries(
    server: SGLangServer,
    path: str,
    payload: Mapping[str, object],
    timeout_s: float,
    policy: CallPolicy = CallPolicy(),
) -> object:
    """POST under ``policy``; a dead launched server is reported with its log tail."""
    attempts = policy.retries + 1
    for attempt in range(attempts):
        server.raise_if_exited(f"before {path}")
        try:
            return server.post(path, payload, timeout_s=timeout_s)
        except ServerUnreachableError as exc:
            server.raise_if_exited(f"during {path}")
            if attempt + 1 == attempts:
                raise RolloutError(
                    f"{exc}\ngave up after {attempts} attempts; check that the server is "
                    f"running and reachable{server.log_tail_text()}"
                ) from exc
            time.sleep(policy.backoff_s * 2**attempt)
        except ServerTimeoutError as exc:
            server.raise_if_exited(f"during {path}")
            raise RolloutError(f"{exc}{server.log_tail_text()}") from exc
        except SGLangHTTPError as exc:
            if exc.status != 503 or attempt + 1 == attempts:
                raise
            time.sleep(policy.backoff_s * 2**attempt)
    raise AssertionError("unreachable")


def post_ok(
    server: SGLangServer,
    path: str,
    payload: Mapping[str, object],
    timeout_s: float,
    policy: CallPolicy = CallPolicy(),
) -> None:
    """POST a control call (weight sync, sessions) and insist on ``success: true``."""
    try:
        answer = post_with_retries(server, path, payload, timeout_s, policy)
    except SGLangHTTPError as exc:
        raise RolloutError(
            f"{server.describe()} failed {path}: {message_of(exc.body)}" + server.log_tail_text()
        ) from exc
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RolloutError(
            f"{server.describe()} failed {path}: {answer.get('message')}" + server.log_tail_text()
        )


def message_of(body: str) -> str:
    """The message of an SGLang error body (JSON or text)."""
    try:
        decoded = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:2000]
    if isinstance(decoded, dict):
        return str(decoded.get("message") or decoded.get("error") or decoded)
    return str(decoded)


def on_all(servers: Sequence[SGLangServer], call: Callable[[SGLangServer], object]) -> None:
    """``call(server)`` for every server at once; the first failure is raised."""
    run_all([partial(call, s) for s in servers], len(servers))
