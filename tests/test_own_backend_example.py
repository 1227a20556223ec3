"""examples/own_backend.py: a user's pure-PyTorch backend driven by the core loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_own_backend_trains_saves_and_evaluates(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "own_backend", ROOT / "examples" / "own_backend.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    trained, evaluated = module.main(tmp_path)
    assert trained.trained == (0, 1, 2, 3)
    assert trained.saved == (3,)
    assert trained.evaluated == (-1, 1, 3)
    assert {"train/actor/loss", "train/critic/loss", "train/actor/lr"} <= set(trained.last_train)
    assert trained.last_train["train/actor/lr"] > 0
    # The eval-only run loaded the saved actor: same weights as in the checkpoint.
    state = torch.load(
        tmp_path / "ckpt" / "rollout_000003" / "actor" / "state.pt", weights_only=True
    )
    stack = module.TorchEvalStack(module.rlcore.EvalSpec(module.rlcore.ModelSpec("actor", None)))
    assert stack.load(tmp_path / "ckpt" / "rollout_000003" / "actor") == 3
    assert torch.equal(stack.model.state_dict()["head.weight"], state["model"]["head.weight"])
    assert set(evaluated.last_eval) == {
        "eval/doubles/reward",
        "eval/doubles/pass@1",
        "eval/doubles/response_len",
    }
