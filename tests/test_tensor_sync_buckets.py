"""Tensor-mode weight sync on the sending side, without a server: how weights are cut into buckets,
and which tensors are copied into shared memory before a server on this machine maps them."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing
from hypothesis import given
from hypothesis import strategies as st

from rlcore.weights import release_sender_resources
from rlcore_sglang.weight_sync.base import iter_buckets
from rlcore_sglang.weight_sync.tensor import _held_in_flight, _share, release_shared_buffers


def _own_shared_memory_files() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{os.getpid()}_")]


@given(
    tensors=st.lists(st.tuples(st.integers(1, 40), st.booleans()), max_size=12),
    max_floats=st.integers(min_value=1, max_value=64),
)
def test_buckets_keep_order_stay_under_the_limit_and_mark_only_the_last(
    tensors: list[tuple[int, bool]], max_floats: int
) -> None:
    """Under the limit in the bytes they hold: a tensor that holds none (one already in shared
    memory, for the tensor sink) never starts a bucket of its own."""
    weights = [(f"w{i}", torch.zeros(n)) for i, (n, _) in enumerate(tensors)]
    free = {f"w{i}" for i, (_, is_free) in enumerate(tensors) if is_free}
    sizes = {name: 0 if name in free else t.numel() for name, t in weights}
    by_tensor = {t.data_ptr(): sizes[name] for name, t in weights}

    def held(tensor: torch.Tensor) -> int:
        return 4 * by_tensor[tensor.data_ptr()]

    buckets = list(iter_buckets(iter(weights), max_floats * 4, held))
    assert [name for bucket, _ in buckets for name, _ in bucket] == [n for n, _ in weights]
    assert [last for _, last in buckets] == [i == len(buckets) - 1 for i in range(len(buckets))]
    for index, (bucket, _) in enumerate(buckets):
        assert bucket
        load = sum(sizes[name] for name, _ in bucket)
        # over the limit only as a single holding tensor larger than a bucket
        assert load <= max_floats or sum(sizes[name] > 0 for name, _ in bucket) == 1
        if index > 0:  # a bucket is only cut by a tensor that would not fit
            before = buckets[index - 1][0]
            assert sum(sizes[name] for name, _ in before) + sizes[bucket[0][0]] > max_floats


def test_only_tensors_outside_shared_memory_are_copied() -> None:
    """A rank's parameters (in shared memory) go as themselves; only what the export made (e.g.
    q/k/v split out of a fused QKV) is copied into the shared buffer, not the whole bucket."""
    # torch leaves its sharing-strategy functions and share_memory_ unannotated
    strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    release_shared_buffers()
    try:
        param = torch.arange(2.0**20).share_memory_()  # type: ignore[no-untyped-call]
        fused = torch.arange(24.0).reshape(2, 3, 4).share_memory_()  # type: ignore[no-untyped-call]
        made = fused[:, 1:].reshape(-1, 4)  # a copy: not a view of shared memory
        bucket = [("param", param), ("view", param[2:6]), ("made", made)]
        # what each holds in a tensor-mode bucket: only the copy takes memory
        assert [_held_in_flight(t) for _, t in bucket] == [0, 0, made.numel() * 4]
        shared = dict(_share(bucket, 0))
        assert shared["param"].data_ptr() == param.data_ptr()
        assert shared["view"].data_ptr() == param[2:6].data_ptr()
        assert shared["made"].data_ptr() != made.data_ptr()
        assert shared["made"].is_shared()  # type: ignore[no-untyped-call]  # unannotated
        assert torch.equal(shared["made"], made)
        # the buffer holds the one copied tensor, not the 4 MiB parameter
        buffer = shared["made"].untyped_storage()
        assert buffer.nbytes() < 2**20
        files = _own_shared_memory_files()
        del shared, buffer
        # What a rank does before it is killed: the buffer's file goes, the parameters' stay.
        release_sender_resources()
        assert len(_own_shared_memory_files()) == len(files) - 1
    finally:
        release_shared_buffers()
        torch.multiprocessing.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
