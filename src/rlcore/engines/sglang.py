"""SGLang as the rollout engine: data-parallel HTTP servers, launched here or connected by URL.

:class:`SGLangEngine` satisfies :class:`~rlcore.protocols.RolloutEngine`. Generation goes through
``/generate`` with token ids (batched requests, a concurrency limit, retries with backoff on
connection errors). Weights reach the servers in one of three ways (:data:`WeightSyncMode`):

``tensor``
    ``/update_weights_from_tensor`` inside ``/begin_weight_update`` ... ``/end_weight_update``
    (SGLang 0.5.23 refuses it outside such a session). CPU tensors are copied once into a shared
    memory bucket and sent as ``torch.multiprocessing`` handles; the client switches torch to the
    ``file_system`` sharing strategy first (with file descriptors SGLang's scheduler dies).
    Needs the servers on this machine.
``distributed``
    ``/init_weights_update_group`` once, then per bucket ``/update_weights_from_distributed``
    (names, dtypes, shapes) while :class:`DistributedWeightSender` broadcasts as rank 0 (gloo on
    the CPU, NCCL on GPUs). Works across machines.
``disk``
    Hugging Face safetensors in a folder, then ``/update_weights_from_disk``. Needs a folder the
    servers can read.

Every mode flushes the prefix cache and records the weight version on the servers; generations
carry the version the server reports. Nothing waits forever: each HTTP call, the group join and
every broadcast have timeouts.

Only this module and :mod:`rlcore.engines.sglang_server` know SGLang's wire format. The client
never imports ``sglang``; it imports torch.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from datetime import timedelta
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Final, Literal, final

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing  # registers torch's pickling reductions with ForkingPickler
from torch._C._distributed_c10d import TCPStore

from rlcore.engines.sglang_server import (
    LaunchSettings,
    ServerTimeoutError,
    ServerUnreachableError,
    SGLangHTTPError,
    SGLangServer,
    first_error,
    free_port,
    run_all,
    start_all,
    wait_all,
)
from rlcore.errors import RolloutError
from rlcore.protocols import NamedTensors
from rlcore.samples import FinishReason, Generation, Prompt, SamplingParams

__all__ = [
    "DistributedWeightSender",
    "EngineOptions",
    "LaunchSettings",
    "SGLangEngine",
    "WeightSyncMode",
]

WeightSyncMode = Literal["tensor", "distributed", "disk"]
WEIGHT_SYNC_MODES: Final[tuple[WeightSyncMode, ...]] = ("tensor", "distributed", "disk")
_GROUP_NAME: Final = "rlcore_weight_sync"
_ALIGN: Final = 64
_POLL_S: Final = 0.2


@final
@attrs.frozen
class EngineOptions:
    """How the engine talks to its servers. Every wait is bounded by one of the timeouts."""

    weight_sync: WeightSyncMode = "tensor"
    """``tensor`` (same machine), ``distributed`` (torch.distributed broadcast) or ``disk``."""
    max_concurrent_requests: int = 16
    """``/generate`` calls in flight at once, over all servers."""
    max_prompts_per_request: int = 32
    """Prompts batched into one ``/generate`` call."""
    request_timeout_s: float = 600.0
    """Limit for one ``/generate`` call."""
    connect_retries: int = 3
    """Retries of a call that failed at the connection level, with exponential backoff."""
    retry_backoff_s: float = 0.5
    weight_sync_timeout_s: float = 600.0
    """Limit for each weight-sync step: an HTTP call, the group join, one bucket's broadcast."""
    bucket_bytes: int = 512 * 1024**2
    """Weights are sent in buckets of at most this many bytes (a larger tensor goes alone)."""
    sync_dir: Path | None = None
    """Where the ``disk`` mode writes safetensors (default: a temporary folder)."""
    master_address: str = "127.0.0.1"
    """``distributed`` mode: the address of this (the trainer's) process, reachable by servers."""
    master_port: int = 0
    """``distributed`` mode: the group's rendezvous port (0 picks a free one)."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto`` is NCCL when CUDA is available, else gloo."""
    extra_sampling_params: Mapping[str, object] = attrs.field(factory=dict)
    """Passed to SGLang as is (``repetition_penalty`` ...); unknown names are rejected by SGLang."""
    health_timeout_s: float = 60.0
    """Limit for a connected server's first ``/health`` answer."""

    def __attrs_post_init__(self) -> None:
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {self.weight_sync!r}"
            )
        if self.max_concurrent_requests < 1 or self.max_prompts_per_request < 1:
            raise ValueError("max_concurrent_requests and max_prompts_per_request must be >= 1")


@final
class SGLangEngine:
    """A :class:`~rlcore.protocols.RolloutEngine` over one or more SGLang servers (data parallel).

    Build it with :meth:`connect` (servers someone else runs) or :meth:`launch` (processes this
    engine starts and stops). Use it as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        servers: Sequence[SGLangServer],
        options: EngineOptions = EngineOptions(),
        *,
        tp_sizes: Sequence[int] | None = None,
    ) -> None:
        if not servers:
            raise ValueError("SGLangEngine needs at least one server")
        self.servers: tuple[SGLangServer, ...] = tuple(servers)
        self.options = options
        self._tp_sizes = tuple(tp_sizes) if tp_sizes is not None else (1,) * len(servers)
        self._version = 0
        self._closed = False
        self._next_server = 0
        self._lock = threading.Lock()
        self._sender: DistributedWeightSender | None = None
        self._shm_bucket: torch.Tensor | None = None
        self._own_sync_dir: Path | None = None
        self._last_disk_dir: Path | None = None
        # Unique per engine: a server keeps a stale group under its name until it is destroyed.
        self._group_name = f"{_GROUP_NAME}_{uuid.uuid4().hex[:8]}"

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def connect(cls, urls: Sequence[str], options: EngineOptions = EngineOptions()) -> SGLangEngine:
        """Use servers that are already running (``--sglang-url URL``, repeatable).

        Waits up to ``options.health_timeout_s`` for each ``/health`` and reads each server's
        tensor-parallel size from ``/server_info``. Such servers should run with
        ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so that log-probs are at temperature 1.
        """
        servers = [SGLangServer(url) for url in urls]
        for server in servers:
            server.wait_until_healthy(options.health_timeout_s)
        tp_sizes = [_server_tp_size(server, options.request_timeout_s) for server in servers]
        return cls(servers, options, tp_sizes=tp_sizes)

    @classmethod
    def launch(
        cls,
        settings: LaunchSettings,
        num_servers: int = 1,
        options: EngineOptions = EngineOptions(),
    ) -> SGLangEngine:
        """Start ``num_servers`` servers at once and wait until all are healthy; if any fails,
        stop them all and raise :class:`~rlcore.errors.RolloutError` with its log tail."""
        servers: list[SGLangServer] = []
        try:
            for index in range(num_servers):
                servers.append(SGLangServer.launch(settings, index))
            for server in servers:
                server.wait_until_healthy(settings.startup_timeout_s)
        except BaseException:
            for server in servers:
                server.shutdown()
            raise
        return cls(servers, options, tp_sizes=[settings.tp_size] * num_servers)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- RolloutEngine -----------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

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
        jobs = [partial(self._generate_chunk, self._pick_server(), c, sampling) for c in chunks]
        results = run_all(jobs, self.options.max_concurrent_requests)
        return [generation for chunk_result in results for generation in chunk_result]

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        """Replace the servers' weights with ``weights`` (Hugging Face names) and record
        ``version``; later generations carry it."""
        self._check_open()
        named = [(name, tensor.detach()) for name, tensor in weights]
        mode = self.options.weight_sync
        if mode == "tensor":
            self._sync_by_tensor(named, version)
        elif mode == "distributed":
            self._sync_by_broadcast(named, version)
        else:
            self._sync_by_disk(named, version)
        self._version = version

    def update_weights_from_disk(self, folder: Path, version: int) -> None:
        """Load a Hugging Face safetensors folder the servers can read (for example one written by
        a checkpoint exporter) and record ``version``. Independent of ``options.weight_sync``."""
        self._check_open()
        payload = {"model_path": str(folder), "weight_version": str(version), "flush_cache": True}
        self._on_all_servers(lambda s: self._post_ok(s, "/update_weights_from_disk", payload))
        self._version = version

    def close(self) -> None:
        """Leave the broadcast group, stop launched servers, drop buffers. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._sender is not None:
            self._drop_group()
        for server in self.servers:
            server.shutdown()
        self._shm_bucket = None
        if self._own_sync_dir is not None:
            shutil.rmtree(self._own_sync_dir, ignore_errors=True)

    # -- generation --------------------------------------------------------------------------

    def _pick_server(self) -> SGLangServer:
        with self._lock:
            server = self.servers[self._next_server % len(self.servers)]
            self._next_server += 1
        return server

    def _generate_chunk(
        self, server: SGLangServer, prompts: list[Prompt], sampling: Mapping[str, object]
    ) -> list[Generation]:
        payload = {
            "input_ids": [list(p.token_ids) for p in prompts],
            "sampling_params": sampling,
            "return_logprob": True,
        }
        try:
            answer = self._post_with_retries(
                server, "/generate", payload, self.options.request_timeout_s
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
        return [self._parse_generation(server, item) for item in items]

    def _parse_generation(self, server: SGLangServer, item: object) -> Generation:
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
        return Generation(token_ids, log_probs, text, reason, version)

    def _post_with_retries(
        self, server: SGLangServer, path: str, payload: Mapping[str, object], timeout_s: float
    ) -> object:
        attempts = self.options.connect_retries + 1
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
                time.sleep(self.options.retry_backoff_s * 2**attempt)
            except ServerTimeoutError as exc:
                server.raise_if_exited(f"during {path}")
                raise RolloutError(f"{exc}{server.log_tail_text()}") from exc
            except SGLangHTTPError as exc:
                if exc.status != 503 or attempt + 1 == attempts:
                    raise
                time.sleep(self.options.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    # -- weight sync: shared -----------------------------------------------------------------

    def _post_ok(self, server: SGLangServer, path: str, payload: Mapping[str, object]) -> None:
        """POST a weight-sync call and insist on ``success: true``."""
        try:
            answer = self._post_with_retries(
                server, path, payload, self.options.weight_sync_timeout_s
            )
        except SGLangHTTPError as exc:
            raise RolloutError(
                f"{server.describe()} failed {path}: {_message_of(exc.body)}"
                + server.log_tail_text()
            ) from exc
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RolloutError(
                f"{server.describe()} failed {path}: {answer.get('message')}"
                + server.log_tail_text()
            )

    def _on_all_servers(self, call: Callable[[SGLangServer], object]) -> None:
        run_all([partial(call, s) for s in self.servers], len(self.servers))

    def _weight_session(self, body: Callable[[], None]) -> None:
        """Run ``body`` between ``/begin_weight_update`` and ``/end_weight_update`` everywhere."""

        def begin(server: SGLangServer) -> None:
            try:
                self._post_ok(server, "/begin_weight_update", {})
            except RolloutError as exc:
                if "already open" not in str(exc):
                    raise
                # A session left open by a client that died mid-sync: close it, start afresh.
                self._post_ok(server, "/end_weight_update", {})
                self._post_ok(server, "/begin_weight_update", {})

        def end(server: SGLangServer) -> None:
            self._post_ok(server, "/end_weight_update", {})

        self._on_all_servers(begin)
        try:
            body()
        except BaseException:
            try:
                self._on_all_servers(end)
            except RolloutError:
                pass  # best effort: the first failure is the one to report
            raise
        self._on_all_servers(end)

    # -- weight sync: tensor -----------------------------------------------------------------

    def _sync_by_tensor(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        # With the default file_descriptor strategy the handles need a live connection to this
        # process, which SGLang's scheduler cannot make over HTTP: it dies. Process-wide, on
        # purpose. (torch leaves set_sharing_strategy unannotated.)
        set_strategy = torch.multiprocessing.set_sharing_strategy
        set_strategy("file_system")  # type: ignore[no-untyped-call]  # unannotated in torch
        buckets = list(_buckets(named, self.options.bucket_bytes))

        def send(
            server: SGLangServer,
            tp_size: int,
            shared: list[tuple[str, torch.Tensor]],
            request: dict[str, object],
        ) -> None:
            # One pickle per receiving rank: pickling takes a reference on the shared
            # memory and each unpickling releases one, so a payload must be read once.
            payloads = [pickle_b64(shared) for _ in range(tp_size)]
            body_ = dict(request, serialized_named_tensors=payloads)
            self._post_ok(server, "/update_weights_from_tensor", body_)

        def body() -> None:
            for index, bucket in enumerate(buckets):
                last = index + 1 == len(buckets)
                shared = self._share(bucket)
                request: dict[str, object] = {
                    "flush_cache": last,
                    "weight_version": str(version) if last else None,
                }
                pairs = zip(self.servers, self._tp_sizes, strict=True)
                run_all([partial(send, s, n, shared, request) for s, n in pairs], len(self.servers))

        self._weight_session(body)

    def _share(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Tensors another process on this machine can map without a further copy.

        CPU tensors are copied once into one reusable shared-memory buffer (one segment for the
        servers to map, no fresh pages to fault in on every sync); CUDA tensors travel as CUDA IPC
        handles as they are.
        """
        if any(t.is_cuda for _, t in bucket):
            return [(name, t.contiguous()) for name, t in bucket]
        return self._fill_shared_bucket(bucket)

    def _fill_shared_bucket(
        self, bucket: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        offsets, total = _layout(bucket)
        if self._shm_bucket is None or self._shm_bucket.numel() < total:
            buffer = torch.empty(total, dtype=torch.uint8)
            # torch leaves share_memory_ unannotated
            self._shm_bucket = buffer.share_memory_()  # type: ignore[no-untyped-call]  # see above
        out: list[tuple[str, torch.Tensor]] = []
        for (name, tensor), offset in zip(bucket, offsets, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            view = self._shm_bucket[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            out.append((name, view))
        return out

    # -- weight sync: distributed ------------------------------------------------------------

    def _sync_by_broadcast(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        sender = self._ensure_group()
        timeout = self.options.weight_sync_timeout_s
        buckets = list(_buckets(named, self.options.bucket_bytes))

        def body() -> None:
            for index, bucket in enumerate(buckets):
                last = index + 1 == len(buckets)
                payload = {
                    "names": [name for name, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self._group_name,
                    "flush_cache": last,
                    "weight_version": str(version) if last else None,
                }
                path = "/update_weights_from_distributed"
                calls = start_all([partial(self._post_ok, s, path, payload) for s in self.servers])
                try:
                    sender.broadcast([t for _, t in bucket], calls, timeout)
                except RolloutError:
                    # The group is in an unknown state: rebuild it on the next sync.
                    self._drop_group()
                    raise
                wait_all(calls)

        self._weight_session(body)

    def _ensure_group(self) -> DistributedWeightSender:
        if self._sender is not None:
            return self._sender
        options = self.options
        backend = options.dist_backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        port = options.master_port or free_port(options.master_address)
        world_size = 1 + sum(self._tp_sizes)
        calls: list[Callable[[], object]] = []
        rank_offset = 1
        for server, tp_size in zip(self.servers, self._tp_sizes, strict=True):
            payload = {
                "master_address": options.master_address,
                "master_port": port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": self._group_name,
                "backend": backend,
            }
            calls.append(partial(self._post_ok, server, "/init_weights_update_group", payload))
            rank_offset += tp_size
        # The servers' init calls block until rank 0 (this process) joins: run them concurrently.
        pending = start_all(calls)
        try:
            sender = DistributedWeightSender.join(
                options.master_address,
                port,
                world_size,
                backend=backend,
                group_name=self._group_name,
                timeout_s=options.weight_sync_timeout_s,
                abort_if=lambda: first_error(pending),
            )
        except BaseException:
            wait_all(pending, swallow=True)
            raise
        wait_all(pending)
        self._sender = sender
        return sender

    def _drop_group(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        for server in self.servers:
            if not server.is_alive():
                continue
            try:
                server.post(
                    "/destroy_weights_update_group",
                    {"group_name": self._group_name},
                    timeout_s=30.0,
                )
            except RolloutError:
                pass  # best effort: the server may be the reason we are dropping the group

    # -- weight sync: disk -------------------------------------------------------------------

    def _sync_by_disk(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        root = self.options.sync_dir
        if root is None:
            if self._own_sync_dir is None:
                self._own_sync_dir = Path(tempfile.mkdtemp(prefix="rlcore-sglang-weights-"))
            root = self._own_sync_dir
        folder = root / f"weights-v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.to("cpu").contiguous() for name, t in named}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        self.update_weights_from_disk(folder, version)
        previous, self._last_disk_dir = self._last_disk_dir, folder
        if previous is not None and previous != folder:
            shutil.rmtree(previous, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("this SGLangEngine is closed; build a new one")


@final
class DistributedWeightSender:
    """The trainer's end of SGLang's weight-update group: rank 0 of a process group of its own
    (the default group, if any, is untouched), broadcasting tensors that every server receives.

    SGLang's ``/init_weights_update_group`` makes each server rank join a group created by the
    same TCP rendezvous, with the group name as store prefix; this class joins it the same way.
    """

    def __init__(self, group: dist.ProcessGroup, world_size: int) -> None:
        self._group: dist.ProcessGroup | None = group
        self.world_size = world_size

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        backend: str = "gloo",
        group_name: str = _GROUP_NAME,
        timeout_s: float = 600.0,
        abort_if: Callable[[], BaseException | None] = lambda: None,
    ) -> DistributedWeightSender:
        """Host the rendezvous at ``master_address:master_port`` as rank 0 and wait (at most
        ``timeout_s``, giving up early when ``abort_if`` returns an error) for the other
        ``world_size - 1`` ranks."""
        from torch.distributed.distributed_c10d import (
            Backend,
            GroupName,
            PrefixStore,
            _new_process_group_helper,
            _world,
        )

        timeout = timedelta(seconds=timeout_s)
        store_box: list[TCPStore] = []
        error_box: list[BaseException] = []

        def host_store() -> None:
            try:
                store_box.append(
                    TCPStore(
                        master_address,
                        master_port,
                        world_size,
                        is_master=True,
                        timeout=timeout,
                        wait_for_workers=True,
                    )
                )
            except BaseException as exc:
                error_box.append(exc)

        waiter = threading.Thread(target=host_store, daemon=True)
        waiter.start()
        deadline = time.monotonic() + timeout_s
        while waiter.is_alive():
            waiter.join(_POLL_S)
            failure = abort_if()
            if failure is not None:
                raise RolloutError(
                    f"the weight-update group was not joined: {failure}"
                ) from failure
            if time.monotonic() > deadline:
                raise RolloutError(
                    f"the SGLang servers did not join the weight-update group at "
                    f"{master_address}:{master_port} within {timeout_s:.0f} s; check that they can "
                    "reach this address (EngineOptions.master_address)"
                )
        if error_box:
            raise RolloutError(
                f"could not host the weight-update rendezvous: {error_box[0]}"
            ) from error_box[0]
        store = PrefixStore(group_name, store_box[0])
        # Private torch API, the same call SGLang makes on its side: a group outside the default
        # world, so a trainer that already runs torch.distributed (Megatron) is not disturbed.
        group, _ = _new_process_group_helper(
            world_size,
            0,
            [],
            Backend(backend),
            store,
            group_name=GroupName(group_name),
            timeout=timeout,
        )
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        return cls(group, world_size)

    def broadcast(
        self,
        tensors: Sequence[torch.Tensor],
        watch: Sequence[Future[None]] = (),
        timeout_s: float = 600.0,
    ) -> None:
        """Broadcast ``tensors`` in order from rank 0. Gives up with a :class:`RolloutError` when a
        future in ``watch`` (the servers' HTTP calls) fails or ``timeout_s`` passes."""
        if self._group is None:
            raise RolloutError("DistributedWeightSender is closed")
        works = [
            dist.broadcast(t.contiguous(), group=self._group, group_src=0, async_op=True)
            for t in tensors
        ]
        deadline = time.monotonic() + timeout_s
        for work in works:
            assert work is not None
            while not work.is_completed():
                failure = first_error(watch)
                if failure is not None:
                    raise RolloutError(f"weight broadcast abandoned: {failure}") from failure
                if time.monotonic() > deadline:
                    raise RolloutError(
                        f"weight broadcast did not finish within {timeout_s:.0f} s; are the "
                        "servers still receiving?"
                    )
                time.sleep(0.001)
            work.wait()

    def close(self) -> None:
        """Leave the group. Safe to call twice."""
        if self._group is not None:
            group, self._group = self._group, None
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass


# -- helpers ---------------------------------------------------------------------------------


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
    payload.update(extra)
    return payload


def _server_tp_size(server: SGLangServer, timeout_s: float) -> int:
    try:
        info = json.loads(server.get("/server_info", timeout_s=timeout_s))
    except (RolloutError, json.JSONDecodeError):
        return 1
    size = info.get("tp_size", 1) if isinstance(info, dict) else 1
    return size if isinstance(size, int) and size >= 1 else 1


def _message_of(body: str) -> str:
    try:
        decoded = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:2000]
    if isinstance(decoded, dict):
        return str(decoded.get("message") or decoded.get("error") or decoded)
    return str(decoded)


def pickle_b64(obj: object) -> str:
    """Pickle with torch's multiprocessing reductions (tensors as shared-memory handles), base64
    for JSON: SGLang's ``MultiprocessingSerializer`` format."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _layout(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    offsets: list[int] = []
    total = 0
    for _, tensor in bucket:
        offsets.append(total)
        nbytes = tensor.numel() * tensor.element_size()
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def _buckets(
    named: Sequence[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
