"""examples/own_backend.py: a user's pure-PyTorch backend driven by the core loop, sampling from
the model it trains with rlcore's TorchEngine, and learning."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rlcore.backend_api import EvalSpec, ModelSpec

ROOT = Path(__file__).resolve().parents[1]


def test_own_backend_learns_saves_and_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location(
        "own_backend", ROOT / "examples" / "own_backend.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    trained, evaluated, rewards = module.main(tmp_path)
    assert trained.trained == tuple(range(30))
    assert trained.saved == (29,)
    assert trained.evaluated == (-1, 7, 15, 23, 29)
    assert {"train/actor/loss", "train/critic/loss", "train/actor/lr"} <= set(trained.last_train)
    # It learns: guessing among 20 tokens scores about 1/20; the trained model most letters.
    assert sum(rewards[:3]) / 3 < 0.15
    assert sum(rewards[-3:]) / 3 > 0.6
    assert trained.last_eval["eval/letters/reward"] > 0.6
    # The eval-only run built only an eval stack, loaded the saved actor and, with the
    # checkpoint's settings (one-token answers), scored what training's last eval scored.
    assert evaluated.built == ("eval:actor",)
    assert evaluated.last_eval == trained.last_eval
    assert (
        "rollout.max_response_len (--rollout-max-response-len) = 1: from the checkpoint"
        in capsys.readouterr().out
    )
    state = torch.load(
        tmp_path / "ckpt" / "rollout_000030" / "actor" / "state.pt", weights_only=True
    )
    stack = module.TorchEvalStack(EvalSpec(ModelSpec("actor", None)))
    # The 30th rollout's checkpoint; the stack records the loop's rollout id, from 0.
    assert stack.load(tmp_path / "ckpt" / "rollout_000030" / "actor") == 29
    assert torch.equal(stack.model.state_dict()["head.weight"], state["model"]["head.weight"])
