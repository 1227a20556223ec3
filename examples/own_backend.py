"""Bring your own backend: a small but real pure-PyTorch backend driven by rlcore's loop.

The model is a bigram language model (token embedding -> logits over the next token); the actor
trains it with AdamW and a LambdaLR that follows the plan's LRSchedule, the critic is the same
model with a scalar value head. Two classes satisfy ``rlcore.TrainingStack`` / ``rlcore.EvalStack``
structurally, one satisfies ``rlcore.Backend``; the planner, loop, advantages, losses, checkpoints
and eval come from rlcore. Run it: ``python examples/own_backend.py``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import final

import torch
from torch import nn

import rlcore
from rlcore.algorithms import (
    actor_loss,
    critic_loss,
    gather_response,
    loss_normalizer,
    tensorize,
    tensorize_samples,
    token_log_probs,
    unpad,
)
from rlcore.errors import CheckpointError
from rlcore.protocols import WeightSink
from rlcore.samples import EvalSet, Prompt, Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore.testing import ScriptedEngine
from rlcore.weights import deliver

VOCAB = 128  # the scripted engine emits characters' code points
PAD = 0


class Bigram(nn.Module):
    """logits[b, s] = W · embed(tokens[b, s]); ``value_head`` turns it into a critic."""

    def __init__(self, seed: int, value_head: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, 1 if value_head else VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(tokens))
        return out


def _scores(model: Bigram, role: str, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
    tb = tensorize_samples(samples, PAD)
    with torch.no_grad():
        out = model(tb.tokens)
        per_token = (
            gather_response(out.squeeze(-1), tb) if role == "critic" else token_log_probs(out, tb)
        )
    return unpad(per_token, tb)


def _load_model(model: Bigram, path: Path) -> tuple[int, dict[str, object]]:
    try:
        state = torch.load(path / "state.pt", weights_only=True)
        meta = json.loads((path / "meta.json").read_text())
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot load {path}: {exc}") from exc
    model.load_state_dict(state["model"])
    return int(meta["rollout_id"]), state


@final
class TorchEvalStack:
    """Model only: no optimizer, no scheduler."""

    def __init__(self, spec: EvalSpec) -> None:
        self._spec = spec.model
        self.model = Bigram(spec.model.seed, value_head=spec.model.role == "critic").eval()

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return _scores(self.model, self._spec.role, samples)

    def load(self, path: Path) -> int:
        return _load_model(self.model, path)[0]

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        deliver(self.model.state_dict().items(), sinks)  # the weights are in this process


@final
class TorchTrainingStack:
    """Model, AdamW and a LambdaLR following the plan's schedule; one step per global batch."""

    def __init__(self, spec: TrainSpec) -> None:
        self.train_spec = spec
        self.model = Bigram(spec.model.seed, value_head=spec.model.role == "critic")
        o = spec.optimizer
        self._optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=o.schedule.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            weight_decay=o.weight_decay,
        )
        self._scheduler = torch.optim.lr_scheduler.LambdaLR(
            self._optimizer, lambda step: o.schedule.lr_at(step) / o.schedule.lr
        )

    @property
    def spec(self) -> ModelSpec:
        return self.train_spec.model

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self._scheduler

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return _scores(self.model, self.spec.role, samples)

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        tb = tensorize(batch, PAD)
        size = self.train_spec.global_batch_size
        loss_value = grad_norm = 0.0
        lr = 0.0
        extra: dict[str, float] = {}
        for start in range(0, tb.num_sequences, size):
            step = tb.select(slice(start, start + size))
            out = self.model(step.tokens)
            if self.spec.role == "critic":
                result = critic_loss(
                    gather_response(out.squeeze(-1), step), step, self.train_spec.loss
                )
            else:
                result = actor_loss(token_log_probs(out, step), step, self.train_spec.loss)
            # The loss is a numerator: divide by the global batch's normaliser (sequences, or
            # tokens for --loss-agg-mode token-mean). Here one step is one micro-batch.
            loss = result.loss / loss_normalizer(self.train_spec.loss.agg_mode, step.loss_mask)
            self._optimizer.zero_grad()
            torch.autograd.backward(loss)
            clip = self.train_spec.optimizer.clip_grad
            grad_norm = float(
                nn.utils.clip_grad_norm_(
                    self.model.parameters(), clip if clip > 0 else float("inf")
                )
            )
            lr = float(self._scheduler.get_last_lr()[0])
            self._optimizer.step()
            self._scheduler.step()
            loss_value, extra = float(loss.detach()), result.metrics
        tokens = sum(len(s.response.token_ids) for s in batch.samples)
        return TrainMetrics(loss=loss_value, grad_norm=grad_norm, lr=lr, tokens=tokens, extra=extra)

    def save(self, path: Path, rollout_id: int) -> None:
        path.mkdir(parents=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self._optimizer.state_dict(),
            "scheduler": self._scheduler.state_dict(),
        }
        torch.save(state, path / "state.pt")
        (path / "meta.json").write_text(
            json.dumps({"rollout_id": rollout_id})
        )  # last: marks it complete

    def load(self, path: Path) -> int:
        rollout_id, state = _load_model(self.model, path)
        self._optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]  # torch.load returns untyped dicts
        self._scheduler.load_state_dict(state["scheduler"])  # type: ignore[arg-type]  # likewise
        return rollout_id

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        deliver(self.model.state_dict().items(), sinks)


@final
class TorchBackend:
    """``rlcore.Backend``: two methods, no base class."""

    def build_training_stack(self, spec: TrainSpec) -> TorchTrainingStack:
        return TorchTrainingStack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> TorchEvalStack:
        return TorchEvalStack(spec)


def _data() -> rlcore.RunData:
    prompts = tuple(
        Prompt(index=i, text=f"{i}+{i}=", token_ids=(1, 2, 3), label=str(2 * i)) for i in range(16)
    )
    return rlcore.RunData(
        train_prompts=prompts, eval_sets=(EvalSet("doubles", prompts[:4]),), seed=0
    )


def _reward(prompt: Prompt, generation: rlcore.Generation) -> float:
    return float(generation.text == prompt.label)


def main(folder: Path) -> tuple[rlcore.RunResult, rlcore.RunResult]:
    """Train 4 PPO rollouts with a critic and save, then evaluate the checkpoint (eval-only)."""
    save = folder / "ckpt"
    train_flags = [
        "--num-rollout",
        "4",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "4",
        "--advantage-estimator",
        "ppo",
        "--lr",
        "1e-3",
        "--lr-warmup-iters",
        "2",
        "--lr-decay-style",
        "cosine",
        "--save",
        str(save),
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        "doubles",
        "unused.jsonl",
    ]
    trained = rlcore.run(
        rlcore.plan(rlcore.load_config(train_flags)),
        TorchBackend(),
        ScriptedEngine(),
        _reward,
        _data(),
    )
    eval_flags = [
        "--num-rollout",
        "0",
        "--load",
        str(save),
        "--eval-prompt-data",
        "doubles",
        "unused.jsonl",
    ]
    evaluated = rlcore.run(
        rlcore.plan(rlcore.load_config(eval_flags)),
        TorchBackend(),
        ScriptedEngine(),
        _reward,
        _data(),
    )
    return trained, evaluated


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        trained, evaluated = main(Path(tmp))
    print(
        "trained rollouts:",
        trained.trained,
        "saved:",
        trained.saved,
        "evaluated after:",
        trained.evaluated,
    )
    print(
        "last train metrics:",
        {k: round(v, 4) for k, v in trained.last_train.items() if k.startswith("train/")},
    )
    print("eval-only on the checkpoint:", dict(evaluated.last_eval))
    sys.exit(0)
