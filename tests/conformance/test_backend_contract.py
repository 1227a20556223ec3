"""What every backend must do for the core, run against each backend of
:data:`~tests.conformance.candidates.CANDIDATES` (the fake, Megatron, FSDP, the example):
an eval stack is a model only, an eval-only run builds nothing else, a training stack trains,
saves and loads (the weights out after a load are the weights that were saved), and an update
does not depend on how a global batch is cut into micro-batches."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import pytest
import torch

import rlcore
from rlcore.errors import BackendContractError, CheckpointError
from rlcore.loop.contracts import build_eval_stack, build_training_stack
from rlcore.protocols.stacks import Backend, EvalStack, ModelStack, TrainingStack
from rlcore.samples import EvalSet, ForwardRows, Generation, Prompt, Sample, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore.testing import ScriptedEngine, label_reward
from rlcore.weights import InProcess, NamedTensors
from tests.conformance.conftest import Under
from tests.megatron.helpers import (
    assert_same_step,
    gradient_step_spec,
    make_batch,
    make_samples,
    train_spec,
)


class _Keep:
    """An in-process weight sink that keeps a copy of everything it receives."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, weights: NamedTensors) -> None:
        self.weights = {name: t.detach().clone() for name, t in weights}


def _weights_out(stack: ModelStack) -> dict[str, torch.Tensor]:
    sink = _Keep()
    stack.send_weights([sink])
    return sink.weights


def _spec(
    under: Under, global_batch_size: int, micro_batch_size: int = 1, steps_per_rollout: int = 1
) -> TrainSpec:
    return train_spec(
        under.model,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        steps_per_rollout=steps_per_rollout,
    )


def test_an_eval_stack_is_a_model_only(candidate: Under) -> None:
    spec = EvalSpec(ModelSpec("reference", candidate.model))
    stack = candidate.backend.build_eval_stack(spec)
    assert isinstance(stack, EvalStack) and stack.kind == "eval"
    assert not any(hasattr(stack, name) for name in ("optimizer", "scheduler", "train_step"))
    assert stack.spec == spec.model
    samples = make_samples(3, vocab=candidate.vocab)
    rows = stack.forward(samples)
    assert [len(r) for r in rows] == [len(s.response.token_ids) for s in samples]
    assert all(isinstance(x, float) for r in rows for x in r)
    assert all(isinstance(name, str) for name in _weights_out(stack))  # an in-process sink


def test_a_training_stack_trains_saves_and_loads(candidate: Under, tmp_path: Path) -> None:
    """Two optimizer steps, a save, and a fresh training stack and an eval stack that load it:
    both score as the trained one does and send out the weights it saved."""
    spec = _spec(candidate, global_batch_size=2, micro_batch_size=1, steps_per_rollout=2)
    stack = candidate.backend.build_training_stack(spec)
    assert isinstance(stack, TrainingStack) and stack.kind == "train"
    assert stack.spec == spec.model
    assert isinstance(stack.optimizer.state_dict(), Mapping)
    assert isinstance(stack.scheduler.state_dict(), Mapping)
    samples = make_samples(4, vocab=candidate.vocab)
    metrics = stack.train_step(make_batch(samples))
    assert isinstance(metrics, TrainMetrics) and metrics.tokens > 0
    folder = tmp_path / "actor"
    folder.mkdir()
    stack.save(folder, 7)
    saved = _weights_out(stack)
    for loaded in (
        candidate.backend.build_training_stack(spec),
        candidate.backend.build_eval_stack(EvalSpec(spec.model)),
    ):
        assert loaded.load(folder) == 7
        assert loaded.forward(samples) == stack.forward(samples)
        out = _weights_out(loaded)
        assert out.keys() == saved.keys()
        assert all(torch.equal(out[name], saved[name]) for name in saved)


@pytest.mark.parametrize("cut", ["four micro-batches", "a token budget"])
def test_an_update_does_not_depend_on_the_micro_batches(candidate: Under, cut: str) -> None:
    """One global batch of 4 in one micro-batch, or in four, or in micro-batches of at most 8
    padded tokens (``--use-dynamic-batch-size``): the same metrics and the same step (the loss of
    each micro-batch is divided by the whole global batch's normaliser). The step is the
    gradient (:func:`~tests.megatron.helpers.gradient_step_spec`): Adam's usual first step,
    ``lr * sign(g)``, would flip a whole step on the rounding of a near-zero gradient and hide
    a real difference below ``lr``."""
    samples = make_samples(4, seed=5, vocab=candidate.vocab)
    batch = make_batch(samples, seed=6, rollout=True)
    whole_spec = gradient_step_spec(candidate.model, global_batch_size=4, micro_batch_size=4)
    if cut == "a token budget":
        split_spec = attrs.evolve(whole_spec, max_tokens_per_gpu=8)
    else:
        split_spec = attrs.evolve(whole_spec, micro_batch_size=1)
    results = []
    for spec in (whole_spec, split_spec):
        stack = candidate.backend.build_training_stack(spec)
        before = _weights_out(stack)
        metrics = stack.train_step(batch)
        results.append((metrics, _weights_out(stack)))
    (whole, whole_weights), (split, split_weights) = results
    assert split.tokens == whole.tokens
    assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-7)
    assert split.grad_norm == pytest.approx(whole.grad_norm, rel=1e-4, abs=1e-7)
    assert split.extra.keys() == whole.extra.keys()
    for key, value in whole.extra.items():
        assert split.extra[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert split_weights.keys() == whole_weights.keys()
    for name, tensor in whole_weights.items():
        assert_same_step(split_weights[name], tensor, before[name], name)


LONG_TAILED = (28, 2, 3, 2, 3, 2, 3, 2)
"""Response lengths of a long-tailed batch (prompts of two tokens): 30, then 4 and 5 tokens."""

POSITIONS: Mapping[str, Mapping[str, int | None]] = {
    # one micro-batch of 16 sequences or fewer, all padded to the long one's 30 tokens
    "padded": {"fake": 8 * 30, "megatron": 8 * 30, "fsdp": 8 * 30},
    # a budget of 32: the long one alone, six of 5 and 4 tokens padded to 5, the last 4 alone;
    # the fake runs packed sequences (no padding)
    "budget": {"fake": 61, "megatron": 30 + 6 * 5 + 4, "fsdp": 30 + 6 * 5 + 4},
}
"""The positions a forward pass over the long-tailed batch runs, by hand; a backend not named
(the example) returns a plain list, which says nothing of them."""


@pytest.mark.parametrize("cut", ["padded", "budget"])
def test_a_forward_pass_says_the_positions_it_ran(candidate: Under, cut: str) -> None:
    """What the loop reports as a pass's padding fraction (``perf/NAME_padding``): the samples'
    tokens and the positions run, padding included, for the long-tailed batch padded to its
    longest sequence or cut by a token budget (``--log-probs-max-tokens-per-gpu``)."""
    samples = [
        Sample(
            Prompt(i, "", (1, 3)),
            Generation(tuple(4 + (i + j) % 9 for j in range(n)), (-1.0,) * n, "stop"),
            0.0,
            i,
        )
        for i, n in enumerate(LONG_TAILED)
    ]
    budget = 32 if cut == "budget" else None
    spec = EvalSpec(ModelSpec("reference", candidate.model, log_probs_max_tokens_per_gpu=budget))
    rows = build_eval_stack(candidate.backend, spec).forward(samples)  # as the loop calls it
    assert [len(r) for r in rows] == list(LONG_TAILED)
    positions = POSITIONS[cut].get(candidate.name)
    if positions is None:
        assert type(rows) is list
        return
    assert isinstance(rows, ForwardRows)
    assert (rows.sequence_tokens, rows.padded_tokens) == (61, positions)


def test_a_missing_checkpoint_is_named(candidate: Under, tmp_path: Path) -> None:
    stack = candidate.backend.build_eval_stack(EvalSpec(ModelSpec("actor", candidate.model)))
    with pytest.raises(CheckpointError, match=str(tmp_path / "missing")):
        stack.load(tmp_path / "missing")


def test_each_stack_is_of_the_kind_asked_for(candidate: Under) -> None:
    """What the loop checks at bring-up: an eval stack is tagged ``eval`` and has no training
    members, a training stack is tagged ``train``."""
    actor = ModelSpec("actor", candidate.model)
    assert build_eval_stack(candidate.backend, EvalSpec(actor)).kind == "eval"
    spec = _spec(candidate, global_batch_size=2, micro_batch_size=1)
    assert build_training_stack(candidate.backend, spec).kind == "train"


def _eval_only(backend: Backend, under: Under, folder: Path) -> rlcore.RunResult:
    (folder / "x.jsonl").touch()
    flags = ["--num-rollout", "0", "--eval-prompt-data", "x", str(folder / "x.jsonl")]
    if under.model is not None:
        flags += ["--hf-checkpoint", str(under.model)]
    the_plan = rlcore.plan(rlcore.load_config(flags))
    if under.model is None:  # nothing to load: the backend's own initial weights
        assert isinstance(the_plan, rlcore.EvalPlan)
        the_plan = attrs.evolve(the_plan, random_weights=True)
    prompts = (Prompt(0, "1+1=", (1, 3), "2"),)
    data = rlcore.RunData(eval_sets=(EvalSet("x", prompts),))
    return rlcore.run(the_plan, backend, ScriptedEngine(), label_reward, data)


def test_an_eval_only_run_builds_the_actors_eval_stack_and_nothing_else(
    candidate: Under, tmp_path: Path
) -> None:
    result = _eval_only(candidate.backend, candidate, tmp_path)
    assert result.built == ("eval:actor",) and result.trained == ()
    assert "eval/x/reward" in result.last_eval


class _HandsOutTrainingStacks:
    """A backend that skips typing and answers ``build_eval_stack`` with a training stack."""

    def __init__(self, inner: Backend, train: TrainSpec) -> None:
        self.inner = inner
        self.train = train

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        return self.inner.build_training_stack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> TrainingStack:
        return self.inner.build_training_stack(attrs.evolve(self.train, model=spec.model))


def test_an_eval_only_run_refuses_a_training_stack_before_evaluating(
    candidate: Under, tmp_path: Path
) -> None:
    cheat = _HandsOutTrainingStacks(candidate.backend, _spec(candidate, global_batch_size=2))
    with pytest.raises(BackendContractError) as info:
        _eval_only(cheat, candidate, tmp_path)  # type: ignore[arg-type]  # the point: untyped
    message = str(info.value)
    assert "_HandsOutTrainingStacks.build_eval_stack(actor)" in message
    assert "exposes optimizer, scheduler, train_step" in message


def test_weights_out_of_a_model_folder_are_its_weights(model_reader: Under) -> None:
    """A backend that builds its models from Hugging Face folders sends an untrained model's
    weights out as they came in, under the folder's names."""
    from safetensors.torch import load_file

    assert model_reader.model is not None
    stack = model_reader.backend.build_eval_stack(EvalSpec(ModelSpec("actor", model_reader.model)))
    out = _weights_out(stack)
    folder = {
        name: tensor
        for file in model_reader.model.glob("*.safetensors")
        for name, tensor in load_file(str(file)).items()
    }
    assert sorted(out) == sorted(folder)
    assert all(torch.equal(out[name], tensor) for name, tensor in folder.items())
