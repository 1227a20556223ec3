"""SGLang as the rollout engine: data-parallel HTTP servers, launched by the run or connected by
URL. :class:`SGLangEngine` satisfies :class:`~rlcore.protocols.engine.RolloutEngine`.

Generation goes through ``/generate`` with token ids (batched requests, a concurrency limit,
retries with backoff on connection errors). A weight update (:meth:`SGLangEngine.receive_weights`)
opens a ``/begin_weight_update`` ... ``/end_weight_update`` session on every server (SGLang 0.5.23
refuses tensor and distributed updates outside one) and hands out the sinks of
:mod:`rlcore_sglang.weight_sync` for the chosen mode
(:class:`~rlcore_sglang.weight_sync.session.WeightUpdates`): the weight source runs them where the
weights are (a Megatron rank), so the weights never pass through this process unless the source
lives here. Every mode flushes the prefix cache and records the weight version on the servers;
generations carry the version the server reports. Nothing waits forever: each HTTP call, the
group join and every broadcast have timeouts.

With ``options.fault_tolerance`` (``--use-fault-tolerance``), a launched server that dies or stops
answering is replaced (:mod:`rlcore_sglang.restarts`), given the weights served, and the request
that failed is sent again.

This module, :mod:`rlcore_sglang.generate` (``/generate``'s requests and answers),
:mod:`rlcore_sglang.server`, :mod:`rlcore_sglang.weight_sync` and :mod:`rlcore_sglang.teacher` are
the only ones that know SGLang's wire format; none imports ``sglang``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Final, final

from rlcore.engines.hosts import LocalProcessHost
from rlcore.errors import RolloutError
from rlcore.protocols.hosts import ProcessHost
from rlcore.samples import Generation, Prompt, SamplingParams
from rlcore.weights import NamedTensors, WeightSink, WeightSource, deliver
from rlcore_sglang import server_loader
from rlcore_sglang.generate import parse_generation, post_generate, sampling_payload
from rlcore_sglang.launcher import LaunchSettings, launch_servers
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.restarts import Restarter
from rlcore_sglang.server import CallPolicy, SGLangServer, on_all, run_all
from rlcore_sglang.weight_sync.session import WeightUpdates
from rlcore_sglang.weight_sync.tensor import release_shared_buffers

__all__ = ["SGLangEngine"]

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
        self._updates = WeightUpdates(
            self._servers,
            options,
            self._policy,
            tp_sizes=self._tp_sizes,
            loaders=tuple(loaders) if loaders is not None else (None,) * len(servers),
            hosts=hosts,
        )
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
        with self._updates.session(version, indices) as sinks:
            yield sinks
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
        self._updates.leave_group()
        for server in self.servers:
            server.shutdown()
        release_shared_buffers()
        self._updates.remove_sync_dir()

    # -- weight updates ----------------------------------------------------------------------

    def _post_ok(self, server: SGLangServer, path: str, payload: Mapping[str, object]) -> None:
        self._updates.post_ok(server, path, payload)

    def _on_servers(self, call: Callable[[SGLangServer], object]) -> None:
        on_all(self.servers, call)

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
        items = post_generate(
            server, prompts, sampling, self.options.request_timeout_s, self._policy
        )
        return [parse_generation(server, item, dispatched, self._version) for item in items]

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
