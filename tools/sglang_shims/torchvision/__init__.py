"""Test-only, import-only stand-in for ``torchvision`` beside CPU torch.

Not part of rlcore: ``nox -s sglang`` puts this folder on ``sys.path`` of its own virtualenv with a
``.pth`` file. PyPI's torchvision wheels are CUDA builds that fail to load beside the CPU torch
wheel, yet SGLang (and timm/transformers image processors) import it at module level for vision
models. Text-only generation never calls it: any attribute is a placeholder that raises
:class:`NotImplementedError` when called.
"""

from __future__ import annotations

from torchvision._placeholder import placeholder_getattr

__version__ = "0.0.0+rlcore.import.shim"

__getattr__ = placeholder_getattr(__name__)
