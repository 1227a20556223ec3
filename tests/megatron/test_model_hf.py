"""The Llama GPTModel against ``transformers.LlamaForCausalLM``, and HF <-> Megatron weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from rlcore.errors import CheckpointError, ConfigError
from rlcore_megatron.model.arch import arch_from_hf_config, read_hf_config
from rlcore_megatron.model.gpt import build_gpt
from rlcore_megatron.model.hf_weights import (
    export_hf_weights,
    load_hf_weights,
    load_named_tensors,
    save_hf,
)
from tests.megatron.helpers import weights

pytestmark = pytest.mark.megatron

CPU = torch.device("cpu")


def _megatron_logits(model: torch.nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` (without the rows Megatron pads the vocabulary with)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        out: torch.Tensor = model(tokens, positions, None)
    return out[..., :vocab]


@pytest.mark.parametrize("fixture", ["tiny_hf", "tiny_hf_tied"])
def test_logits_equal_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(fixture)
    arch = read_hf_config(folder)
    model = build_gpt(arch, "actor", CPU).eval()
    load_hf_weights(model, folder, arch, "actor")
    hf = transformers.LlamaForCausalLM.from_pretrained(folder)  # loads in eval mode
    tokens = torch.randint(0, arch.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(
        _megatron_logits(model, tokens, arch.vocab_size), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("fixture", ["tiny_hf", "tiny_hf_tied"])
def test_import_export_round_trip_is_bit_exact(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    folder: Path = request.getfixturevalue(fixture)
    arch = read_hf_config(folder)
    model = build_gpt(arch, "actor", CPU)
    load_hf_weights(model, folder, arch, "actor")
    hf_state = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    exported = weights(export_hf_weights(model, arch, "actor"))
    if arch.tie_word_embeddings:
        assert "lm_head.weight" not in exported
        hf_state.pop("lm_head.weight")
    assert exported.keys() == hf_state.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, hf_state[name]), name

    # export -> import into a freshly initialised model -> export again: identical
    other = build_gpt(arch, "actor", CPU)
    load_named_tensors(other, exported.items(), arch, "actor")
    again = weights(export_hf_weights(other, arch, "actor"))
    assert again.keys() == exported.keys()
    for name, tensor in again.items():
        assert torch.equal(tensor, exported[name]), name


def test_save_hf_loads_in_transformers(tiny_hf: Path, tmp_path: Path) -> None:
    arch = read_hf_config(tiny_hf)
    model = build_gpt(arch, "actor", CPU).eval()
    load_hf_weights(model, tiny_hf, arch, "actor")
    with torch.no_grad():  # make the weights differ from the source checkpoint
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = save_hf(export_hf_weights(model, arch, "actor"), tmp_path / "hf", arch)
    hf = transformers.LlamaForCausalLM.from_pretrained(out)  # loads in eval mode
    tokens = torch.randint(0, arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(
        _megatron_logits(model, tokens, arch.vocab_size), expected, rtol=1e-5, atol=1e-5
    )

    # and back: import of the saved folder reproduces the weights bit for bit (the rows that
    # pad the vocabulary are not part of the model)
    again = build_gpt(arch, "actor", CPU)
    load_hf_weights(again, out, arch, "actor")
    before = weights(export_hf_weights(model, arch, "actor"))
    after = weights(export_hf_weights(again, arch, "actor"))
    assert before.keys() == after.keys()
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), name


def _config(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {**base, **overrides}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}},
            "rope_parameters.rope_type",
        ),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_unsupported_architecture_names_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        arch_from_hf_config(_config(**overrides))
    assert field in info.value.paths
    assert field in str(info.value)


def test_all_unsupported_fields_are_listed_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        arch_from_hf_config(_config(hidden_act="relu", attention_bias=True))
    assert set(info.value.paths) == {"hidden_act", "attention_bias"}


def test_rope_theta_from_either_config_style() -> None:
    assert arch_from_hf_config(_config(rope_theta=500.0)).rope_theta == 500.0
    new_style = _config(rope_parameters={"rope_type": "default", "rope_theta": 250.0})
    assert arch_from_hf_config(new_style).rope_theta == 250.0


def test_missing_config_and_weights_raise_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path)):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    arch = read_hf_config(tmp_path)
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        load_hf_weights(build_gpt(arch, "actor", CPU), tmp_path, arch, "actor")


def test_weights_that_do_not_match_the_config_are_refused(tiny_hf: Path, tmp_path: Path) -> None:
    cfg = json.loads((tiny_hf / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    (tmp_path / "model.safetensors").symlink_to(tiny_hf / "model.safetensors")
    arch = read_hf_config(tmp_path)
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight"):
        load_hf_weights(build_gpt(arch, "actor", CPU), tmp_path, arch, "actor")


def test_truncated_weights_are_named_incomplete(tiny_hf: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_hf / "config.json").read_text())
    full = (tiny_hf / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(full[: len(full) // 2])  # a copy cut short
    arch = read_hf_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors is incomplete: \d+ bytes of"):
        load_hf_weights(build_gpt(arch, "actor", CPU), tmp_path, arch, "actor")


def test_critic_has_a_value_head_and_takes_the_backbone(tiny_hf: Path) -> None:
    arch = read_hf_config(tiny_hf)
    critic = build_gpt(arch, "critic", CPU).eval()
    load_hf_weights(critic, tiny_hf, arch, "critic")
    head = dict(critic.named_parameters())["output_layer.weight"]
    assert head.shape == (1, arch.hidden_size)
    tokens = torch.randint(0, arch.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    values = _megatron_logits(critic, tokens, 1)
    assert values.shape == (2, 7, 1)
    exported = weights(export_hf_weights(critic, arch, "critic"))
    assert "score.weight" in exported and "lm_head.weight" not in exported
    hf_state = transformers.LlamaForCausalLM.from_pretrained(tiny_hf).state_dict()
    assert torch.equal(
        exported["model.layers.1.mlp.up_proj.weight"], hf_state["model.layers.1.mlp.up_proj.weight"]
    )


def test_tensor_parallel_sizes_that_do_not_divide_the_heads_are_refused() -> None:
    from rlcore_megatron.model.gpt import check_parallel

    arch = arch_from_hf_config(_config())
    check_parallel(arch, 2)
    with pytest.raises(ConfigError) as info:
        check_parallel(arch, 4)
    assert "num_key_value_heads" in info.value.paths
