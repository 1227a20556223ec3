"""LoRA on the FSDP backend's actor and critic (``--lora-rank N``, with ``peft``).

:func:`add_adapters` wraps the Hugging Face model in a ``peft`` model before it is sharded: the
base weights are frozen (``requires_grad=False``) and only the adapters (and a critic's value
head, which is new) train and sit in the optimizer. ``lora_B`` starts at zero, so the model
starts as the base exactly.

Out of the stack the adapters are merged: :func:`merged` turns the peft model's full tensors
(``base_model.model.<name>.base_layer.weight``, ``...lora_A.default.weight``,
``...lora_B.default.weight``) into the base model's own Hugging Face names, each adapted weight
``W + (B @ A) * alpha / rank`` as peft's ``merge_and_unload`` computes it, and no ``lora_`` tensor;
:func:`unadapted` gives the base model's weights alone (what the model computes with its adapters
disabled, :func:`adapters_off`: the reference). Checkpoints hold what trains
(:func:`checkpointed`: the adapters, and a critic's value head); :func:`adapter_tensors` and
:func:`write_adapter` write the folder ``peft.PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch

from rlcore_fsdp.options import FSDPOptions

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

__all__ = [
    "ADAPTER",
    "PREFIX",
    "adapter_tensors",
    "adapters_off",
    "add_adapters",
    "checkpointed",
    "is_adapter",
    "is_lora",
    "lora_config",
    "lora_record",
    "merged",
    "unadapted",
    "value_head",
    "write_adapter",
]

ADAPTER: Final = "default"
"""peft's name for the one adapter."""
PREFIX: Final = "base_model.model."
"""What peft puts before the base model's parameter names."""
_CHECKPOINT_WRAPPED: Final = "_checkpoint_wrapped_module"


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (it carries LoRA adapters)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def is_adapter(name: str) -> bool:
    """Whether the state-dict entry ``name`` is an adapter's (``lora_A``/``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def lora_config(model: torch.nn.Module) -> LoraConfig:
    """The LoRA settings of a peft ``model``."""
    from peft import LoraConfig, PeftModel

    assert isinstance(model, PeftModel)
    config = model.peft_config[ADAPTER]
    assert isinstance(config, LoraConfig)
    return config


def lora_record(model: torch.nn.Module) -> dict[str, object]:
    """What a checkpoint records of the adapters of a peft ``model``, compared when loaded."""
    config = lora_config(model)
    targets = config.target_modules
    return {
        "rank": config.r,
        "alpha": config.lora_alpha,
        "target_modules": sorted(targets) if isinstance(targets, (list, set)) else targets,
    }


def value_head(model: torch.nn.Module) -> list[str]:
    """The modules of a transformers critic (a token classifier) beside its backbone that hold
    parameters: its value head (``score``; GPT-2's ``classifier``)."""
    backbone = getattr(model, "base_model_prefix", "")
    return [
        name
        for name, child in model.named_children()
        if name != backbone and any(True for _ in child.parameters())
    ]


def add_adapters(model: torch.nn.Module, options: FSDPOptions, critic: bool = False) -> PeftModel:
    """``model`` wrapped with LoRA adapters of ``options`` (peft), its base weights frozen. A
    ``critic``'s value head (:func:`value_head`) gets no adapter and trains in full: it is new,
    drawn at random, and a frozen one would leave the values a fixed random projection."""
    from peft import LoraConfig, get_peft_model

    targets = options.target_modules
    head = value_head(model) if critic else []
    config = LoraConfig(
        r=options.lora_rank,
        lora_alpha=options.lora_alpha,
        lora_dropout=options.lora_dropout,
        target_modules="all-linear" if targets == ("all-linear",) else list(targets),
        exclude_modules=head or None,
        bias="none",
    )
    with warnings.catch_warnings():
        # peft asks transformers for a property that this transformers version deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        # GPT-2's Conv1D holds its weight transposed: peft notices and merges accordingly
        warnings.filterwarnings("ignore", "fan_in_fan_out is set to False")
        adapted = get_peft_model(model, config)
    for name in head:
        model.get_submodule(name).requires_grad_(True)
    return adapted


def checkpointed(model: torch.nn.Module) -> Callable[[str], bool]:
    """Whether a state-dict entry of the peft ``model`` is in its checkpoint: the adapters and
    whatever else trains (a critic's value head); the base weights never train, so they stay the
    model folder's."""
    trains = {_state_dict_name(name) for name, p in model.named_parameters() if p.requires_grad}
    return lambda name: is_adapter(name) or name in trains


def _state_dict_name(name: str) -> str:
    """A parameter's or module's name as the state dict gives it: without activation
    checkpointing's wrapper (peft's ``base_layer`` stays: not :func:`rlcore_fsdp.loading.plain`)."""
    return name.replace(f".{_CHECKPOINT_WRAPPED}", "")


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {
        _state_dict_name(name): m for name, m in model.named_modules() if isinstance(m, LoraLayer)
    }


def merged(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The peft model's full ``tensors`` (in state-dict order) as the base model's weights under
    its own names, each adapted weight merged with its adapter (peft's ``merge_and_unload``)."""
    layers = _lora_layers(model)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        owner = prefix
        for marker in (".base_layer", f".lora_A.{ADAPTER}", f".lora_B.{ADAPTER}"):
            if prefix.endswith(marker):
                owner = prefix[: -len(marker)]
        if owner not in layers or prefix.endswith(".base_layer") and leaf != "weight":
            yield name.removeprefix(PREFIX).replace(".base_layer.", "."), tensor
            continue
        got = parts.setdefault(owner, {})
        got["W" if prefix.endswith(".base_layer") else prefix[-len(ADAPTER) - 2]] = tensor
        if len(got) == 3:
            layer = layers[owner]
            delta = got["B"] @ got["A"]
            if layer.fan_in_fan_out:
                delta = delta.T
            yield owner.removeprefix(PREFIX) + ".weight", got["W"] + delta * layer.scaling[ADAPTER]
            del parts[owner]
    if parts:
        raise RuntimeError(f"LoRA layers with missing tensors in the export: {sorted(parts)}")


def unadapted(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The peft model's full ``tensors`` as the base model's weights under its own names, the
    adapters left out."""
    for name, tensor in tensors:
        if not is_adapter(name):
            yield name.removeprefix(PREFIX).replace(".base_layer.", "."), tensor


def adapters_off(model: torch.nn.Module) -> AbstractContextManager[None]:
    """peft's ``disable_adapter``: the peft ``model`` computes as its base model in the block."""
    from peft import PeftModel

    assert isinstance(model, PeftModel)
    return model.disable_adapter()


def adapter_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The adapters among the full ``tensors`` under the names peft saves them
    (``...lora_A.weight``, without the adapter's name)."""
    return {
        name.replace(f".{ADAPTER}.", "."): t.to("cpu").contiguous()
        for name, t in tensors
        if is_adapter(name)
    }


def write_adapter(
    folder: Path, model: torch.nn.Module, tensors: dict[str, torch.Tensor], base: Path | None
) -> None:
    """The adapter folder ``peft.PeftModel.from_pretrained(base_model, folder)`` loads:
    ``adapter_config.json`` and ``adapter_model.safetensors``."""
    import copy

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(lora_config(model))
    config.base_model_name_or_path = None if base is None else str(base)
    config.inference_mode = True
    config.save_pretrained(str(folder))
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
