"""Each supported model family (Llama 3.2, Qwen2.5, Qwen3, Qwen3-MoE; ``tests/families.py``)
against transformers: the config is read as published, the Megatron model's logits equal
transformers', and a trained model's export loads in transformers and round-trips bit for bit.
Unsupported config fields are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import transformers
from megatron.core.models.gpt import GPTModel

from rlcore import new_model
from rlcore.engines.shared_tensors import ExportBuffers
from rlcore.errors import ConfigError
from rlcore.samples import Sample
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.model.arch import ModelArch, RopeScaling, arch_from_hf_config, read_hf_config
from rlcore_megatron.model.gpt import build_gpt, check_parallel
from rlcore_megatron.model.hf_weights import HFReader, export_hf_weights, load_hf_weights
from tests.families import FAMILIES, PUBLISHED, Family, FamilyModels, tiny_config
from tests.megatron.helpers import make_batch, make_samples, train_spec, weights

pytestmark = pytest.mark.megatron

CPU = torch.device("cpu")


def megatron_logits(model: torch.nn.Module, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` (without the rows that pad the vocabulary)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        out: torch.Tensor = model(tokens, positions, None)
    return out[..., :vocab]


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits: torch.Tensor = hf(tokens).logits
    return logits


def random_tokens(vocab: int, seed: int = 0, shape: tuple[int, int] = (3, 11)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def loaded_model(folder: Path) -> tuple[GPTModel, ModelArch]:
    arch = read_hf_config(folder)
    model = build_gpt(arch, "actor", CPU).eval()
    load_hf_weights(model, folder, arch, "actor")
    return model, arch


def test_published_configs_are_read_with_each_familys_structure() -> None:
    llama, qwen2, qwen3, moe = (arch_from_hf_config(PUBLISHED[f]) for f in FAMILIES)
    assert llama.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert llama.tie_word_embeddings and not llama.qkv_bias and not llama.qk_norm
    assert llama.architecture == "LlamaForCausalLM"
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.head_dim == 896 // 14
    assert qwen3.qk_norm and qwen3.head_dim == 128 != qwen3.hidden_size // qwen3.num_heads
    assert moe.moe is not None and moe.qk_norm and not moe.tie_word_embeddings
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.ffn_hidden_size) == (128, 8, 768)
    assert moe.moe.norm_topk_prob and moe.moe.moe_layers == (True,) * 48
    assert moe.architecture == "Qwen3MoeForCausalLM"
    # Megatron pads the vocabulary to a multiple of 128 x TP: Qwen's pads at TP 2.
    assert (qwen2.padded_vocab_size(1), qwen2.padded_vocab_size(2)) == (151936, 152064)
    assert llama.padded_vocab_size(2) == 128256


def assert_logits_equal_transformers(folder: Path) -> None:
    """The Megatron model of ``folder`` gives transformers' logits (to 1e-5, fp32)."""
    model, arch = loaded_model(folder)
    tokens = random_tokens(arch.vocab_size)
    torch.testing.assert_close(
        megatron_logits(model, tokens, arch.vocab_size),
        hf_logits(folder, tokens),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family: Family, family_models: FamilyModels) -> None:
    assert_logits_equal_transformers(family_models.folder(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_new_model_folders_build_with_transformers_logits(
    family: Family, tmp_path: Path, megatron_rank: None
) -> None:
    """A folder from ``python -m rlcore.new_model`` is a model the backend builds as
    transformers does."""
    assert new_model.main([str(tmp_path), "--family", family, "--alphabet", "abcdefgh"]) == 0
    assert_logits_equal_transformers(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "sparse_layers"),
    [
        ({"norm_topk_prob": False}, (True, True)),  # expert weights: softmax over all experts
        ({"mlp_only_layers": [0]}, (False, True)),  # a dense layer, intermediate_size wide
        ({"num_hidden_layers": 3, "decoder_sparse_step": 2}, (False, True, False)),
    ],
    ids=["softmax-over-all", "mlp-only-layers", "sparse-step"],
)
def test_moe_options_match_transformers(
    overrides: dict[str, Any], sparse_layers: tuple[bool, ...], family_models: FamilyModels
) -> None:
    folder = family_models.folder("qwen3_moe", **overrides)
    model, arch = loaded_model(folder)
    assert arch.moe is not None and arch.moe.moe_layers == sparse_layers
    routers = [name for name, _ in model.named_parameters() if name.endswith("mlp.router.weight")]
    assert len(routers) == sum(sparse_layers)
    tokens = random_tokens(arch.vocab_size, seed=1)
    torch.testing.assert_close(
        megatron_logits(model, tokens, arch.vocab_size),
        hf_logits(folder, tokens),
        rtol=1e-5,
        atol=1e-5,
    )


def test_llama3_rope_frequencies_equal_transformers(family_models: FamilyModels) -> None:
    """The Llama 3 scaling touches only frequencies whose wavelength exceeds 2048 positions,
    which short test sequences hardly see: compare the frequencies themselves."""
    folder = family_models.folder("llama")
    model, _ = loaded_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = hf.model.rotary_emb.inv_freq
    got = model.rotary_pos_emb.inv_freq
    assert torch.equal(got.cpu(), expected.cpu())
    unscaled = read_hf_config(family_models.folder("llama", rope_scaling=None))
    plain, _ = loaded_model(family_models.folder("llama", rope_scaling=None))
    assert unscaled.rope_scaling is None
    assert not torch.equal(plain.rotary_pos_emb.inv_freq, got)  # the scaling did change some


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_model_exports_a_checkpoint_transformers_loads(
    family: Family, family_models: FamilyModels, tmp_path: Path
) -> None:
    source = family_models.folder(family)
    stack = MegatronBackend().build_training_stack(train_spec(source))
    stack.train_step(make_batch(make_samples(4, seed=3), seed=4))
    exported = weights(stack.export_weights())
    original = HFReader(source)
    assert exported.keys() == original.names()  # the published checkpoint's tensor names
    assert any(not torch.equal(t, original.get(n)) for n, t in exported.items())  # trained

    out = tmp_path / "hf"
    stack.save_hf(out)  # what --save-hf calls (rlcore.protocols.stacks.HFExporter)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [stack.arch.architecture]
    assert (config["model_type"], config["dtype"]) == (family, "float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == stack.arch.architecture
    tokens = random_tokens(stack.arch.vocab_size, seed=5)
    stack.gpt.eval()
    torch.testing.assert_close(
        megatron_logits(stack.gpt, tokens, stack.arch.vocab_size),
        hf_logits(out, tokens),
        rtol=1e-5,
        atol=1e-5,
    )

    # ... and back: the saved folder imports into a fresh model that exports the same bits
    again, arch = loaded_model(out)
    round_trip = weights(export_hf_weights(again, arch, "actor"))
    assert round_trip.keys() == exported.keys()
    for name, tensor in round_trip.items():
        assert torch.equal(tensor, exported[name]), name


def _expected_load_balancing_loss(folder: Path, micro_batches: list[list[Sample]]) -> float:
    """Megatron's router aux loss (Switch Transformer, eq. 4: ``E * sum_e f_e * P_e``, ``f_e``
    the share of top-k slots routed to expert ``e``, ``P_e`` its mean router probability), from
    transformers' router logits over each micro-batch's tokens, averaged over the sparse layers
    and micro-batches."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    top_k, experts = int(hf.config.num_experts_per_tok), int(hf.config.num_experts)
    losses = []
    for micro_batch in micro_batches:
        per_layer: list[list[torch.Tensor]] = []
        for sample in micro_batch:
            ids = torch.tensor([[*sample.prompt.token_ids, *sample.response.token_ids]])
            with torch.no_grad():
                router_logits = hf(ids, output_router_logits=True).router_logits
            per_layer = per_layer or [[] for _ in router_logits]
            for layer, logits in zip(per_layer, router_logits, strict=True):
                layer.append(logits)
        for layer in per_layer:
            probs = torch.cat(layer).softmax(dim=-1)
            chosen = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=1).indices, 1.0)
            share = chosen.sum(0) / (probs.shape[0] * top_k)
            losses.append(experts * float((share * probs.mean(0)).sum()))
    return sum(losses) / len(losses)


def test_router_load_balancing_loss_is_reported_and_trained(family_models: FamilyModels) -> None:
    folder = family_models.folder("qwen3_moe")
    samples = make_samples(4, seed=3)
    batch = make_batch(samples, seed=4)
    routers: list[torch.Tensor] = []
    # With the loss first: a stack without it, later in the same process, must not report the
    # entry the first left in Megatron's tracker (a 0.0 that was never computed).
    for coeff in (1.0, 0.0):
        spec = train_spec(folder)  # global batch 4 in micro-batches of 2
        spec = attrs.evolve(spec, model=attrs.evolve(spec.model, moe_aux_loss_coeff=coeff))
        stack = MegatronBackend().build_training_stack(spec)
        extra = stack.train_step(batch).extra
        routers.append(weights(stack.export_weights())["model.layers.0.mlp.gate.weight"])
        if coeff == 0.0:
            assert "load_balancing_loss" not in extra
        else:
            expected = _expected_load_balancing_loss(folder, [samples[:2], samples[2:]])
            assert extra["load_balancing_loss"] == pytest.approx(expected, rel=1e-5)
    assert not torch.equal(*routers)  # the loss reaches the router's gradient


@pytest.mark.parametrize(
    ("family", "overrides", "field"),
    [
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling.low_freq_factor",
        ),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        (  # both config styles, saying different things
            "llama",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
            "rope_scaling",
        ),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2", {"use_mrope": True}, "use_mrope"),
        ("qwen2", {"attention_dropout": 0.1}, "attention_dropout"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ("qwen3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ("qwen3_moe", {"mlp_only_layers": [7]}, "mlp_only_layers"),
        ("qwen3_moe", {"num_experts_per_tok": 32}, "num_experts_per_tok"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(
    family: Family, overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        arch_from_hf_config(tiny_config(family, **overrides))
    assert field in info.value.paths
    assert field in str(info.value)


def test_both_rope_styles_and_null_fields_read_like_transformers() -> None:
    llama3 = dict(PUBLISHED["llama"]["rope_scaling"], rope_theta=500000.0)
    both = arch_from_hf_config(tiny_config("llama", rope_parameters=llama3))
    assert both.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    # null is "not given": Qwen2.5's head_dim is hidden_size / heads
    assert arch_from_hf_config(tiny_config("qwen2", head_dim=None)).head_dim == 112 // 14


def test_parallel_sizes_that_do_not_fit_the_model_are_refused() -> None:
    moe = arch_from_hf_config(tiny_config("qwen3_moe"))  # 16 experts
    check_parallel(moe, 2, 2)
    with pytest.raises(ConfigError) as info:
        check_parallel(moe, 1, 3)
    assert "num_experts" in info.value.paths
    with pytest.raises(ConfigError) as info:
        check_parallel(arch_from_hf_config(tiny_config("qwen3")), 1, 2)
    assert "expert_model_parallel_size" in info.value.paths


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # GQA; qwen2 adds the fused QKV bias
def test_export_buffers_give_the_same_weights_in_reused_shared_memory(
    family: Family, family_models: FamilyModels
) -> None:
    """What a stack's weight sinks get: the plain export's values, with the tensors the export
    has to make (q, k, v) in shared buffers that the next export rewrites in place, so that a
    server on this machine maps them once (a changed parameter shows through the same buffer)."""
    model, arch = loaded_model(family_models.folder(family))
    buffers = ExportBuffers()
    first = dict(export_hf_weights(model, arch, "actor", buffers))
    plain = weights(export_hf_weights(model, arch, "actor"))
    assert first.keys() == plain.keys()
    for name, tensor in plain.items():
        assert torch.equal(first[name], tensor), name
    made = [name for name in first if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
    assert len(made) == arch.num_layers * (6 if arch.qkv_bias else 3)
    assert all(first[name].is_shared() for name in made)  # type: ignore[no-untyped-call]
    places = {name: first[name].data_ptr() for name in made}

    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    second = dict(export_hf_weights(model, arch, "actor", buffers))
    assert {name: second[name].data_ptr() for name in made} == places
    for name, tensor in export_hf_weights(model, arch, "actor"):
        assert torch.equal(second[name], tensor), name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_row_block_exports_are_views_of_the_fused_qkv(
    family: Family, family_models: FamilyModels
) -> None:
    """For sinks that take row blocks (the embedded engine's), q, k and v are views of the fused
    QKV parameter, each query group's rows a block (no copy on the rank: the sink's is the only
    one), holding the plain export's values."""
    model, arch = loaded_model(family_models.folder(family))
    plain = weights(export_hf_weights(model, arch, "actor"))
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    blocks = dict(export_hf_weights(model, arch, "actor", ExportBuffers(), blocks=True))
    assert blocks.keys() == plain.keys()
    split = 0
    for name, tensor in blocks.items():
        assert tensor.untyped_storage().data_ptr() in storages, name
        if tensor.shape != plain[name].shape:
            split += 1
            assert tensor.shape[:2] == (
                arch.num_kv_heads,
                plain[name].shape[0] // arch.num_kv_heads,
            )
        assert torch.equal(tensor.reshape(plain[name].shape), plain[name]), name
    assert split == arch.num_layers * (6 if arch.qkv_bias else 3)
