"""The Megatron backend's settings (:class:`MegatronOptions`): the flags below, or the
``[megatron]`` section of ``--config``. attrs only: ``--help`` lists the flags without torch.
"""

from __future__ import annotations

from typing import Literal, final

import attrs

from rlcore.config import option
from rlcore.errors import ConfigError, ConfigProblem

__all__ = ["MegatronOptions", "RecomputeGranularity", "RecomputeMethod"]

RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]


@final
@attrs.frozen
class MegatronOptions:
    """``--train-backend megatron``: activation recompute (slime's flags, passed to Megatron's
    ``TransformerConfig``), checked here so that a bad combination is refused before start."""

    recompute_granularity: RecomputeGranularity | None = option(
        None,
        "--recompute-granularity",
        "recompute activations in the backward pass instead of keeping them: full (whole "
        "decoder layers, with --recompute-method and --recompute-num-layers) or selective (the "
        "core attention of every layer); unset: keep every activation",
    )
    recompute_method: RecomputeMethod | None = option(
        None,
        "--recompute-method",
        "with --recompute-granularity full: uniform (every layer, in chunks of "
        "--recompute-num-layers, keeping only each chunk's input) or block (the first "
        "--recompute-num-layers layers, the others keep their activations)",
    )
    recompute_num_layers: int | None = option(
        None,
        "--recompute-num-layers",
        "with --recompute-granularity full: layers per recomputed chunk (uniform) or layers "
        "recomputed (block); at most the model's layers",
    )

    def __attrs_post_init__(self) -> None:
        problems = []

        def add(name: str, message: str, hint: str = "") -> None:
            flag = attrs.fields_dict(MegatronOptions)[name].metadata["flag"]
            problems.append(ConfigProblem(f"megatron.{name} ({flag})", message, hint))

        layers, method = self.recompute_num_layers, self.recompute_method
        if self.recompute_granularity is None:
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    add(
                        name,
                        f"is set ({getattr(self, name)!r}) but --recompute-granularity is not",
                        "add --recompute-granularity full, or leave it out",
                    )
        elif self.recompute_granularity == "full":
            if method is None:
                add(
                    "recompute_method",
                    "--recompute-granularity full needs a method",
                    "add --recompute-method uniform (or block)",
                )
            if layers is None:
                add(
                    "recompute_num_layers",
                    "--recompute-granularity full needs a number of layers",
                    "add --recompute-num-layers N: 1 recomputes each layer from its input",
                )
        else:
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    add(
                        name,
                        f"is for --recompute-granularity full, not selective (got "
                        f"{getattr(self, name)!r})",
                        "leave it out with selective, which recomputes the core attention of "
                        "every layer",
                    )
        if layers is not None and layers < 1:
            add("recompute_num_layers", f"must be >= 1, got {layers}")
        if problems:
            raise ConfigError(problems)

    def num_layers_problem(self, num_layers: int) -> ConfigProblem | None:
        """Why ``--recompute-num-layers`` does not fit a model of ``num_layers`` layers (uniform
        chunks must divide them, Megatron's uniform method indexes past the last layer
        otherwise; block recomputes at most every layer), or ``None``."""
        n = self.recompute_num_layers
        if n is None:
            return None
        where = "megatron.recompute_num_layers (--recompute-num-layers)"
        if n > num_layers:
            return ConfigProblem(
                where,
                f"the model has {num_layers} layers, fewer than {n}",
                f"set it to at most {num_layers}",
            )
        if self.recompute_method == "uniform" and num_layers % n:
            return ConfigProblem(
                where,
                f"uniform chunks of {n} layers do not divide the model's {num_layers} layers",
                "use a divisor of the number of layers, or --recompute-method block",
            )
        return None
