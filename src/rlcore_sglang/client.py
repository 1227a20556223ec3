"""SGLang as the rollout engine: data-parallel HTTP servers, launched by the run or connected by
URL. :class:`SGLangEngine` satisfies :class:`~rlcore.protocols.engine.RolloutEngine`.

Generation goes through ``/generate`` with token ids (batched requests, a concurrency limit,
retries with backoff on connection errors). A weight update (:meth:`SGLangEngine.receive_weights`)
opens a ``/begin_weight_update`` ... ``/end_weight_update`` session on every server (SGLang 0.5.23
refuses tensor and distributed updates outside one) and hands out the sinks of
:mod:`rlcore_sglang.weight_sync` for the chosen mode: the weight source runs them where the
weights are (a Megatron rank), so the weights never pass through this process unless the source
lives here. Every mode flushes the prefix cache and records the weight version on the servers;
generations carry the version the server reports. Nothing waits forever: each HTTP call, the
group join and every broadcast have timeouts.

With ``options.fault_tolerance`` (``--use-fault-tolerance``), a launched server that dies or stops
answering is replaced (:mod:`rlcore_sglang.restarts`), given the weights served, and the request
that failed is sent again.

This module, :mod:`rlcore_sglang.server`, :mod:`rlcore_sglang.weight_sync` and
:mod:`rlcore_sglang.teacher` are the only ones that know SGLang's wire format; none imports
``sglang``.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Final, final
from urllib.parse import urlsplit

from rlcore.engines.hosts import LocalProcessHost
from rlcore.errors import RolloutError
from rlcore.protocols.hosts import ProcessHost
from rlcore.samples import FinishReason, Generation, Prompt, SamplingParams
from rlcore.weights import NamedTensors, WeightSink, WeightSource, deliver
from rlcore_sglang import server_loader
from rlcore_sglang.launcher import LaunchSettings, launch_servers
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.restarts import Restarter
from rlcore_sglang.server import (
    CallPolicy,
    SGLangHTTPError,
    SGLangServer,
    on_all,
    post_ok,
    post_with_retries,
    run_all,
)
from rlcore_sglang.weight_sync.base import ServerRef
from rlcore_sglang.weight_sync.disk import DiskSink
from rlcore_sglang.weight_sync.distributed import BroadcastSink, close_sender
from rlcore_sglang.weight_sync.tensor import TensorSink, release_shared_buffers

__all__ = ["SGLangEngine", "sampling_payload"]

_GROUP_NAME: Final = "rlcore_weight_sync"
_DEFAULT_OPTIONS: Final = EngineOptions()


@final
class SGLangEngine:
    """A :class:`~rlcore.protocols.engine.RolloutEngine` over one or more SGLang servers (data
    parallel).

    Build it with :meth:`connect` (servers someone else runs) or :meth:`launch` (processes this
    engine starts, on this machine or on the hosts a cluster reserved, and stops). Use it as a
    context manager or call :meth:`close`.
    """

    def __init__(
        self,
        servers: Sequence[SGLangServer],
        options: EngineOptions = _DEFAULT_OPTIONS,
        *,
        tp_sizes: Sequence[int] | None = None,
        hosts: Sequence[str] | None = None,
        loaders: Sequence[str | None] | None = None,
        launched: tuple[LaunchSettings, Sequence[ProcessHost]] | None = None,
    ) -> None:
        """``hosts``: the address of each server's machine (default: the host in its URL).
        ``loaders``: the custom weight loader each server registered for tensor-mode updates
        (default: none, SGLang's own loading). ``launched``: how the servers were started and
        where, one host per server (what ``options.fault_tolerance`` restarts them with)."""
        if not servers:
            raise ValueError("SGLangEngine needs at least one server")
        if options.fault_tolerance is not None and launched is None:
            raise ValueError(
                "fault tolerance restarts the servers an engine launched (SGLangEngine.launch); "
                "servers it connected to are restarted by whoever runs them"
            )
        self._servers = list(servers)
        self.options = options
        self._tp_sizes = tuple(tp_sizes) if tp_sizes is not None else (1,) * len(servers)
        self._loaders = tuple(loaders) if loaders is not None else (None,) * len(servers)
        self._hosts = (
            tuple(hosts) if hosts is not None else tuple(_url_host(s.url) for s in servers)
        )
        self._policy = CallPolicy(options.connect_retries, options.retry_backoff_s)
        self._version = 0
        self._closed = False
        self._next_server = 0
        self._lock = threading.Lock()
        # Requests in flight, and whether a weight update holds new ones back: an update waits for
        # in-flight requests unless it interrupts them (receive_weights_interrupting).
        self._traffic = threading.Condition()
        self._in_flight = 0
        self._updating = False
        self._own_sync_dir: Path | None = None
        self._broadcast_used = False
        # Unique per engine: a server keeps a stale group under its name until it is destroyed.
        self._group_name = f"{_GROUP_NAME}_{uuid.uuid4().hex[:8]}"
        # The weights' source, once any were pushed: what a restarted server gets them from.
        self._source: WeightSource | None = None
        self._pushed = False
        self._restarter: Restarter | None = None
        if options.fault_tolerance is not None:
            assert launched is not None
            self._restarter = Restarter(options.fault_tolerance, *launched, self._servers)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def connect(
        cls, urls: Sequence[str], options: EngineOptions = _DEFAULT_OPTIONS
    ) -> SGLangEngine:
        """Use servers that are already running (``--sglang-url URL``, repeatable).

        Waits up to ``options.health_timeout_s`` for each ``/health`` and reads from each
        server's ``/server_info`` its tensor-parallel size and whether it registered rlcore's
        weight loader (:mod:`rlcore_sglang.server_loader`; start servers with
        ``--custom-weight-loader rlcore_sglang.server_loader.load_weights`` for faster tensor-mode
        syncs). Such servers must run without ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (SGLang's
        default), so that log-probs are of the tempered distribution that sampled, as the
        trainer computes them (with it set, ``train/actor/logprob_mismatch`` shows the gap at
        any temperature but 1).
        """
        servers = [SGLangServer(url) for url in urls]
        for server in servers:
            server.wait_until_healthy(options.health_timeout_s)
        infos = [server.info(timeout_s=options.request_timeout_s) for server in servers]
        return cls(
            servers,
            options,
            tp_sizes=[_tp_size(info) for info in infos],
            loaders=[_loader(info) for info in infos],
        )

    @classmethod
    def launch(
        cls,
        settings: LaunchSettings,
        num_servers: int = 1,
        options: EngineOptions = _DEFAULT_OPTIONS,
        *,
        hosts: Sequence[ProcessHost] | None = None,
    ) -> SGLangEngine:
        """Start servers at once and wait until all are healthy; if any fails, stop them all and
        raise :class:`~rlcore.errors.RolloutError` with its log tail.

        ``hosts``: one server on each (a cluster's reserved places); default ``num_servers``
        servers on this machine (GPU servers on consecutive runs of ``settings.tp_size`` GPUs).
        """
        if hosts is None:
            gpu = settings.device != "cpu"
            tp = settings.tp_size
            hosts = [
                LocalProcessHost(gpu_ids=range(i * tp, (i + 1) * tp) if gpu else ())
                for i in range(num_servers)
            ]
        servers = launch_servers(settings, hosts)
        return cls(
            servers,
            options,
            tp_sizes=[len(h.gpu_ids) or settings.tp_size for h in hosts],
            hosts=[h.address for h in hosts],
            loaders=[settings.weight_loader] * len(servers),
            launched=(settings, tuple(hosts)),
        )

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RolloutEngine -----------------------------------------------------------------------

    @property
    def servers(self) -> tuple[SGLangServer, ...]:
        """The servers now (a restarted server replaces the one that failed)."""
        return tuple(self._servers)

    @property
    def restarts(self) -> tuple[int, ...]:
        """How many times each server has been restarted (``--use-fault-tolerance``)."""
        return tuple(self._restarter.counts) if self._restarter is not None else ()

    @property
    def weight_version(self) -> int:
        return self._version

    def restore_weights_from(self, source: WeightSource | None) -> None:
        """Where the weights now served are: a server restarted under fault tolerance gets them
        from ``source`` before it serves (see
        :class:`~rlcore.protocols.engine.RestartingEngine`)."""
        self._source = source

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """Each server's tensor-parallel size (ranks in the weight-update group)."""
        return self._tp_sizes

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        """One generation per prompt, in order; batches are spread over the servers."""
        self._check_open()
        step = self.options.max_prompts_per_request
        chunks = [list(prompts[i : i + step]) for i in range(0, len(prompts), step)]
        sampling = sampling_payload(params, self.options.extra_sampling_params)
        jobs = [partial(self._generate_chunk, self._pick_index(), c, sampling) for c in chunks]
        results = run_all(jobs, self.options.max_concurrent_requests)
        return [generation for chunk_result in results for generation in chunk_result]

    @contextmanager
    def receive_weights(self, version: int) -> Iterator[list[WeightSink]]:
        """Open a weight update on every server and yield the sinks for ``options.weight_sync``:
        one :class:`~rlcore_sglang.weight_sync.tensor.TensorSink` per machine with servers, or one
        :class:`~rlcore_sglang.weight_sync.distributed.BroadcastSink` / ``DiskSink`` for all of
        them. ``version`` is recorded when the block completes; a failure inside it is re-raised
        with the log tail of any server that died. Requests in flight (from another thread) finish
        first, and new ones wait for the update."""
        with self._traffic:
            self._updating = True
            while self._in_flight:
                self._traffic.wait()
        try:
            with self._update(version) as sinks:
                yield sinks
        finally:
            with self._traffic:
                self._updating = False
                self._traffic.notify_all()

    @property
    def interrupts_generation(self) -> bool:
        """Always: :meth:`receive_weights_interrupting` pauses the servers mid-generation."""
        return True

    @contextmanager
    def receive_weights_interrupting(self, version: int) -> Iterator[list[WeightSink]]:
        """As :meth:`receive_weights`, but requests in flight are not waited for: every server
        pauses generation (SGLang's ``/pause_generation`` in ``retract`` mode: running requests go
        back to its queue and their context is recomputed when they resume), takes the new
        weights, and continues (``/continue_generation``), so each request goes on from the
        tokens it had, with ``version`` (a partial rollout). A generation's
        ``first_weight_version`` is the version when it was sent, its ``weight_version`` the one
        the server reports at its end."""
        self._check_open()
        self._on_servers(lambda s: self._post_ok(s, "/pause_generation", {"mode": "retract"}))
        try:
            with self._update(version) as sinks:
                yield sinks
        finally:
            self._on_servers(lambda s: self._post_ok(s, "/continue_generation", {}))

    @contextmanager
    def _update(self, version: int, only: int | None = None) -> Iterator[list[WeightSink]]:
        """A weight update of every server, or of server ``only`` (a restarted one)."""
        self._check_open()
        if only is None:
            self._revive_dead()
        indices = range(len(self._servers)) if only is None else (only,)
        servers = [self._servers[i] for i in indices]
        sinks = self._sinks(version, indices)
        session = self.options.weight_sync != "disk"
        if session:
            on_all(servers, self._begin)
        try:
            yield sinks
        except BaseException as exc:
            if session:
                try:
                    on_all(servers, self._end)
                except RolloutError:
                    pass  # best effort: the first failure is the one to report
            dead = [server for server in servers if not server.is_alive()]
            if dead and isinstance(exc, Exception):
                raise _died(dead[0], version, exc) from exc
            raise
        if session:
            on_all(servers, self._end)
        self._version = version
        self._pushed = True

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        """Send ``weights`` (Hugging Face names) from this process and record ``version``: the
        same as running :meth:`receive_weights`' sinks here."""
        with self.receive_weights(version) as sinks:
            deliver(weights, sinks)

    def update_weights_from_disk(self, folder: Path, version: int) -> None:
        """Load a Hugging Face safetensors folder the servers can read (for example one written by
        a checkpoint exporter) and record ``version``. Independent of ``options.weight_sync``."""
        self._check_open()
        payload = {"model_path": str(folder), "weight_version": str(version), "flush_cache": True}
        self._on_servers(lambda s: self._post_ok(s, "/update_weights_from_disk", payload))
        self._version = version

    def close(self) -> None:
        """Leave the broadcast group, stop launched servers, drop buffers. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._restarter is not None:
            self._restarter.close(timeout_s=self.options.request_timeout_s)
        if self._broadcast_used:
            close_sender(self._group_name, self._refs())
        for server in self.servers:
            server.shutdown()
        release_shared_buffers()
        if self._own_sync_dir is not None:
            shutil.rmtree(self._own_sync_dir, ignore_errors=True)

    # -- weight updates ----------------------------------------------------------------------

    def _refs(self, indices: Sequence[int] | None = None) -> tuple[ServerRef, ...]:
        chosen = range(len(self.servers)) if indices is None else indices
        return tuple(
            ServerRef(self.servers[i].url, self._tp_sizes[i], self._loaders[i]) for i in chosen
        )

    def _sinks(self, version: int, indices: Sequence[int]) -> list[WeightSink]:
        mode = self.options.weight_sync
        if mode == "tensor":
            by_host: dict[str, list[int]] = {}
            for index in indices:
                by_host.setdefault(self._hosts[index], []).append(index)
            return [
                TensorSink(host, self._refs(indices), version, self.options)
                for host, indices in by_host.items()
            ]
        if mode == "distributed":
            self._broadcast_used = True
            return [BroadcastSink(self._refs(indices), self._group_name, version, self.options)]
        return [DiskSink(self._refs(indices), self._sync_root(), version, self.options)]

    def _sync_root(self) -> Path:
        if self.options.sync_dir is not None:
            return self.options.sync_dir
        if self._own_sync_dir is None:
            self._own_sync_dir = Path(tempfile.mkdtemp(prefix="rlcore-sglang-weights-"))
        return self._own_sync_dir

    def _post_ok(self, server: SGLangServer, path: str, payload: Mapping[str, object]) -> None:
        post_ok(server, path, payload, self.options.weight_sync_timeout_s, self._policy)

    def _on_servers(self, call: Callable[[SGLangServer], object]) -> None:
        on_all(self.servers, call)

    def _begin(self, server: SGLangServer) -> None:
        try:
            self._post_ok(server, "/begin_weight_update", {})
        except RolloutError as exc:
            if "already open" not in str(exc):
                raise
            # A session left open by a client that died mid-sync: close it, start afresh.
            self._post_ok(server, "/end_weight_update", {})
            self._post_ok(server, "/begin_weight_update", {})

    def _end(self, server: SGLangServer) -> None:
        self._post_ok(server, "/end_weight_update", {})

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("this SGLangEngine is closed; build a new one")

    # -- generation --------------------------------------------------------------------------

    def _pick_index(self) -> int:
        with self._lock:
            index = self._next_server % len(self._servers)
            self._next_server += 1
        return index

    def _generate_chunk(
        self, index: int, prompts: list[Prompt], sampling: Mapping[str, object]
    ) -> list[Generation]:
        with self._traffic:
            while self._updating:  # a weight update that waits for requests holds new ones back
                self._traffic.wait()
            self._in_flight += 1
            dispatched = self._version
        try:
            while True:
                restarter = self._restarter
                server = self._servers[index] if restarter is None else restarter.server(index)
                try:
                    return self._post_chunk(server, prompts, sampling, dispatched)
                except RolloutError as exc:
                    if restarter is None or not restarter.lost(server, exc):
                        raise
                    # The chunk's answer never came: sent again in full, to the new server.
                    restarter.replace(index, server, str(exc).splitlines()[0], self._refresh)
                    dispatched = self._version
        finally:
            with self._traffic:
                self._in_flight -= 1
                self._traffic.notify_all()

    def _post_chunk(
        self,
        server: SGLangServer,
        prompts: list[Prompt],
        sampling: Mapping[str, object],
        dispatched: int,
    ) -> list[Generation]:
        payload = {
            "input_ids": [list(p.token_ids) for p in prompts],
            "sampling_params": sampling,
            "return_logprob": True,
        }
        try:
            answer = post_with_retries(
                server, "/generate", payload, self.options.request_timeout_s, self._policy
            )
        except SGLangHTTPError as exc:
            if exc.status == 400 and "unknown field" in exc.body:
                raise RolloutError(
                    f"{server.describe()} rejected a sampling parameter: {exc.body.strip()}. "
                    f"rlcore sent {sorted(sampling)}; remove the unknown name from "
                    "EngineOptions.extra_sampling_params (or use an SGLang version that knows it)"
                ) from exc
            raise RolloutError(f"{exc}{server.log_tail_text()}") from exc
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(prompts):
            raise RolloutError(
                f"{server.describe()} returned {len(items)} results for {len(prompts)} prompts"
            )
        return [self._parse_generation(server, item, dispatched) for item in items]

    def _parse_generation(self, server: SGLangServer, item: object, dispatched: int) -> Generation:
        try:
            assert isinstance(item, dict)
            meta = item["meta_info"]
            token_ids = tuple(int(t) for t in item["output_ids"])
            entries = meta["output_token_logprobs"]
            log_probs = tuple(float(entry[0]) for entry in entries)
            logprob_ids = tuple(int(entry[1]) for entry in entries)
            finish = meta["finish_reason"]
            finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
            text = str(item.get("text", ""))
            version_text = str(meta.get("weight_version", ""))
        except (AssertionError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise RolloutError(
                f"{server.describe()} sent a /generate answer rlcore cannot read ({exc!r}): "
                f"{str(item)[:500]}"
            ) from exc
        if logprob_ids != token_ids:
            raise RolloutError(
                f"{server.describe()}: output_token_logprobs name tokens {logprob_ids[:8]}... "
                f"but output_ids are {token_ids[:8]}...; is the server an SGLang 0.5.x?"
            )
        reason: FinishReason = "abort"
        if finish_type == "stop":
            reason = "stop"
        elif finish_type == "length":
            reason = "length"
        version = int(version_text) if version_text.isdigit() else self._version
        return Generation(
            token_ids,
            log_probs,
            text,
            reason,
            version,
            first_weight_version=min(dispatched, version),
        )

    # -- fault tolerance ---------------------------------------------------------------------

    def _revive_dead(self) -> None:
        """Replace the servers that died since the last call (before a weight update, which
        then gives them the new weights)."""
        if self._restarter is None:
            return
        for index, server in enumerate(self.servers):
            if not server.is_alive():
                self._restarter.replace(index, server, "it exited while idle")

    def _refresh(self, index: int) -> None:
        """The weights served (if any were pushed), to the new server ``index``, from their
        source."""
        if not self._pushed:
            return  # it serves the model folder's, as the others do
        if self._source is None:
            raise RolloutError(
                f"{self._servers[index].describe()} was restarted and needs the weights of "
                f"version {self._version}, but no process holds them any more (the trainer "
                "moved ahead of the engine, as with --max-staleness above 0)"
            )
        with self._update(self._version, only=index) as sinks:
            self._source.send_weights(sinks)


# -- helpers ---------------------------------------------------------------------------------


def _died(server: SGLangServer, version: int, cause: Exception) -> RolloutError:
    return RolloutError(
        f"weight update to version {version} failed ({cause}) and "
        f"{server.describe()} is no longer running" + server.log_tail_text()
    )


def _url_host(url: str) -> str:
    """The machine a server runs on, from its URL (loopback names stay loopback: the weight
    source maps them to the machine of whoever opened the update)."""
    return urlsplit(url).hostname or "127.0.0.1"


def sampling_payload(params: SamplingParams, extra: Mapping[str, object]) -> dict[str, object]:
    """rlcore's :class:`SamplingParams` as SGLang's ``/generate`` ``sampling_params``."""
    payload: dict[str, object] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # rlcore's "off" is 0; SGLang's is -1.
        "top_k": params.top_k if params.top_k > 0 else -1,
        "skip_special_tokens": True,
    }
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra)
    return payload


def _tp_size(info: Mapping[str, object]) -> int:
    size = info.get("tp_size", 1)
    return size if isinstance(size, int) and size >= 1 else 1


def _loader(info: Mapping[str, object]) -> str | None:
    """rlcore's weight loader if the server registered it, else ``None`` (SGLang's own)."""
    registered = info.get("custom_weight_loader")
    return (
        server_loader.NAME
        if isinstance(registered, list) and server_loader.NAME in registered
        else None
    )
