"""Ray rank groups on the CPU: real Ray, real Megatron over gloo, one actor per rank.

The group mechanics (data-parallel split of ``forward``, rollout-id agreement on ``load``, failing
and dead ranks, closing) run against a light stand-in runtime; data and tensor parallelism run the
real :class:`~rlcore_megatron.backend.MegatronBackend` on a tiny Llama. Groups that have more
ranks than this machine has CPUs are started in explicit slots that split a CPU between ranks.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, final

import attrs
import pytest
import ray
from ray.exceptions import OutOfMemoryError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from rlcore.errors import CheckpointError
from rlcore.launch.placement import PlacementRequest
from rlcore.launch.ray.cluster import ClusterPlacement, RankSlot, cuda_ordinal
from rlcore.launch.ray.failures import death
from rlcore.launch.ray.ranks import (
    GroupOptions,
    RankGroup,
    RankLostError,
    RankNode,
    RayGroupError,
    _local_ranks,
)
from rlcore.launch.ray.stacks import (
    RayBackend,
    RayEvalStack,
    RayTrainingStack,
    forward,
    load,
)
from rlcore.launch.ray.worker import RankContext
from rlcore.protocols.stacks import Backend, EvalStack, ModelStack, TrainingStack
from rlcore.samples import Generation, Prompt, Sample, TrainBatch
from rlcore.specs import (
    EvalSpec,
    LossSpec,
    LRSchedule,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    TrainSpec,
)
from rlcore.testing import RecordingWeightSink
from rlcore.weights import (
    AnyProcess,
    InProcess,
    NamedTensors,
    OnHost,
    Takes,
    WeightSink,
    deliver,
)
from rlcore_megatron.kind import MegatronRuntime

if TYPE_CHECKING:
    import torch

pytest_plugins = ["tests.conftest_ray"]

pytestmark = pytest.mark.ray

VOCAB = 32


# -- a stand-in runtime: no torch.distributed, no Megatron --------------------------------------


@final
@attrs.frozen
class _EchoStack:
    """``forward`` gives each response token its prompt's index; ``load`` a fixed rollout id."""

    kind: ClassVar[Literal["eval"]] = "eval"  # ClassVar: not an attrs field
    model_spec: ModelSpec
    rollout_id: int
    fail_forward: bool
    seen: list[int] = attrs.field(factory=list)

    @property
    def spec(self) -> ModelSpec:
        return self.model_spec

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        if self.fail_forward:
            raise ValueError("boom")
        self.seen.extend(s.prompt.index for s in samples)
        return [tuple(float(s.prompt.index) for _ in s.response.token_ids) for s in samples]

    def load(self, path: Path) -> int:
        return self.rollout_id

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        deliver([], sinks)


@final
@attrs.frozen
class _EchoBackend:
    rollout_id: int
    fail_forward: bool

    def build_eval_stack(self, spec: EvalSpec) -> EvalStack:
        return _EchoStack(spec.model, self.rollout_id, self.fail_forward)

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        raise NotImplementedError("the stand-in only builds eval stacks")


@final
@attrs.frozen
class EchoRuntime:
    """Rank ``r``'s ``load`` gives ``rollout_ids[r]``; ranks in ``failing`` raise in ``forward``."""

    rollout_ids: tuple[int, ...]
    failing: frozenset[int] = frozenset()

    def init(self, parallel: ParallelSpec, seed: int) -> None:
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            assert name in os.environ, name

    def backend(self) -> Backend:
        rank = int(os.environ["RANK"])
        return _EchoBackend(self.rollout_ids[rank], rank in self.failing)


def _echo_group(
    rollout_ids: tuple[int, ...],
    tp: int = 1,
    failing: frozenset[int] = frozenset(),
    call_timeout_s: float | None = None,
    slots: Sequence[RankSlot] | None = None,
) -> RankGroup[EvalStack]:
    spec = EvalSpec(ModelSpec("actor", None, parallel=ParallelSpec(tp, len(rollout_ids))))
    runtime = EchoRuntime(rollout_ids, failing)
    options = GroupOptions(setup_timeout_s=120, call_timeout_s=call_timeout_s)
    return RankGroup.start_eval(spec, runtime, options, slots)


@pytest.fixture
def two_cpus_four_slots(ray_cluster: None) -> Iterator[tuple[RankSlot, ...]]:
    """Four rank slots in two 1-CPU bundles, half a CPU each (what a placement gives two roles
    that share two slots)."""
    pg = placement_group([{"CPU": 1.0}, {"CPU": 1.0}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    table = placement_group_table(pg)["bundles_to_node_id"]
    try:
        yield tuple(
            RankSlot(pg, b, {"CPU": 0.5}, 1, str(table[b]), "127.0.0.1") for b in (0, 0, 1, 1)
        )
    finally:
        remove_placement_group(pg)


def _sample(index: int, prompt: Sequence[int], response: Sequence[int]) -> Sample:
    generation = Generation(tuple(response), tuple(0.0 for _ in response), "")
    return Sample(Prompt(index, "", tuple(prompt)), generation, reward=0.0, group=index)


def _env_of(context: RankContext[EvalStack]) -> tuple[int, int, int, int, str]:
    return (
        context.rank,
        context.data_parallel_rank,
        context.tensor_parallel_rank,
        int(os.environ["WORLD_SIZE"]),
        os.environ["OMP_NUM_THREADS"],
    )


def _seen(context: RankContext[EvalStack]) -> list[int]:
    stack = context.stack
    assert isinstance(stack, _EchoStack)
    return list(stack.seen)


def _rank_of(context: RankContext[EvalStack]) -> int:
    return context.rank


def _crash_on_rank(context: RankContext[EvalStack], rank: int) -> None:
    if context.rank == rank:
        os._exit(1)


def _wait_for_a_peer_that_never_comes(context: RankContext[EvalStack], rank: int) -> None:
    if context.rank == rank:
        time.sleep(600)


def _pid(context: RankContext[ModelStack]) -> int:
    return os.getpid()


def _shared_memory_files(pid: int) -> list[str]:
    """torch's shared-memory files made by process ``pid`` (``file_system`` strategy)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{pid}_")]


def _assert_gone(group: RankGroup[Any]) -> None:
    for handle in group.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            # group.actors are plain objects to mypy; Ray's actor handles are untyped
            ray.get(handle.__ray_ready__.remote(), timeout=30)  # type: ignore[attr-defined]


# -- group mechanics -----------------------------------------------------------------------------


def test_local_ranks_count_per_node_or_follow_the_gpu() -> None:
    a1, a2 = RankNode("a", "10.0.0.1", None, 11), RankNode("a", "10.0.0.1", None, 12)
    assert _local_ranks([a1, a2, RankNode("b", "10.0.0.2", None, 11)], gpu=False) == [0, 1, 0]
    assert _local_ranks([RankNode("a", "ip", 3, 11), RankNode("a", "ip", 1, 12)], gpu=True) == [
        3,
        1,
    ]
    assert cuda_ordinal("6", "4,6") == 1  # Ray's ids name devices of CUDA_VISIBLE_DEVICES
    assert cuda_ordinal("2", None) == 2


def test_forward_splits_over_data_parallel_ranks(two_cpus_four_slots: tuple[RankSlot, ...]) -> None:
    group = _echo_group((3, 3, 3, 3), tp=2, slots=two_cpus_four_slots)
    try:
        # rank r is tensor-parallel rank r % 2 of data-parallel rank r // 2; one thread each
        assert group.run_on_all_ranks(_env_of) == [
            (0, 0, 0, 4, "1"),
            (1, 0, 1, 4, "1"),
            (2, 1, 0, 4, "1"),
            (3, 1, 1, 4, "1"),
        ]
        samples = [_sample(i, (1, 2), (3,) * (1 + i % 3)) for i in range(5)]
        expected = [tuple(float(i) for _ in s.response.token_ids) for i, s in enumerate(samples)]
        assert forward(group, samples) == expected
        # data-parallel rank 0 (ranks 0, 1) scored the first three samples, rank 1 the rest
        assert group.run_on_all_ranks(_seen) == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]
        assert forward(group, samples[:1]) == expected[:1]  # data-parallel rank 1 scores none
        assert load(group, Path("/nowhere")) == 3
        assert group.call_ranks(_rank_of, {2: ()}) == [2]  # one rank alone
    finally:
        group.close()
    _assert_gone(group)
    group.close()  # twice is fine
    with pytest.raises(RayGroupError, match="closed"):
        load(group, Path("/nowhere"))


def _keep_a_shared_tensor(context: RankContext[EvalStack]) -> int:
    """Share a tensor the way a CPU rank's parameters are, and keep it where releasing the stack
    does not reach (as Megatron's globals may)."""
    import torch
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    kept = torch.ones(1024).share_memory_()  # type: ignore[no-untyped-call]  # unannotated
    sys.modules[__name__].__dict__["_KEPT"] = kept
    return os.getpid()


def test_closing_removes_the_shared_memory_a_rank_could_not_free(ray_cluster: None) -> None:
    group = _echo_group((1,))
    (pid,) = group.call_ranks(_keep_a_shared_tensor, {0: ()})
    assert _shared_memory_files(pid)
    group.close()
    assert _shared_memory_files(pid) == []


def test_a_group_on_its_own_reserves_and_gives_back_its_slots(ray_cluster: None) -> None:
    groups = len(placement_group_table())
    group = _echo_group((1, 1))
    assert [slot.resources for slot in group.slots] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert len(placement_group_table()) == groups + 1
    group.close()
    states = [pg["state"] for pg in placement_group_table().values()]
    assert states.count("REMOVED") >= 1 and len(states) == groups + 1


def test_failures_on_a_two_rank_group(ray_cluster: None) -> None:
    samples = [_sample(0, (1,), (2,)), _sample(1, (1,), (2,))]
    with _echo_group((7, 5), failing=frozenset({1})) as group:
        with pytest.raises(
            RayGroupError, match=r"forward failed on rank 1: ValueError\('boom'\)"
        ) as raised:
            forward(group, samples)
        assert not isinstance(raised.value, RankLostError)  # an error in code: not restarted
        # rank 0 had finished: the group still works, and a disagreement names ranks and ids
        match = r"ranks \[1\] read rollout id 5; ranks \[0\] read rollout id 7"
        with pytest.raises(CheckpointError, match=match):
            load(group, Path("/ckpt/iter_7"))
        with pytest.raises(RankLostError, match="rank 1's actor died") as died:  # --max-restarts
            group.run_on_all_ranks(_crash_on_rank, 1)
        # Ray's page-long account in a line; the whole of it stays in the cause.
        assert len(str(died.value).splitlines()) == 1, str(died.value)
        assert "(worker exit type" in str(died.value)
        assert "Some common causes" in str(died.value.__cause__)
        with pytest.raises(RayGroupError, match="broken"):
            group.call_ranks(_rank_of, {0: ()})


def test_a_view_runs_in_its_owner_s_actors_and_shares_their_fate(ray_cluster: None) -> None:
    """An eval stack built as a view (LoRA's reference): its stack lives beside the owner's in
    the same actors, calls reach the stack of their role, closing the view keeps the actors,
    closing the owner kills them, and a rank lost under either breaks both."""
    samples = [_sample(i, (1,), (2,)) for i in range(4)]
    view_spec = EvalSpec(ModelSpec("reference", None, parallel=ParallelSpec(1, 2)))
    with _echo_group((4, 4)) as owner:
        pids = owner.run_on_all_ranks(_pid)
        view = owner.start_view(view_spec)
        assert view.actors == owner.actors and view.slots == owner.slots
        assert view.run_on_all_ranks(_pid) == pids
        assert forward(view, samples) == [(0.0,), (1.0,), (2.0,), (3.0,)]
        assert view.run_on_all_ranks(_seen) == [[0, 1], [2, 3]]
        assert owner.run_on_all_ranks(_seen) == [[], []]  # the owner's stack is another one
        view.close()
        assert owner.run_on_all_ranks(_pid) == pids
        with pytest.raises(RayGroupError, match="closed"):
            forward(view, samples)
        again = owner.start_view(view_spec)  # the ranks dropped the view's stack: built anew
        with pytest.raises(RayGroupError, match="itself a view"):
            again.start_view(view_spec)
    _assert_gone(owner)
    with pytest.raises(RayGroupError, match="closed"):
        forward(again, samples)
    again.close()  # nothing left to release

    with _echo_group((4, 4)) as owner:
        view = owner.start_view(view_spec)
        with pytest.raises(RankLostError, match="rank 1's actor died"):
            view.run_on_all_ranks(_crash_on_rank, 1)
        with pytest.raises(RayGroupError, match="broken"):
            owner.call_ranks(_rank_of, {0: ()})
        view.close()


def test_a_rank_killed_for_memory_says_so_and_what_to_lower() -> None:
    oom = OutOfMemoryError(  # type: ignore[no-untyped-call]  # Ray does not annotate it
        "Task was killed due to the node running low on memory.\nMemory on the node (IP: "
        "10.0.0.1) where the task was running was 23.1GB / 24.0GB (0.96), which exceeds the "
        "memory usage threshold of 0.95.\n" + "Top 10 memory users:\n" * 12
    )
    assert death(oom) == (
        "Ray's memory monitor killed it: the machine ran low on memory. Lower --micro-batch-size "
        "or --rollout-batch-size, run fewer ranks per machine, or give the run more memory"
    )


def test_a_timed_out_call_says_where_the_late_rank_is_stuck(ray_cluster: None) -> None:
    with _echo_group((0, 0), call_timeout_s=5) as group:
        with pytest.raises(RankLostError) as caught:  # a silent rank: --max-restarts restarts
            group.run_on_all_ranks(_wait_for_a_peer_that_never_comes, 1)
        message = str(caught.value)
        assert "ranks [1] did not finish in time" in message
        # rank 1's own stack, read while it sleeps: the function and the line it waits on
        stuck = message.split("--- rank 1 is at ---", 1)[1]
        assert "in _wait_for_a_peer_that_never_comes" in stuck and "time.sleep(600)" in stuck
        with pytest.raises(RayGroupError, match="broken"):
            group.call_ranks(_rank_of, {0: ()})


# -- the real Megatron backend -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlcore.testing.tiny import build_tiny_llama

    folder = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_llama(
        folder,
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
    )
    return folder


@final
@attrs.frozen
class TensorParallelCpuRuntime:
    """:class:`MegatronRuntime` plus the CPU redirection for tensor-parallel gathers.

    Stand-in until ``rlcore_megatron.cpu.CPU_PATCHED_MODULES`` lists
    ``megatron.core.tensor_parallel.mappings`` (its ``_gather_along_last_dim`` allocates on
    ``torch.cuda.current_device()``): hands that module the ``torch`` the shim gave
    ``megatron.core.utils``. A no-op once the shim covers it, and on GPUs.
    """

    def init(self, parallel: ParallelSpec, seed: int) -> None:
        import importlib

        MegatronRuntime().init(parallel, seed)
        utils = importlib.import_module("megatron.core.utils")
        mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
        shimmed = utils.torch
        if mappings.torch is not shimmed:
            setattr(mappings, "torch", shimmed)  # noqa: B010  # a module global the stubs omit

    def backend(self) -> Backend:
        return MegatronRuntime().backend()


def _samples(count: int) -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i in range(count):
        prompt = [rng.randrange(3, VOCAB) for _ in range(3 + i % 2)]
        response = [rng.randrange(3, VOCAB) for _ in range(2 + i % 3)]
        out.append(_sample(i, prompt, response))
    return out


def _train_spec(checkpoint: Path, parallel: ParallelSpec, global_batch_size: int = 4) -> TrainSpec:
    schedule = LRSchedule(lr=1e-2, min_lr=0.0, warmup_steps=0, decay_steps=10)
    return TrainSpec(
        model=ModelSpec("actor", checkpoint, parallel=parallel),
        optimizer=OptimizerSpec(schedule),
        loss=LossSpec(),
        global_batch_size=global_batch_size,
        micro_batch_size=1,
    )


@final
class _Keep:
    """A sink that keeps copies of what it receives, in the rank that runs it."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.Tensor]] = []

    @property
    def placement(self) -> AnyProcess:
        return AnyProcess()

    def receive(self, weights: NamedTensors) -> None:
        self.pairs = [(name, t.detach().cpu().clone()) for name, t in weights]


def _exported(context: RankContext[TrainingStack]) -> list[tuple[str, torch.Tensor]]:
    """This rank's own full copy of the weights (every rank sends to its own sink)."""
    keep = _Keep()
    context.stack.send_weights([keep])
    return keep.pairs


@final
@attrs.frozen
class MegatronStacks:
    """Started once per module, at once: actor start-up (importing Megatron) dominates. Both
    groups share one placement of two CPU slots, as an actor and its reference model do."""

    data_parallel: RayTrainingStack
    """Two tensor-parallel-1 ranks, data parallel 2 (the actor)."""
    tensor_parallel: RayEvalStack
    """Two ranks, tensor parallel 2 (a policy eval stack in the reference model's slots)."""
    samples: tuple[Sample, ...]
    reference: tuple[tuple[float, ...], ...]
    """The untrained data-parallel stack's log-probs of ``samples``: each rank has the whole
    model (tensor parallel 1) and scores half the samples."""


@pytest.fixture(scope="module")
def megatron(tiny_llama: Path, ray_cluster: None) -> Iterator[MegatronStacks]:
    options = GroupOptions(setup_timeout_s=300, call_timeout_s=300)
    request = PlacementRequest(actor_ranks=2, reference=True)
    with ClusterPlacement.reserve(request, timeout_s=120) as placement:
        assert [s.resources for s in placement.slots("reference")] == [{"CPU": 0.5}] * 2
        with RayBackend(TensorParallelCpuRuntime(), placement, options) as backend:
            with ThreadPoolExecutor(2) as pool:
                train_spec = _train_spec(tiny_llama, ParallelSpec(1, 2))
                parallel = ParallelSpec(2, 2)
                eval_spec = EvalSpec(ModelSpec("reference", tiny_llama, parallel=parallel))
                dp = pool.submit(backend.build_training_stack, train_spec)
                tp = pool.submit(backend.build_eval_stack, eval_spec)
                data_parallel, tensor_parallel = dp.result(), tp.result()
            samples = tuple(_samples(5))
            reference = tuple(data_parallel.forward(samples))
            yield MegatronStacks(data_parallel, tensor_parallel, samples, reference)


@pytest.mark.megatron
def test_the_embedded_engines_sync_copies_from_the_ranks_parameters(
    megatron: MegatronStacks, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine in the driver that takes row blocks (the embedded engine's sink) is handed the
    relay rank's parameters themselves, q, k and v as views of the fused QKV: after the first
    sync, a sync that follows training steps calls no rank (the driver copies from the views it
    keeps, which the steps updated in place), and the engine's weights are the ranks' bit for
    bit. A call that may move parameters (a load) makes the next sync describe them again, as
    does a sink that needs the Hugging Face shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    stack = megatron.data_parallel
    engine_model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    sink = _Engine(engine_model.state_dict(keep_vars=True))
    calls: list[str] = []
    call_ranks = stack.group.call_ranks

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2])
        return call_ranks(*args, **kwargs)

    monkeypatch.setattr(stack.group, "call_ranks", counted)
    samples = megatron.samples[:4]
    batch = TrainBatch(samples, tuple((1.0,) * len(s.response.token_ids) for s in samples))

    def engine_matches_ranks() -> None:
        ranks = dict(stack.export_weights())  # a read: it moves nothing
        assert ranks.keys() == sink.names
        for name, tensor in engine_model.state_dict().items():
            assert torch.equal(tensor, ranks[name]), name

    stack.send_weights([sink])
    assert calls == ["send_weights"] and sink.row_blocks > 0
    engine_matches_ranks()
    stack.train_step(batch)  # (a checkpoint with the optimizer's state)
    (tmp_path / "ckpt").mkdir()
    stack.save(tmp_path / "ckpt", 1)  # a call that may move them (not one of the in-place ones)
    calls.clear()
    stack.send_weights([sink])
    assert calls == ["send_weights"]
    saved = {name: t.clone() for name, t in engine_model.state_dict().items()}
    for _ in range(2):
        calls.clear()
        stack.train_step(batch)
        stack.send_weights([sink])
        assert calls == ["train_step"]  # the sync called no rank
        engine_matches_ranks()
    assert any(not torch.equal(t, saved[n]) for n, t in engine_model.state_dict().items())
    calls.clear()
    here = _Mapped()  # Hugging Face shapes only: the ranks lay q, k and v out for it
    stack.send_weights([here])
    assert calls == ["send_weights"]
    assert here.copies.keys() == sink.names
    stack.load(tmp_path / "ckpt")
    calls.clear()
    stack.send_weights([sink])
    assert calls == ["send_weights"]
    for name, tensor in engine_model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.megatron
def test_data_parallel_replicas_stay_identical(megatron: MegatronStacks, tmp_path: Path) -> None:
    import torch

    stack = megatron.data_parallel
    samples = megatron.samples[:4]
    advantages = tuple(
        tuple(1.0 if i % 2 else -1.0 for _ in s.response.token_ids) for i, s in enumerate(samples)
    )
    batch = TrainBatch(samples, advantages)
    before = dict(stack.export_weights())
    for _ in range(3):
        metrics = stack.train_step(batch)
        assert metrics.grad_norm > 0
        assert metrics.tokens == sum(len(a) for a in advantages)  # summed over both replicas
    assert "param_groups" in stack.optimizer.state_dict()
    rank0, rank1 = stack.group.run_on_all_ranks(_exported)
    assert [n for n, _ in rank0] == [n for n, _ in rank1] == list(before)
    for (name, a), (_, b) in zip(rank0, rank1, strict=True):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, before[name]) for name, a in rank0)
    # The driver's in-process sink (the embedded engine's place) maps the trained weights, bit
    # for bit, and keeps them mapped: once the stack closes, it maps none of the ranks' files.
    here = _Mapped()
    stack.send_weights([here])
    assert list(here.copies) == list(before)
    assert all(torch.equal(here.copies[name], a) for name, a in rank0)
    # save and load through the group: both ranks read the same rollout id back
    (tmp_path / "ckpt").mkdir()
    stack.save(tmp_path / "ckpt", 3)
    assert stack.load(tmp_path / "ckpt") == 3
    # The ranks' parameters are in shared memory (for tensor-mode weight sync); closing frees
    # them before the actors are killed, which would leave the files behind.
    pids = stack.group.run_on_all_ranks(_pid)
    assert all(_shared_memory_files(pid) for pid in pids)
    stack.close()
    _assert_gone(stack.group)
    assert [_shared_memory_files(pid) for pid in pids] == [[], []]
    assert not any(f"/torch_{pid}_" in line for pid in pids for line in _own_maps())
    # The driver mapped the ranks' files without joining their shared-memory managers (gone
    # with them): its own shared memory still works.
    import torch.multiprocessing

    strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    try:
        assert torch.zeros(4).share_memory_().is_shared()  # type: ignore[no-untyped-call]
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]


@pytest.mark.megatron
def test_tensor_parallel_2_matches_tensor_parallel_1(
    megatron: MegatronStacks, tiny_llama: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    stack = megatron.tensor_parallel
    scored = stack.forward(megatron.samples)
    lengths = [len(s.response.token_ids) for s in megatron.samples]
    assert [len(r) for r in megatron.reference] == [len(r) for r in scored] == lengths
    flat, expected = torch.tensor(sum(scored, ())), torch.tensor(sum(megatron.reference, ()))
    torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-5)
    # the gather over tensor parallel gives back exactly the checkpoint's weights
    hf = load_file(str(tiny_llama / "model.safetensors"))
    exported = dict(stack.export_weights())
    assert exported.keys() == hf.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, hf[name]), name


@final
@attrs.frozen
class FileSink:
    """A picklable sink that writes, in the process that runs it, which rank it is and what it
    received (names and sums) into ``folder``."""

    folder: Path
    where: AnyProcess | OnHost

    @property
    def placement(self) -> AnyProcess | OnHost:
        return self.where

    def receive(self, weights: NamedTensors) -> None:
        sums = {name: float(t.double().sum()) for name, t in weights}
        record = {"rank": os.environ["RANK"], "pid": os.getpid(), "sums": sums}
        (self.folder / f"{type(self.where).__name__}.json").write_text(json.dumps(record))


@final
class _Engine:
    """An in-process sink that copies into a model's tensors as the embedded engine's does,
    row blocks included, and counts the tensors that came as row blocks."""

    takes: ClassVar[Takes] = Takes(row_blocks=True)

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self._targets = targets
        self.names: set[str] = set()
        self.row_blocks = 0

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, weights: NamedTensors) -> None:
        from rlcore.engines.sampling import copy_weights

        pairs = list(weights)
        self.names = {name for name, _ in pairs}
        self.row_blocks = sum(t.shape != self._targets[n].shape for n, t in pairs)
        copy_weights(self._targets, pairs, what="test engine")


@final
class _Mapped:
    """An in-process sink that keeps copies of what it receives and where those tensors were."""

    def __init__(self) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        self.addresses: dict[str, int] = {}
        self.in_ranks_files: dict[str, bool] = {}

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, weights: NamedTensors) -> None:
        pairs = list(weights)
        self.copies = {name: t.clone() for name, t in pairs}
        self.addresses = {name: t.data_ptr() for name, t in pairs}
        self.in_ranks_files = {name: _in_shared_memory_file(t) for name, t in pairs}


def _own_maps() -> list[str]:
    return Path("/proc/self/maps").read_text().splitlines()


def _in_shared_memory_file(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s data lies in a mapping of torch's shared-memory files (not ours)."""
    address = tensor.data_ptr()
    for line in _own_maps():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/shm/torch_"):
            if f"/torch_{os.getpid()}_" in fields[5]:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.mark.megatron
def test_an_in_process_sink_gets_the_weights_through_shared_memory(
    megatron: MegatronStacks, tiny_llama: Path
) -> None:
    """The ranks hand the driver shared-memory handles (no copy through the object store): the
    sink receives the checkpoint's weights bit for bit, from the tensor-parallel gather, and the
    next sync finds them where the first left them (the driver keeps its mappings)."""
    import torch
    from safetensors.torch import load_file

    stack = megatron.tensor_parallel
    first, second = _Mapped(), _Mapped()
    stack.send_weights([first])
    stack.send_weights([second])
    hf = load_file(str(tiny_llama / "model.safetensors"))
    assert first.copies.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(first.copies[name], tensor), name
    assert all(first.in_ranks_files.values())
    assert second.addresses == first.addresses


@pytest.mark.megatron
def test_weights_go_from_the_ranks_to_the_sinks(
    megatron: MegatronStacks, tiny_llama: Path, tmp_path: Path
) -> None:
    """Each sink runs on the rank its placement allows; only an in-process sink brings the
    weights to the driver. The tensor-parallel gather gives every sink the checkpoint's
    weights."""
    from safetensors.torch import load_file

    stack = megatron.tensor_parallel
    here = RecordingWeightSink()
    anywhere = FileSink(tmp_path, AnyProcess())
    on_this_machine = FileSink(tmp_path, OnHost("127.0.0.1"))
    stack.send_weights([anywhere, on_this_machine, here])
    hf = load_file(str(tiny_llama / "model.safetensors"))
    assert set(here.names) == set(hf)
    for name in ("AnyProcess", "OnHost"):
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["rank"] == "0" and record["pid"] != os.getpid()
        assert record["sums"] == pytest.approx({k: float(t.double().sum()) for k, t in hf.items()})
    with pytest.raises(RayGroupError, match=r"must run on 10\.9\.9\.9, where no rank"):
        stack.send_weights([FileSink(tmp_path, OnHost("10.9.9.9"))])
    # The group survived the refusal (it was made before any rank was called).
    assert len(stack.forward(megatron.samples[:1])) == 1
