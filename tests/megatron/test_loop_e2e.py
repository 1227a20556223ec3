"""The core loop driving MegatronBackend: ``--save-hf`` exports at each interval. (What the loop
asks of every backend, save and resume, a teacher, a token budget, is in
tests/conformance/test_loop_contract.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from rlcore.config import structure_config
from rlcore.loop import RunData, run
from rlcore.loop.plan import plan
from rlcore.samples import EvalSet, Prompt
from rlcore.testing import ScriptedEngine, label_reward
from rlcore.testing.tiny import build_char_tokenizer, build_tiny_llama
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.stacks import MegatronTrainingStack
from tests.megatron.helpers import TINY, RecordingBackend

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

PROMPTS = tuple(
    Prompt(index=i, text=f"{i}+1=", token_ids=(1, i + 3), label=str(i + 1)) for i in range(6)
)
DATA = RunData(train_prompts=PROMPTS, eval_sets=(EvalSet("heldout", PROMPTS[:2]),), seed=3)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_hf_exports_hold_the_actor_at_each_interval(
    tmp_path: Path, megatron_rank: None, precision: str
) -> None:
    """``--save-hf`` through the loop: one folder per interval, each a whole model (weights in the
    run's dtype, config, tokenizer) that transformers loads; the last holds the actor's weights
    bit for bit and gives its logits."""
    model = tmp_path / "model"
    build_tiny_llama(model, **{**TINY, "vocab_size": 128})
    build_char_tokenizer(model, "".join(chr(c) for c in range(32, 125)))
    data: dict[str, Any] = {
        "model": {"hf_checkpoint": str(model), "bf16": precision == "bfloat16"},
        "rollout": {"num_rollout": 3, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "optim": {"lr": 1e-2},
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
        "checkpoint": {
            "save_hf": str(tmp_path / "hf" / "iter_{rollout_id}"),
            "save_hf_interval": 2,
        },
    }
    backend = RecordingBackend(MegatronBackend())
    run(plan(structure_config(data)), backend, ScriptedEngine(), label_reward, DATA)
    # Rollouts are counted from 1: exports after rollout 2 (the interval) and 3 (the last).
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["iter_2", "iter_3"]
    last = tmp_path / "hf" / "iter_3"
    assert json.loads((last / "config.json").read_text())["dtype"] == precision
    tokenizer = transformers.AutoTokenizer.from_pretrained(last)
    assert tokenizer.decode(tokenizer.encode("4+1=")[1:]) == "4+1="

    actor = backend.training["actor"]
    assert isinstance(actor, MegatronTrainingStack)
    live = {name: t.clone() for name, t in actor.export_weights()}
    saved = load_file(str(last / "model.safetensors"))
    assert saved.keys() == live.keys()
    assert all(torch.equal(saved[name], live[name]) for name in live)
    earlier = load_file(str(tmp_path / "hf" / "iter_2" / "model.safetensors"))
    assert any(not torch.equal(earlier[name], live[name]) for name in live)  # trained since

    hf = transformers.AutoModelForCausalLM.from_pretrained(last, dtype=getattr(torch, precision))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    actor.gpt.eval()
    with torch.no_grad():
        expected = hf(tokens).logits.float()
        got = actor.gpt(tokens, torch.arange(9).expand_as(tokens), None)[..., :128].float()
    atol = 1e-5 if precision == "float32" else 0.04  # bf16: two implementations' rounding
    torch.testing.assert_close(got, expected, rtol=0 if precision != "float32" else 1e-5, atol=atol)
