"""Import-only shim (see torchvision/__init__.py). As in torchvision, v2 shares
``InterpolationMode``."""

from __future__ import annotations

from torchvision._placeholder import placeholder_getattr
from torchvision.transforms import InterpolationMode

__all__ = ["InterpolationMode"]

__getattr__ = placeholder_getattr(__name__)
