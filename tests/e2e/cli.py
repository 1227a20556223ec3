"""Running ``python -m rlcore_megatron.run`` as a user does, in a subprocess, while recording
every process it starts, so a test can check that nothing outlives it."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil

_POLL_S = 0.2


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WatchedCLI:
    """The CLI in a subprocess, its own session and process group (as a shell runs a foreground
    job; ``sigint_ignored``: with SIGINT ignored, as a shell script's background job inherits
    it); stdout and stderr go to files in ``folder``. Every descendant seen while it runs is
    recorded by pid and start time (so a reused pid is not mistaken for a survivor)."""

    def __init__(
        self,
        flags: Sequence[str],
        folder: Path,
        env: dict[str, str] | None = None,
        *,
        sigint_ignored: bool = False,
    ):
        folder.mkdir(parents=True, exist_ok=True)
        self._out = (folder / "stdout.txt").open("w")
        self._err_path = folder / "stderr.txt"
        self._err = self._err_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlcore_megatron.run", *flags],
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            # As a background job of a non-interactive shell starts it (a CI script's `cmd &`).
            preexec_fn=_ignore_sigint if sigint_ignored else None,
        )
        self.seen: dict[int, float] = {}
        self._root = psutil.Process(self.process.pid)

    def sample(self) -> None:
        try:
            children = self._root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                self.seen[child.pid] = child.create_time()
            except psutil.NoSuchProcess:
                pass

    def wait_for(self, condition: Path, timeout_s: float) -> None:
        """Sample until the file ``condition`` exists; fail with the stderr tail if the CLI exits
        first or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not condition.exists():
            self.sample()
            assert self.process.poll() is None, f"the CLI exited early:\n{self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {condition} after {timeout_s}s"
            time.sleep(_POLL_S)
        self.sample()

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            self.sample()
            if time.monotonic() > deadline:
                self.kill_everything()
                raise AssertionError(f"the CLI ran past {timeout_s}s:\n{self.stderr[-3000:]}")
            time.sleep(_POLL_S)
        self._out.close()
        self._err.close()
        return self.process.returncode

    def interrupt(self) -> None:
        """Ctrl-C in a terminal: SIGINT to the foreground process group."""
        os.killpg(self.process.pid, signal.SIGINT)

    def survivors(self, within_s: float) -> list[str]:
        """The recorded processes still alive after up to ``within_s`` seconds."""
        deadline = time.monotonic() + within_s
        while True:
            alive = []
            for pid, created in self.seen.items():
                try:
                    proc = psutil.Process(pid)
                    if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{pid} {' '.join(proc.cmdline())[:150]}")
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(_POLL_S)

    def shared_memory_left(self) -> list[str]:
        """torch's shared-memory files (``/dev/shm/torch_<pid>_*``) of the recorded processes: a
        CPU rank's parameters, which outlive a killed rank unless something removes them."""
        prefixes = tuple(f"torch_{pid}_" for pid in [self.process.pid, *self.seen])
        return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefixes))

    def kill_everything(self) -> None:
        """Clean up after a failed test: what it recorded, then the CLI itself."""
        for pid, created in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created:
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    @property
    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self._err_path.read_text()


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list[str]

    def do_GET(self) -> None:
        self.requests.append(f"GET {self.path}")
        self.send_error(404)

    def do_HEAD(self) -> None:
        self.requests.append(f"HEAD {self.path}")
        self.send_error(404)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def model_hub() -> Iterator[tuple[dict[str, str], list[str]]]:
    """A stand-in model hub on localhost that records every request: an environment pointing
    Hugging Face's clients at it (and not offline), and the list of requests it received."""
    requests: list[str] = []
    handler = type("Handler", (_Recorder,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield env, requests
    finally:
        server.shutdown()
        server.server_close()
