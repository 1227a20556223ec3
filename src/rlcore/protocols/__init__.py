"""The contracts between the core and the things it drives. Everything the loop needs is here.

Implementations satisfy these structurally (no base classes); concrete classes are ``@final`` and
share code through functions. No method returns ``Optional`` and none takes a mode flag: what a
stack can do is what its type says. An :class:`~rlcore.protocols.stacks.EvalStack` has no
optimizer *attribute at all*, so an eval-only run that touches an optimizer does not type-check.

One module per party to a contract:

- :mod:`~rlcore.protocols.stacks`: what a backend builds (the model stacks, eval and training,
  the optional ``--save-hf`` export) and the backend itself;
- :mod:`~rlcore.protocols.engine`: the rollout engine, its optional capabilities (new weights
  mid-generation, restarted servers) and a distillation teacher;
- :mod:`~rlcore.protocols.hosts`: where an engine runs its servers;
- :mod:`~rlcore.protocols.rollout`: the rollout seam, the rollout function and its values (the
  context it is given, the output it returns, dynamic sampling, the reward function);
- :mod:`~rlcore.protocols.tokenizer`: what rlcore needs from a tokenizer;
- :mod:`~rlcore.protocols.metrics`: where a run's metrics go.

Weights travel from a :class:`~rlcore.weights.WeightSource` (a stack) to a
:class:`~rlcore.protocols.engine.RolloutEngine` without passing through the caller: the engine
opens an update and hands out :class:`~rlcore.weights.WeightSink` s, each saying where it may run
(:data:`~rlcore.weights.SinkPlacement`); the source runs each sink where its weights live. The
loop's whole part in it::

    with engine.receive_weights(version) as sinks:
        actor.send_weights(sinks)

A stack whose weights are in the calling process sends with
``rlcore.weights.deliver(its_named_tensors, sinks)``; a group of Ray ranks ships the sinks to the
ranks that hold the gathered weights (and brings the weights to the caller only for an
:class:`~rlcore.weights.InProcess` sink, such as the embedded engine's). The weight contract
itself (``WeightSource``, ``WeightSink``, ``NamedTensors``) lives in :mod:`rlcore.weights`.

Every name of the modules above, and the weight contract, is re-exported here for code that
imports it from ``rlcore.protocols``. This room imports only the standard library, attrs and
rlcore's other shared types (``samples``, ``specs``, ``weights``). Tensors appear only in weight
transfer and only for the type checker: ``import rlcore`` does not import torch.
"""

from __future__ import annotations

from rlcore.protocols.engine import (
    PartialRolloutEngine,
    RestartingEngine,
    RolloutEngine,
    TeacherServer,
    keep_weight_source,
    receive_weights_midway,
    takes_weights_midway,
)
from rlcore.protocols.hosts import HostedProcess, ProcessHost
from rlcore.protocols.metrics import MetricsSink
from rlcore.protocols.rollout import (
    DEFAULT_MAX_ROUNDS,
    DynamicSampling,
    Group,
    GroupFilter,
    PromptSource,
    RewardFn,
    RolloutContext,
    RolloutFn,
    RolloutOutput,
)
from rlcore.protocols.stacks import (
    Backend,
    EvalStack,
    HFExporter,
    ModelStack,
    Optimizer,
    Scheduler,
    StackKind,
    TrainingStack,
)
from rlcore.protocols.tokenizer import ChatTokenizer, Message, Tokenizer
from rlcore.weights import NamedTensors, WeightSink, WeightSource

__all__ = [
    "DEFAULT_MAX_ROUNDS",
    "Backend",
    "ChatTokenizer",
    "DynamicSampling",
    "EvalStack",
    "Group",
    "GroupFilter",
    "HFExporter",
    "HostedProcess",
    "Message",
    "MetricsSink",
    "ModelStack",
    "NamedTensors",
    "Optimizer",
    "PartialRolloutEngine",
    "ProcessHost",
    "PromptSource",
    "RestartingEngine",
    "RewardFn",
    "RolloutContext",
    "RolloutEngine",
    "RolloutFn",
    "RolloutOutput",
    "Scheduler",
    "StackKind",
    "TeacherServer",
    "Tokenizer",
    "TrainingStack",
    "WeightSink",
    "WeightSource",
    "keep_weight_source",
    "receive_weights_midway",
    "takes_weights_midway",
]
