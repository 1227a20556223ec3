"""The FSDP backend's allocator policy on the CPU (issue #36): a rank fixes glibc's mmap threshold
and hands the C heap's free pages back after each FSDP unit's forward and backward, which changes
where a CPU step's memory lives and no number it computes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlcore import heap
from rlcore.testing.tiny import build_tiny_llama
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.options import FSDPOptions
from tests.megatron.helpers import TINY, make_batch, make_samples, train_spec

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_llama(folder, **{**TINY, "tie_word_embeddings": True})
    return folder


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_cpu_step_hands_the_freed_heap_back_after_each_unit(
    llama: Path, monkeypatch: pytest.MonkeyPatch, checkpointing: bool, lora_rank: int
) -> None:
    options = FSDPOptions(lora_rank=lora_rank, gradient_checkpointing=checkpointing)
    stack = FSDPBackend(options).build_training_stack(train_spec(llama, micro_batch_size=2))
    release = heap.release_freed_heap
    calls: list[bool] = []  # whether each came from the backward pass

    def counted() -> None:
        import torch

        calls.append(torch._C._current_graph_task_id() != -1)
        release()  # the real one: malloc_trim(0)

    monkeypatch.setattr(heap, "release_freed_heap", counted)
    stack.train_step(make_batch(make_samples(4, seed=3), seed=4, rollout=True))
    layers = TINY["num_layers"]
    micro_batches = 2
    # per micro-batch: each decoder layer's forward and the root's, each layer's backward
    assert calls.count(False) == micro_batches * (layers + 1)
    assert calls.count(True) == micro_batches * layers


MMAP_SCRIPT = """
import ctypes, json
from rlcore import heap

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    )]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.malloc_trim.argtypes = [ctypes.c_size_t]
libc.free(libc.malloc(16 << 20))  # a mapped block freed: glibc's threshold rises to 16 MiB
mapped = []
for fix in (False, True):
    if fix:
        assert heap.fix_mmap_threshold()
    libc.malloc_trim(0)  # no free top of the heap to serve it from
    before = libc.mallinfo2().hblks
    block = libc.malloc(6 << 20)
    mapped.append(libc.mallinfo2().hblks - before)
    libc.free(block)
print(json.dumps(mapped))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_fixed_mmap_threshold_maps_what_the_risen_one_would_keep_in_the_heap() -> None:
    # in a process of its own: it sets this process's allocator policy
    out = subprocess.run(
        [sys.executable, "-c", MMAP_SCRIPT], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[0, 1]"  # 6 MiB: in the heap after the rise, then mapped
