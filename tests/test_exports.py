"""The public surface: pinned ``__all__``, a light ``import rlcore``, final concrete classes."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import rlcore
import rlcore.testing

EXPECTED = {
    "Environment",
    "EnvironmentFactory",
    "StepResult",
    "EpisodeEngine",
    "GenerateContext",
    "Turn",
    "Tool",
    "ToolEnvironment",
    "save_rollout_data",
    "load_rollout_data",
    "default_rollout",
    "check_reward_nonzero_std",
    "RolloutSpec",
    "RolloutOutput",
    "RolloutOnlyPlan",
    "RolloutFn",
    "RolloutContext",
    "PromptSource",
    "GroupFilter",
    "Group",
    "DynamicSampling",
    "AdvantageSpec",
    "BackendContractError",
    "BackendError",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ConfigProblem",
    "DataError",
    "EvalPlan",
    "EvalSet",
    "Generation",
    "MetricsSink",
    "Plan",
    "PlanError",
    "Prompt",
    "RLCoreError",
    "RewardError",
    "RewardFn",
    "RolloutEngine",
    "RolloutError",
    "RunConfig",
    "RunData",
    "RunInterrupted",
    "RunResult",
    "Sample",
    "SamplingParams",
    "TrainPlan",
    "execute",
    "load_backend",
    "load_config",
    "plan",
    "run",
    "should_eval",
    "should_save",
}


BACKEND_API = {
    "KNOWN_BACKENDS",
    "AnyProcess",
    "Backend",
    "BackendContractError",
    "BackendKind",
    "BackendUnavailableError",
    "CheckpointError",
    "EvalSpec",
    "EvalStack",
    "ForwardRows",
    "HFExporter",
    "ISCorrection",
    "InProcess",
    "LRSchedule",
    "LoadSpec",
    "LossOut",
    "LossSpec",
    "ModelSpec",
    "ModelStack",
    "NamedTensors",
    "OnHost",
    "Optimizer",
    "OptimizerSpec",
    "ParallelSpec",
    "RankRuntime",
    "Sample",
    "Scheduler",
    "StepMetrics",
    "TensorBatch",
    "TrainBatch",
    "TrainMetrics",
    "TrainSpec",
    "TrainingStack",
    "WeightSink",
    "WeightSource",
    "actor_loss",
    "all_reduce_floats",
    "critic_loss",
    "deliver",
    "entropy_from_logits",
    "forward_groups",
    "gather_response",
    "in_input_order",
    "init_process_group",
    "load_backend_kind",
    "local_micro_batches",
    "logprob_temperature",
    "micro_batch_loss",
    "optimizer_step_batches",
    "score_samples",
    "send_exported",
    "step_micro_batches",
    "tempered",
    "tensorize",
    "tensorize_samples",
    "token_log_probs",
    "unpad",
}
"""What a backend author implements and may reuse (issue #35: the public API by audience)."""


def test_all_is_pinned() -> None:
    assert set(rlcore.__all__) == EXPECTED
    assert sorted(rlcore.__all__) == rlcore.__all__
    for name in rlcore.__all__:
        assert hasattr(rlcore, name), name


def test_backend_authors_have_one_module_and_it_is_light_until_torch_is_asked_for() -> None:
    import rlcore.backend_api as api

    assert set(api.__all__) == BACKEND_API
    code = (
        "import sys, rlcore.backend_api as api; heavy = 'torch' in sys.modules; "
        "api.token_log_probs; print(heavy, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "True"]
    for name in api.__all__:
        assert getattr(api, name) is not None, name


def test_import_rlcore_is_light() -> None:
    code = (
        "import sys, json, rlcore, rlcore.testing, rlcore.testing.tiny, rlcore.new_model, "
        "rlcore.data, rlcore.rollout.rewards, rlcore.loop.metrics; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'megatron', 'ray', 'sglang', 'transformers', 'tokenizers', 'numpy', "
        "'rlcore_megatron', 'rlcore_sglang', 'rlcore_fsdp'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent,
    )
    assert json.loads(out.stdout) == []


def test_concrete_testing_classes_are_final() -> None:
    for name in ("FakeBackend", "FakeEvalStack", "FakeTrainingStack", "ScriptedEngine"):
        cls = getattr(rlcore.testing, name)
        assert inspect.isclass(cls) and getattr(cls, "__final__", False), name


def test_errors_share_one_root() -> None:
    for name in rlcore.__all__:
        obj = getattr(rlcore, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, rlcore.RLCoreError)
