"""The CPU shim and the package surface."""

from __future__ import annotations

import importlib
import inspect
import json
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
    from rlcore.loop.backends import load_backend
    from rlcore_megatron.backend import MegatronBackend

    assert load_backend("megatron") is MegatronBackend
