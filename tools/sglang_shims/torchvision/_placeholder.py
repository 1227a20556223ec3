"""Placeholders for the import-only torchvision shim: names resolve, calls raise."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn


class Placeholder:
    """Any torchvision name: usable in annotations and attribute chains, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"{self._name} is not available: torchvision here is rlcore's import-only test shim "
            "(tools/sglang_shims/torchvision); install a torchvision build that matches your torch"
        )

    def __repr__(self) -> str:
        return f"<torchvision shim placeholder {self._name}>"


def placeholder_getattr(module: str) -> Callable[[str], Placeholder]:
    def getattr_(name: str) -> Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module}.{name}")

    return getattr_
