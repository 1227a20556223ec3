"""``--fsdp-cpu-offload`` (FSDP2's ``CPUOffloadPolicy``): every unit is sharded with the policy,
and nothing else changes: the same two steps to the bit (so AdamW's state too), with LoRA and
gradient checkpointing as without, and checkpoints that load into a stack without offload. On the
CPU the tensors already live on the CPU, so these tests show that the policy is applied and
changes no number, not that it saves GPU memory. The flag reaches the options from the command
line and from the ``[fsdp]`` section, and is refused with the Megatron backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from rlcore.config.flags import load_config
from rlcore.errors import ConfigError
from rlcore.specs import EvalSpec
from rlcore.testing.tiny import build_tiny_llama
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.options import FSDPOptions
from tests.megatron.helpers import TINY, make_batch, make_samples, train_spec, weights

# peft asks transformers for a property this transformers version deprecates (loading the folder)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--num-rollout", "1"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_llama(folder, **{**TINY, "tie_word_embeddings": True})
    return folder


def _offloaded_units(model: torch.nn.Module) -> list[bool]:
    """Whether each FSDP unit of ``model`` was sharded with the CPU offload policy (read from
    FSDP2's state: on the CPU no tensor placement tells)."""
    return [
        isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)  # type: ignore[union-attr]  # None only for a unit without parameters, excluded below
        for m in model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
    ]


@pytest.mark.parametrize(
    "options",
    [FSDPOptions(), FSDPOptions(lora_rank=4, lora_alpha=8, gradient_checkpointing=True)],
    ids=["full", "lora-checkpointing"],
)
def test_offloaded_stacks_take_the_same_steps(
    options: FSDPOptions, llama: Path, tmp_path: Path
) -> None:
    import attrs

    samples = make_samples(4, seed=7)
    batch = make_batch(samples, seed=8, rollout=True)
    spec = train_spec(llama, global_batch_size=4, micro_batch_size=2)
    plain = FSDPBackend(options).build_training_stack(spec)
    offloaded = FSDPBackend(attrs.evolve(options, fsdp_cpu_offload=True)).build_training_stack(spec)
    assert not any(_offloaded_units(plain.model))
    units = _offloaded_units(offloaded.model)
    assert len(units) == TINY["num_layers"] + 1 and all(units)
    for _ in range(2):  # the second step reads AdamW's state of the first
        expected, got = plain.train_step(batch), offloaded.train_step(batch)
        assert (got.loss, got.grad_norm) == (expected.loss, expected.grad_norm)
    a, b = weights(plain.export_weights()), weights(offloaded.export_weights())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)

    offloaded.save(tmp_path, rollout_id=2)
    loaded = FSDPBackend(options).build_eval_stack(EvalSpec(spec.model))
    assert loaded.load(tmp_path) == 2
    assert loaded.forward(samples) == offloaded.forward(samples) == plain.forward(samples)


def test_the_flag_reaches_the_options_from_flags_and_config(tmp_path: Path) -> None:
    config = load_config([*BASE, "--fsdp-cpu-offload"])
    assert config.model.backend_options == FSDPOptions(fsdp_cpu_offload=True)
    toml = tmp_path / "run.toml"
    toml.write_text("[fsdp]\nfsdp_cpu_offload = true\n")
    config = load_config([*BASE, "--config", str(toml)])
    assert config.model.backend_options == FSDPOptions(fsdp_cpu_offload=True)


def test_the_megatron_backend_refuses_the_flag() -> None:
    flags = ["--train-backend", "megatron", "--hf-checkpoint", "m", "--num-rollout", "1"]
    with pytest.raises(ConfigError, match=re.escape("add --train-backend fsdp")):
        load_config([*flags, "--fsdp-cpu-offload"])
