"""The ``[model]`` and ``[cluster]`` sections: which model and how it is split over ranks, and
where ranks and rollout servers run; with the engine and placement checks
(:func:`engine_and_cluster_problems`) and the parallel splits (:func:`parallel_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlcore.backends import KNOWN_BACKENDS
from rlcore.config.fields import option, problem, problems_under
from rlcore.config.kinds import CHOICES, options_problem
from rlcore.config.rollout import RolloutConfig
from rlcore.errors import ConfigProblem
from rlcore.specs import expert_split_problem, parallel_split_problem

ENGINE, BACKEND = CHOICES

__all__ = [
    "ClusterConfig",
    "ModelConfig",
    "engine_and_cluster_problems",
    "model_problems",
    "parallel_problems",
]


@attrs.frozen
class ModelConfig:
    """Which model, and how it is split over ranks."""

    hf_checkpoint: Path | None = option(
        None, "--hf-checkpoint", "HF model folder (config.json + safetensors)"
    )
    train_backend: str = option(
        "megatron",
        "--train-backend",
        "the training backend, by name (slime's and Miles's flag); backend-specific settings "
        "are below, under the backend's name",
        choices=tuple(KNOWN_BACKENDS),
    )
    backend_options: object = attrs.field(
        default=None,
        metadata={
            "help": "the chosen backend's own settings (its flags, or its config-file section)"
        },
    )
    """The chosen backend's own settings, an instance of its options class (``None``: its
    defaults), from its flags or its config-file section (``[megatron]``); see
    :mod:`rlcore.config.kinds`."""
    tensor_model_parallel_size: int = option(
        1, "--tensor-model-parallel-size", "tensor-parallel ranks"
    )
    expert_model_parallel_size: int = option(
        1, "--expert-model-parallel-size", "expert-parallel ranks (MoE models share experts out)"
    )
    pipeline_model_parallel_size: int = option(
        1,
        "--pipeline-model-parallel-size",
        "pipeline stages (the layers cut into stages over ranks); a backend that does not cut "
        "layers refuses more than 1 before anything starts",
    )
    moe_aux_loss_coeff: float = option(
        0.0, "--moe-aux-loss-coeff", "MoE router load-balancing loss weight (0 = off)"
    )
    bf16: bool = option(
        False,
        "--bf16",
        "bf16 weights and activations (fp32 main weights, optimizer state and gradient "
        "reduction); the rollout engine runs in bf16 too (default: fp32)",
    )


@attrs.frozen
class ClusterConfig:
    """Where ranks and rollout servers run: slime's flags, with slime's meaning.

    One rank per GPU; on a cluster without GPUs, one rank per CPU slot (a logical CPU), and the
    actor's, critic's and reference model's ranks share their slots (they take turns in the loop).
    """

    actor_num_nodes: int = option(1, "--actor-num-nodes", "nodes for the actor's ranks")
    actor_num_gpus_per_node: int = option(
        1, "--actor-num-gpus-per-node", "actor ranks (GPUs, or CPU slots) per node"
    )
    critic_num_nodes: int | None = option(
        None, "--critic-num-nodes", "nodes for the critic's ranks (default: --actor-num-nodes)"
    )
    critic_num_gpus_per_node: int | None = option(
        None,
        "--critic-num-gpus-per-node",
        "critic ranks per node (default: --actor-num-gpus-per-node)",
    )
    rollout_num_gpus: int | None = option(
        None,
        "--rollout-num-gpus",
        "GPUs (or CPU slots) for rollout servers in all (default: the actor's with --colocate, "
        "else one engine's)",
    )
    rollout_num_gpus_per_engine: int = option(
        1, "--rollout-num-gpus-per-engine", "GPUs per rollout server (its tensor-parallel size)"
    )
    colocate: bool = option(
        False, "--colocate", "rollout servers share the actor's GPUs (else they get their own)"
    )

    @property
    def actor_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def critic_ranks(self) -> int:
        nodes = self.critic_num_nodes or self.actor_num_nodes
        return nodes * (self.critic_num_gpus_per_node or self.actor_num_gpus_per_node)

    @property
    def rollout_gpus(self) -> int:
        """GPUs (or CPU slots) the rollout servers take, when the engine runs servers."""
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus
        return self.actor_ranks if self.colocate else self.rollout_num_gpus_per_engine


def model_problems(m: ModelConfig) -> list[ConfigProblem]:
    """A known, installed backend with options of its type; parallel sizes at least 1, a
    non-negative MoE loss weight."""
    backend = options_problem(BACKEND, m)[0]
    problems = [] if backend is None else [backend]
    problems += [
        problem(ModelConfig, "model", name, f"must be >= 1, got {getattr(m, name)}")
        for name in (
            "tensor_model_parallel_size",
            "expert_model_parallel_size",
            "pipeline_model_parallel_size",
        )
        if getattr(m, name) < 1
    ]
    if not m.moe_aux_loss_coeff >= 0:
        problems.append(
            problem(
                ModelConfig,
                "model",
                "moe_aux_loss_coeff",
                f"must be >= 0, got {m.moe_aux_loss_coeff}",
            )
        )
    return problems


def parallel_problems(m: ModelConfig, ranks_by_role: Mapping[str, int]) -> list[ConfigProblem]:
    """Every trained model's ranks (``ranks_by_role``) split into tensor-parallel groups, and
    its experts over expert-parallel groups of them."""
    problems: list[ConfigProblem] = []
    tp, ep = m.tensor_model_parallel_size, m.expert_model_parallel_size
    pp = m.pipeline_model_parallel_size
    if min(tp, ep, pp) < 1:
        return problems
    for role, ranks in ranks_by_role.items():
        split = parallel_split_problem(tp, ranks, pp)
        if split:
            problems.append(
                problem(
                    ModelConfig,
                    "model",
                    "tensor_model_parallel_size",
                    f"the {role}'s ranks: {split}",
                    f"make --{role}-num-nodes x --{role}-num-gpus-per-node a multiple of it",
                )
            )
            continue
        experts = expert_split_problem(ep, tp, ranks)
        if experts:
            problems.append(
                problem(
                    ModelConfig,
                    "model",
                    "expert_model_parallel_size",
                    f"the {role}'s ranks: {experts}",
                    f"make --{role}-num-nodes x --{role}-num-gpus-per-node a multiple of "
                    "--expert-model-parallel-size x --tensor-model-parallel-size",
                )
            )
    return problems


def engine_and_cluster_problems(r: RolloutConfig, k: ClusterConfig) -> list[ConfigProblem]:
    """The engine's name and options, and the placement counts (which depend on whether the
    engine runs servers)."""
    problems: list[ConfigProblem] = []

    def add(section: type[Any], prefix: str, name: str, message: str, hint: str = "") -> None:
        problems.append(problem(section, prefix, name, message, hint))

    runs_servers = False
    engine, kind = options_problem(ENGINE, r)
    if engine is not None:
        problems.append(engine)
    else:
        runs_servers = kind.runs_servers(kind.options(r.engine_options))

    for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine"):
        if getattr(k, name) < 1:
            add(ClusterConfig, "cluster", name, f"must be >= 1, got {getattr(k, name)}")
    for name in ("critic_num_nodes", "critic_num_gpus_per_node", "rollout_num_gpus"):
        value = getattr(k, name)
        if value is not None and value < 1:
            add(ClusterConfig, "cluster", name, f"must be >= 1, got {value}")
    if problems_under(problems, "cluster."):
        return problems
    if not runs_servers:
        why = f"the {r.engine!r} engine starts no servers (with these settings)"
        if k.rollout_num_gpus is not None:
            add(ClusterConfig, "cluster", "rollout_num_gpus", why, "drop --rollout-num-gpus")
        if k.colocate:
            add(ClusterConfig, "cluster", "colocate", why, "drop --colocate")
        return problems
    if k.rollout_gpus % k.rollout_num_gpus_per_engine:
        add(
            ClusterConfig,
            "cluster",
            "rollout_num_gpus",
            f"{k.rollout_gpus} rollout GPUs do not split into engines of "
            f"--rollout-num-gpus-per-engine {k.rollout_num_gpus_per_engine}",
            "make it a multiple",
        )
    if k.colocate and r.max_staleness > 0:
        add(
            ClusterConfig,
            "cluster",
            "colocate",
            f"puts the rollout servers on the actor's GPUs, so they cannot generate while it "
            f"trains, which --max-staleness {r.max_staleness} asks for",
            "give the servers their own GPUs (drop --colocate, set --rollout-num-gpus), or use "
            "--max-staleness 0",
        )
    if k.colocate and k.rollout_gpus > k.actor_ranks:
        add(
            ClusterConfig,
            "cluster",
            "rollout_num_gpus",
            f"--colocate puts the rollout servers on the actor's {k.actor_ranks} GPUs, "
            f"but {k.rollout_gpus} are asked for",
            "lower --rollout-num-gpus or drop --colocate",
        )
    return problems
