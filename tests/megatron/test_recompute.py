"""Activation recompute in the Megatron backend (``--recompute-granularity``,
``--recompute-method``, ``--recompute-num-layers``, issue #37): Megatron's own recompute gives
the loss, grad norm and updated weights of a step that keeps every activation; bad combinations
are refused with the flags named."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from rlcore.config.flags import load_config
from rlcore.errors import ConfigError
from rlcore.specs import EvalSpec, ModelSpec
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.options import MegatronOptions
from tests.families import FamilyModels
from tests.megatron.helpers import make_batch, make_samples, train_spec, weights

pytestmark = pytest.mark.megatron

TRAIN = ["--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
TRAIN += ["--global-batch-size", "16", "--micro-batch-size", "4"]

RECOMPUTE = {
    "full-uniform": MegatronOptions("full", "uniform", 1),
    "full-block": MegatronOptions("full", "block", 1),
    "selective": MegatronOptions("selective"),
}


def _step(hf: Path, options: MegatronOptions) -> tuple[float, float, dict[str, torch.Tensor], int]:
    """Loss, grad norm, updated weights, and the elements autograd saved for the backward."""
    stack = MegatronBackend(options=options).build_training_stack(
        train_spec(hf, global_batch_size=4, micro_batch_size=2)
    )
    batch = make_batch(make_samples(4, seed=5), seed=6, old=True, ref=True)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        metrics = stack.train_step(batch)
    return metrics.loss, metrics.grad_norm, weights(stack.export_weights()), saved


@pytest.mark.parametrize("variant", sorted(RECOMPUTE))
def test_recompute_gives_the_same_step(tiny_hf: Path, variant: str) -> None:
    loss, grad_norm, kept, kept_saved = _step(tiny_hf, MegatronOptions())
    r_loss, r_grad_norm, recomputed, r_saved = _step(tiny_hf, RECOMPUTE[variant])
    assert grad_norm > 0
    # Megatron's recompute ran: the forward under no_grad saves only each chunk's inputs, and the
    # backward's second forward saves the chunk's activations, so the hook sees more in all.
    assert r_saved > kept_saved
    assert r_loss == pytest.approx(loss, rel=1e-6)
    assert r_grad_norm == pytest.approx(grad_norm, rel=1e-5)
    assert recomputed.keys() == kept.keys()
    for name in kept:
        torch.testing.assert_close(recomputed[name], kept[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        ({"recompute_granularity": "full"}, ["--recompute-method", "--recompute-num-layers"]),
        ({"recompute_method": "block"}, ["--recompute-method"]),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 1},
            ["--recompute-num-layers"],
        ),
        (
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 0,
            },
            ["--recompute-num-layers"],
        ),
    ],
)
def test_bad_recompute_flags_are_refused(kwargs: dict[str, object], flags: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        MegatronOptions(**kwargs)  # type: ignore[arg-type]  # the values a config file could hold
    assert [p.path.split(" ")[-1].strip("()") for p in info.value.problems] == flags


@pytest.mark.parametrize(("method", "layers"), [("uniform", 3), ("block", 3), ("uniform", 2)])
def test_recompute_layers_must_fit_the_model(method: str, layers: int) -> None:
    options = MegatronOptions("full", method, layers)  # type: ignore[arg-type]  # a literal
    problem = options.num_layers_problem(3 if layers == 2 else 2)
    assert problem is not None
    assert "--recompute-num-layers" in problem.path
    assert options.num_layers_problem(layers * 2) is None


def test_recompute_flags_and_config_section_reach_the_backend_options(tmp_path: Path) -> None:
    argv = [*TRAIN, "--recompute-granularity", "full", "--recompute-method", "block"]
    config = load_config([*argv, "--recompute-num-layers", "2"])
    assert config.model.backend_options == MegatronOptions("full", "block", 2)
    toml = tmp_path / "run.toml"
    toml.write_text('[megatron]\nrecompute_granularity = "selective"\n')
    assert load_config([*TRAIN, "--config", str(toml)]).model.backend_options == MegatronOptions(
        "selective"
    )
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert [str(p) for p in info.value.problems] == [
        "megatron.recompute_num_layers (--recompute-num-layers): --recompute-granularity full "
        "needs a number of layers (add --recompute-num-layers N: 1 recomputes each layer from "
        "its input)"
    ]


def test_a_stack_refuses_more_recomputed_layers_than_the_model_has(tiny_hf: Path) -> None:
    backend = MegatronBackend(options=MegatronOptions("full", "block", 3))
    with pytest.raises(ConfigError, match=r"--recompute-num-layers.*2 layers, fewer than 3"):
        backend.build_training_stack(train_spec(tiny_hf))
    # An eval stack (a reference model, a smaller OPD teacher) runs no backward: not refused.
    assert backend.build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf))).forward([]) == []


def test_recompute_leaves_a_mixture_of_experts_step_and_its_aux_loss_alone(
    family_models: FamilyModels,
) -> None:
    """Qwen3-MoE with the router's load-balancing loss: a recomputed layer runs its router twice,
    and the loss Megatron tracks (``extra``) must still count once."""
    spec = train_spec(family_models.folder("qwen3_moe"))
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, moe_aux_loss_coeff=1.0))
    batch = make_batch(make_samples(4, seed=3), seed=4)
    results = []
    for options in (MegatronOptions(), MegatronOptions("full", "uniform", 1)):
        stack = MegatronBackend(options=options).build_training_stack(spec)
        results.append((stack.train_step(batch), weights(stack.export_weights())))
    (kept, w_kept), (recomputed, w_recomputed) = results
    assert kept.extra["load_balancing_loss"] > 0
    assert recomputed.loss == pytest.approx(kept.loss, rel=1e-6)
    assert recomputed.grad_norm == pytest.approx(kept.grad_norm, rel=1e-5)
    assert recomputed.extra.keys() == kept.extra.keys()
    for key, value in kept.extra.items():
        assert recomputed.extra[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for name in w_kept:
        torch.testing.assert_close(w_recomputed[name], w_kept[name], rtol=1e-5, atol=1e-7)
