"""For backend authors: what a backend implements, and what it may reuse, in one place.

``import rlcore`` is for users who run training; a backend (the Megatron one, a second one, your
own) is written against this module. What you implement:

- a :class:`Backend` that builds an :class:`EvalStack` (a model: ``forward``, ``load``,
  ``send_weights``; no optimizer) and a :class:`TrainingStack` (those plus ``optimizer``,
  ``scheduler``, ``train_step``, ``save``) from a :class:`TrainSpec` or an :class:`EvalSpec`;
  optionally :class:`HFExporter` for ``--save-hf``;
- for the launcher (``--train-backend NAME``), a :class:`BackendKind` in a light module, with its
  :class:`RankRuntime` (one rank's process group and parallel state, then the rank's backend),
  its checks before start and its options, registered in :data:`KNOWN_BACKENDS`.

What you may reuse, so that no backend writes it twice: the weight contract (:class:`WeightSink`,
:func:`deliver`), the one place the sampling temperature meets the logits (:func:`tempered`),
and (with torch) the batch tensors and per-token read-outs (:func:`tensorize`,
:func:`token_log_probs`, :func:`entropy_from_logits`, :func:`gather_response`, :func:`unpad`),
the losses (:func:`actor_loss`, :func:`critic_loss`, :func:`micro_batch_loss`), scoring samples
(:func:`score_samples`, by sample count or token budget, with the positions it ran:
:class:`ForwardRows`), what every train step shares
(:func:`optimizer_step_batches`, :func:`step_micro_batches` by sample count or token budget,
:func:`local_micro_batches`, :class:`StepMetrics`; a forward-only pass's micro-batches,
:func:`forward_groups` and :func:`in_input_order`), sending an export that is a collective
(:func:`send_exported`) and the process group of a rank (:func:`init_process_group`,
:func:`all_reduce_floats`). The torch names are imported on first use. A backend proves itself
against the conformance suite (``tests/conformance``: one line in ``CANDIDATES``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlcore.backends import KNOWN_BACKENDS, BackendKind, RankRuntime, load_backend_kind
from rlcore.errors import BackendContractError, BackendUnavailableError, CheckpointError
from rlcore.logits import logprob_temperature, tempered
from rlcore.protocols.stacks import (
    Backend,
    EvalStack,
    HFExporter,
    ModelStack,
    Optimizer,
    Scheduler,
    TrainingStack,
)
from rlcore.samples import ForwardRows, Sample, TrainBatch, TrainMetrics
from rlcore.specs import (
    EvalSpec,
    ISCorrection,
    LoadSpec,
    LossSpec,
    LRSchedule,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    TrainSpec,
)
from rlcore.weights import (
    AnyProcess,
    InProcess,
    NamedTensors,
    OnHost,
    WeightSink,
    WeightSource,
    deliver,
    send_exported,
)

if TYPE_CHECKING:
    from rlcore.algorithms.batching import (
        TensorBatch,
        entropy_from_logits,
        gather_response,
        tensorize,
        tensorize_samples,
        token_log_probs,
        unpad,
    )
    from rlcore.algorithms.distributed import all_reduce_floats, init_process_group
    from rlcore.algorithms.losses import LossOut, actor_loss, critic_loss
    from rlcore.algorithms.token_budget import forward_groups, in_input_order
    from rlcore.algorithms.train_step import (
        StepMetrics,
        local_micro_batches,
        micro_batch_loss,
        optimizer_step_batches,
        score_samples,
        step_micro_batches,
    )

__all__ = [
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
]

_WITH_TORCH = {
    "TensorBatch": "batching",
    "entropy_from_logits": "batching",
    "gather_response": "batching",
    "tensorize": "batching",
    "tensorize_samples": "batching",
    "token_log_probs": "batching",
    "unpad": "batching",
    "LossOut": "losses",
    "actor_loss": "losses",
    "critic_loss": "losses",
    "StepMetrics": "train_step",
    "local_micro_batches": "train_step",
    "micro_batch_loss": "train_step",
    "optimizer_step_batches": "train_step",
    "step_micro_batches": "train_step",
    "forward_groups": "token_budget",
    "in_input_order": "token_budget",
    "score_samples": "train_step",
    "all_reduce_floats": "distributed",
    "init_process_group": "distributed",
}
"""The names that need torch: each imported from ``rlcore.algorithms.<module>`` on first use."""


def __getattr__(name: str) -> Any:
    if name not in _WITH_TORCH:
        raise AttributeError(f"module 'rlcore.backend_api' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlcore.algorithms.{_WITH_TORCH[name]}"), name)
