"""The CPU shim and the package surface."""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import subprocess
import sys

import pytest
import torch

import rlcore_megatron
from rlcore_megatron import cpu

pytestmark = pytest.mark.megatron


def test_shim_is_applied_on_a_cpu_only_machine(megatron_rank: None) -> None:
    assert cpu.needed() and cpu.is_applied()
    for name in cpu.CPU_PATCHED_MODULES:
        patched = importlib.import_module(name).torch
        assert patched is not torch
        assert patched.cuda.current_device() == torch.device("cpu")
        assert patched.zeros(1, device="cuda").device.type == "cpu"
        assert patched.Tensor is torch.Tensor  # everything else is the real torch
    with pytest.raises((AssertionError, RuntimeError)):  # torch itself is untouched
        torch.cuda.current_device()


def test_shim_is_not_applied_when_cuda_is_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_applied", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def refuse(name: str) -> None:
        raise AssertionError(f"apply() touched {name} although CUDA is present")

    monkeypatch.setattr(importlib, "import_module", refuse)
    cpu.apply()
    assert not cpu.is_applied()


def test_grad_clip_without_the_cuda_type_assert() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    cpu._clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    torch.testing.assert_close(p.grad, torch.full((4,), 0.5), rtol=1e-5, atol=1e-6)


def test_package_surface_is_pinned_and_classes_are_final() -> None:
    assert sorted(rlcore_megatron.__all__) == rlcore_megatron.__all__
    for name in rlcore_megatron.__all__:
        obj = getattr(rlcore_megatron, name)
        if inspect.isclass(obj):
            assert getattr(obj, "__final__", False), f"{name} should be @final"


def test_import_rlcore_megatron_is_light() -> None:
    code = (
        "import sys, json, rlcore_megatron; print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'megatron'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_backend_is_found_by_name() -> None:
    from rlcore.backends import load_backend, load_backend_kind
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.kind import MEGATRON

    assert load_backend_kind("megatron") is MEGATRON
    assert isinstance(load_backend("megatron"), MegatronBackend)


def test_sharing_parameters_hands_their_freed_heap_back_as_it_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Moving the parameters into shared memory frees their heap memory, at most
    ``TRIM_EVERY_BYTES`` of it before it is handed back, and all of it by the end (#23: glibc kept
    it resident, a second copy of the weights in every CPU rank's RSS)."""
    from rlcore.engines import shared_tensors as backend

    monkeypatch.setattr(torch.multiprocessing, "set_sharing_strategy", lambda _: None)
    monkeypatch.setattr(backend, "TRIM_EVERY_BYTES", 3 * 4096)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32, bias=False) for _ in range(8)))
    params = list(model.parameters())  # 4 KiB each
    pending: list[int] = []  # parameters moved but not yet handed back, at each release

    def release() -> None:
        moved = sum(p.is_shared() for p in params)  # type: ignore[no-untyped-call]
        pending.append(moved - sum(pending))

    monkeypatch.setattr(backend, "release_freed_heap", release)
    backend.share_cpu_tensors(model.parameters())
    assert all(p.is_shared() for p in params)  # type: ignore[no-untyped-call]
    assert pending == [0, 3, 3, 2]  # what building freed first; none left over at the end


RETAINED_HEAP_SCRIPT = """
import ctypes, json, torch
from rlcore.engines import shared_tensors as backend

libc = ctypes.CDLL(None)
libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 4 MiB tensors come from the heap, as after
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD  glibc's threshold rose; freed, they stay there

def mib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) >> 10

def anon():
    return mib("RssAnon")

def model():  # 128 MiB of fp32 parameters, 4 MiB each
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(32)))

kept = backend.release_freed_heap
backend.release_freed_heap = lambda: None
first = model()
before = anon()
backend.share_cpu_tensors(first.parameters())
retained = anon()
kept()
released = anon()
backend.release_freed_heap = kept
second = model()
built, rss = anon(), mib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
backend.share_cpu_tensors(second.parameters())
print(json.dumps({"kept": before - retained, "trimmed": retained - released,
                  "shared": built - anon(), "peak_above_built": mib("VmHWM") - rss}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's heap and /proc",
)
def test_sharing_parameters_leaves_no_second_copy_in_the_heap() -> None:
    """glibc's real behaviour, in a fresh process with its heap made to hold 4 MiB tensors (as it
    does once its mmap threshold has risen): 128 MiB of parameters moved into shared memory stay
    resident in the heap without :func:`~rlcore.engines.shared_tensors.release_freed_heap`, and
    ``share_cpu_tensors`` hands them back, holding at most ``TRIM_EVERY_BYTES`` (64 MiB) more
    than the weights on the way."""
    out = subprocess.run(
        [sys.executable, "-c", RETAINED_HEAP_SCRIPT], capture_output=True, text=True, check=True
    )
    mib = json.loads(out.stdout.strip().splitlines()[-1])
    assert mib["kept"] < 32, mib  # the setup retains, as the bring-up benchmark's build did
    assert mib["trimmed"] > 96, mib
    assert mib["shared"] > 96, mib
    assert mib["peak_above_built"] < 96, mib  # 64 MiB pending + one 4 MiB tensor, not 128
