"""Import-only shim (see torchvision/__init__.py)."""

from __future__ import annotations

import enum

from torchvision._placeholder import placeholder_getattr


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = placeholder_getattr(__name__)
