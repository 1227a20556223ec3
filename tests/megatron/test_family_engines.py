"""Each model family through ``save_hf`` into the embedded rollout engine: the folder that the
Megatron export writes is served, greedy tokens and log-probs equal transformers', and a weight
update under the published checkpoint names (per-expert tensors for Qwen3-MoE, which transformers
5 keeps fused) lands where transformers would load it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.engines.embedded import EmbeddedEngine
from rlcore.samples import Prompt, SamplingParams
from rlcore.specs import EvalSpec, ModelSpec
from rlcore.testing.tiny import EOS_ID
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.model.arch import read_hf_config
from rlcore_megatron.model.hf_weights import save_hf
from tests.families import ALPHABET, FAMILIES, Family, FamilyModels, greedy_reference

pytestmark = pytest.mark.megatron

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPTS = [Prompt(i, "", (1, 3 + i, 3 + (7 * i) % 39, 3 + (13 * i) % 39)) for i in range(3)]


def exported_folder(source: Path, out: Path) -> Path:
    """``source`` loaded into Megatron and written back by ``save_hf`` (with its tokenizer)."""
    stack = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", source)))
    save_hf(stack, out, stack.arch)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def assert_serves_like_transformers(engine: EmbeddedEngine, reference: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
    for prompt, generation in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        tokens, log_probs = greedy_reference(model, prompt.token_ids, GREEDY.max_new_tokens)
        n = len(generation.token_ids)
        assert n == GREEDY.max_new_tokens or generation.token_ids[-1] == EOS_ID
        assert list(generation.token_ids) == tokens[:n]
        assert generation.log_probs == pytest.approx(log_probs[:n], abs=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_embedded_engine_serves_the_export_and_takes_its_weights(
    family: Family, family_models: FamilyModels, tmp_path: Path
) -> None:
    source = family_models.folder(family, peaked=True, alphabet=ALPHABET)
    served = exported_folder(source, tmp_path / "served")
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(served)))
    engine = EmbeddedEngine.from_pretrained(served, tokenizer)
    assert type(engine.model).__name__ == read_hf_config(served).architecture
    assert_serves_like_transformers(engine, served)

    # Other weights of the same architecture, sent as the Megatron stack exports them.
    other = family_models.folder(family, seed=1, peaked=True)
    stack = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", other)))
    engine.update_weights(stack.export_weights(), version=1)
    assert_serves_like_transformers(engine, other)
    if family == "qwen3_moe":  # the update went into transformers' fused expert tensors
        state = engine.model.state_dict()
        assert "model.layers.0.mlp.experts.gate_up_proj" in state
        assert not any(".experts.0." in name for name in state)
