"""Bring your own backend: a small but real pure-PyTorch backend driven by rlcore's loop.

The model is a tiny causal language model (embedding -> GRU -> logits over the next token); the
actor trains it with AdamW and a LambdaLR that follows the plan's LRSchedule, the critic is the
same model with a scalar value head. Two classes satisfy the ``TrainingStack`` and
``EvalStack`` of :mod:`rlcore.backend_api` structurally, one satisfies its ``Backend``; the
rollout engine is ``rlcore.engines.torch_engine.TorchEngine`` sampling from a copy of the model
being trained; the planner, loop, advantages, losses, checkpoints and eval come from rlcore, and
the train step's arithmetic (micro-batches, the global normaliser, the metrics) from
``rlcore.backend_api`` too.

The task: after ``c>`` answer the next letter, ``d``. Run it: ``python examples/own_backend.py``
prints the sampled reward of every rollout (about 1/20 at the start, when the model guesses) and
the greedy accuracy on the 16 prompts.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final, final

import torch
from torch import nn

import rlcore
from rlcore.backend_api import (
    CheckpointError,
    EvalSpec,
    ModelSpec,
    Sample,
    StepMetrics,
    TrainBatch,
    TrainMetrics,
    TrainSpec,
    WeightSink,
    actor_loss,
    critic_loss,
    deliver,
    gather_response,
    optimizer_step_batches,
    step_micro_batches,
    tensorize_samples,
    token_log_probs,
    unpad,
)
from rlcore.data.prompts import load_eval_sets, load_prompts
from rlcore.engines.torch_engine import TorchEngine
from rlcore.samples import Prompt
from rlcore.testing import RecordingSink

LETTERS = "abcdefghijklmnop"
PAD, BOS, EOS, ARROW = 0, 1, 2, 3
VOCAB = 4 + len(LETTERS)


class LetterTokenizer:
    """``rlcore.protocols.tokenizer.Tokenizer``: ``<pad> <bos> <eos> >`` then one id per letter;
    ``encode`` prepends ``<bos>``, ``decode`` leaves the special tokens out."""

    pad_token_id = PAD
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [BOS, *(ARROW if ch == ">" else 4 + LETTERS.index(ch) for ch in text)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(">" if t == ARROW else LETTERS[t - 4] for t in token_ids if t >= ARROW)


class TinyLM(nn.Module):
    """A causal language model: embedding -> GRU -> logits over the next token (or, with
    ``value_head``, one value per position, for a critic). ``forward(tokens [B, T]) -> [B, T, V]``
    is all rlcore.engines.TorchEngine needs to sample from it."""

    def __init__(self, seed: int, value_head: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 32)
        self.rnn = nn.GRU(32, 64, batch_first=True)
        self.head = nn.Linear(64, 1 if value_head else VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        out: torch.Tensor = self.head(hidden)
        return out


def _scores(model: TinyLM, spec: ModelSpec, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
    """Per response token: a critic's values, or a policy's log-probs at the rollout's
    temperature (``spec.temperature``: the tempered policy sampled, so it is what trains)."""
    tb = tensorize_samples(samples, PAD)
    with torch.no_grad():
        out = model(tb.tokens)
        if spec.role == "critic":
            per_token = gather_response(out.squeeze(-1), tb)
        else:
            per_token = token_log_probs(out, tb, spec.temperature)
    return unpad(per_token, tb)


def _load_model(model: TinyLM, path: Path) -> tuple[int, dict[str, object]]:
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

    kind: Final = "eval"

    def __init__(self, spec: EvalSpec) -> None:
        self._spec = spec.model
        self.model = TinyLM(spec.model.seed, value_head=spec.model.role == "critic").eval()

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return _scores(self.model, self.spec, samples)

    def load(self, path: Path) -> int:
        return _load_model(self.model, path)[0]

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        deliver(self.model.state_dict().items(), sinks)  # the weights are in this process


@final
class TorchTrainingStack:
    """Model, AdamW and a LambdaLR following the plan's schedule; one step per global batch."""

    kind: Final = "train"

    def __init__(self, spec: TrainSpec) -> None:
        self.train_spec = spec
        self.model = TinyLM(spec.model.seed, value_head=spec.model.role == "critic")
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
        return _scores(self.model, self.spec, samples)

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        spec = self.train_spec
        metrics = TrainMetrics(loss=0.0, grad_norm=0.0, lr=0.0, tokens=0)
        for global_batch in optimizer_step_batches(batch, spec, PAD):
            # One process: every micro-batch is this rank's; the loss of each is divided by the
            # whole global batch's normaliser, so the update is the global batch's.
            step = StepMetrics(global_batch, spec.loss.agg_mode)
            self._optimizer.zero_grad()
            # By spec.micro_batch_size samples, or by the token budget with
            # --use-dynamic-batch-size.
            for micro in step_micro_batches(global_batch, spec):
                out = self.model(micro.tokens)
                if self.spec.role == "critic":
                    result = critic_loss(gather_response(out.squeeze(-1), micro), micro, spec.loss)
                else:
                    log_probs = token_log_probs(out, micro, self.spec.temperature)
                    result = actor_loss(log_probs, micro, spec.loss)
                torch.autograd.backward(result.loss / step.normalizer)
                step.add(result)
            clip = spec.optimizer.clip_grad
            grad_norm = float(
                nn.utils.clip_grad_norm_(
                    self.model.parameters(), clip if clip > 0 else float("inf")
                )
            )
            lr = float(self._scheduler.get_last_lr()[0])
            self._optimizer.step()
            self._scheduler.step()
            means = step.reduce()
            loss = means.pop("loss")
            metrics = TrainMetrics(
                loss, grad_norm=grad_norm, lr=lr, tokens=step.tokens, extra=means
            )
        return metrics

    def save(self, path: Path, rollout_id: int) -> None:
        # ``path`` exists and is empty: the loop made it, inside a checkpoint folder it moves
        # into place only once every stack has saved.
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
    """``rlcore.backend_api.Backend``: two methods, no base class."""

    def build_training_stack(self, spec: TrainSpec) -> TorchTrainingStack:
        return TorchTrainingStack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> TorchEvalStack:
        return TorchEvalStack(spec)


def _write_data(folder: Path) -> tuple[Path, Path]:
    """Prompts ``c>`` labelled with the next letter, ``d`` (``p>`` -> ``a``): the training set
    and, for evaluation (greedy), the same 16 prompts."""
    rows = [
        {"input": f"{ch}>", "label": LETTERS[(i + 1) % len(LETTERS)]}
        for i, ch in enumerate(LETTERS)
    ]
    train, evaluation = folder / "train.jsonl", folder / "letters.jsonl"
    for path in (train, evaluation):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return train, evaluation


def _data(train: Path, evaluation: Path) -> rlcore.RunData:
    tokenizer = LetterTokenizer()
    return rlcore.RunData(
        train_prompts=load_prompts(train, tokenizer=tokenizer),
        eval_sets=load_eval_sets([("letters", evaluation)], tokenizer=tokenizer),
        seed=0,
    )


def _engine() -> TorchEngine:
    """The engine samples from its own TinyLM; the loop sends it the actor's weights before the
    first rollout and after every step."""
    return TorchEngine(TinyLM(seed=99, value_head=False), LetterTokenizer(), seed=0)


def main(folder: Path) -> tuple[rlcore.RunResult, rlcore.RunResult, list[float]]:
    """Train 30 PPO rollouts with a critic and save, then evaluate the checkpoint (eval-only).
    Returns both results and each rollout's mean sampled reward."""
    train, evaluation = _write_data(folder)
    save = folder / "ckpt"
    # fmt: off
    train_flags = [
        "--num-rollout", "30", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "1", "--global-batch-size", "32",
        "--micro-batch-size", "32", "--advantage-estimator", "ppo", "--normalize-advantages",
        "--lr", "1e-2", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
        "--save", str(save), "--eval-interval", "8", "--eval-prompt-data", "letters",
        str(evaluation), "--prompt-data", str(train),
    ]
    # fmt: on
    sink = RecordingSink()
    trained = rlcore.run(
        rlcore.plan(rlcore.load_config(train_flags)),
        TorchBackend(),
        _engine(),
        _reward,
        _data(train, evaluation),
        sink,
    )
    rewards = [m["rollout/reward"] for _, m in sink.records if "rollout/reward" in m]
    # Eval-only: the response length, sampling and data settings come from the checkpoint's run.
    eval_flags = ["--num-rollout", "0", "--load", str(save)]
    eval_flags += ["--eval-prompt-data", "letters", str(evaluation)]
    report: list[str] = []
    eval_config = rlcore.load_config(eval_flags, report=report)
    print("\n".join(report))
    evaluated = rlcore.run(
        rlcore.plan(eval_config),
        TorchBackend(),
        _engine(),
        _reward,
        _data(train, evaluation),
    )
    return trained, evaluated, rewards


def _reward(prompt: Prompt, generation: rlcore.Generation) -> float:
    return float(generation.text == prompt.label)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        trained, evaluated, rewards = main(Path(tmp))
    print("sampled reward by rollout:", " ".join(f"{r:.2f}" for r in rewards))
    print(
        "greedy eval after rollouts",
        [after + 1 for after in trained.evaluated],
        "last:",
        {k: round(v, 3) for k, v in trained.last_eval.items()},
    )
    print("eval-only on the checkpoint:", {k: round(v, 3) for k, v in evaluated.last_eval.items()})
    sys.exit(0)
