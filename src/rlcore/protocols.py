"""The contracts between the core and the things it drives. Everything the loop needs is here.

Implementations satisfy these structurally (no base classes); concrete classes are ``@final`` and
share code through functions. No method returns ``Optional`` and none takes a mode flag: what a
stack can do is what its type says. An :class:`EvalStack` has no optimizer *attribute at all*, so
an eval-only run that touches an optimizer does not type-check.

Weights travel from a :class:`WeightSource` (a stack) to a :class:`RolloutEngine` without passing
through the caller: the engine opens an update and hands out :class:`WeightSink` s, each saying
where it may run (:data:`~rlcore.weights.SinkPlacement`); the source runs each sink where its
weights live. The loop's whole part in it::

    with engine.receive_weights(version) as sinks:
        actor.send_weights(sinks)

A stack whose weights are in the calling process sends with
``rlcore.weights.deliver(its_named_tensors, sinks)``; a group of Ray ranks ships the sinks to the
ranks that hold the gathered weights (and brings the weights to the caller only for an
:class:`~rlcore.weights.InProcess` sink, such as the embedded engine's). The weight contract
itself (:class:`WeightSource`, :class:`WeightSink`) lives in :mod:`rlcore.weights` and is
re-exported here.

The rollout seam's values (:class:`RolloutContext`, :class:`RolloutOutput`,
:class:`DynamicSampling`, :data:`Group`) are here too, beside :class:`RolloutFn`: they are its
contract, and everything that runs or writes a rollout function shares them.

This module imports only the standard library, attrs and rlcore's other shared types
(``samples``, ``specs``, ``weights``). Tensors appear only in weight transfer and only for the
type checker: ``import rlcore`` does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Final, Literal, Protocol, runtime_checkable

import attrs

from rlcore.errors import RolloutError
from rlcore.samples import Generation, Prompt, Sample, SamplingParams, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
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


@runtime_checkable
class Optimizer(Protocol):
    """The part of an optimizer the core relies on: its state can be saved."""

    def state_dict(self) -> Mapping[str, object]: ...


@runtime_checkable
class Scheduler(Protocol):
    """The part of an LR scheduler the core relies on: its state can be saved."""

    def state_dict(self) -> Mapping[str, object]: ...


StackKind = Literal["eval", "train"]
"""What a stack is for: ``"eval"`` (a model only) or ``"train"`` (a model that learns)."""


@runtime_checkable
class ModelStack(WeightSource, Protocol):
    """What every stack has: a model that can score token sequences, load a checkpoint and send
    its weights to an engine. Code that needs only that (pushing weights, scoring samples) asks
    for a ``ModelStack``; a run holds each stack as exactly one of its two kinds,
    :class:`EvalStack` or :class:`TrainingStack`."""

    @property
    def kind(self) -> StackKind:
        """``"eval"`` or ``"train"``: which of the two kinds this stack is."""
        ...

    @property
    def spec(self) -> ModelSpec:
        """What this stack was built from (its role says whether ``forward`` gives log-probs or
        values)."""
        ...

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        """Per response token of each sample: the token's log-probability under a policy model
        (``actor``, ``reference``), or the value estimate at that token for a ``critic``.
        Runs without gradients."""
        ...

    def load(self, path: Path) -> int:
        """Load from a checkpoint folder written by a training stack's ``save``: the model's
        weights, and for a training stack also its optimizer and scheduler state (an eval stack
        ignores them). Returns the rollout id recorded there. Raises
        :class:`~rlcore.errors.CheckpointError` naming the path when it is missing or corrupt."""
        ...


@runtime_checkable
class EvalStack(ModelStack, Protocol):
    """A model only: no optimizer, no scheduler, no gradient buffers, no ``train_step``.

    Its ``kind`` is ``"eval"``, a training stack's is ``"train"``: the two are siblings, not
    parent and child, so a :class:`TrainingStack` is *not* an ``EvalStack`` and a backend whose
    ``build_eval_stack`` returns one does not type-check. (The loop also refuses it at run time,
    for code that is not type-checked.) Declare it in the class body: ``kind: Final = "eval"``
    (in an attrs class, ``kind: ClassVar[Literal["eval"]] = "eval"``, which is not a field).
    """

    @property
    def kind(self) -> Literal["eval"]: ...


@runtime_checkable
class TrainingStack(ModelStack, Protocol):
    """A model that learns: a :class:`ModelStack` with an optimizer, a scheduler, a training step
    and a save. Its ``kind`` is ``"train"`` (``kind: Final = "train"`` in the class body)."""

    @property
    def kind(self) -> Literal["train"]: ...

    @property
    def optimizer(self) -> Optimizer: ...

    @property
    def scheduler(self) -> Scheduler: ...

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        """Forward/backward over ``batch`` with this stack's loss, then step optimizer and schedule
        (``spec.steps_per_rollout`` times, one global batch of ``spec.global_batch_size`` samples
        each, in order). Returns the last step's metrics, those of its whole global batch.

        Every rank of a multi-rank stack is called with the *whole* batch and trains on its own
        data-parallel share of each global batch; each micro-batch's loss is divided by the
        normaliser of the whole global batch, so the update and the metrics do not depend on how
        the batch is cut. :mod:`rlcore.algorithms.train_step` does that arithmetic for every
        backend (:func:`~rlcore.algorithms.train_step.optimizer_step_batches`,
        :func:`~rlcore.algorithms.train_step.local_micro_batches`,
        :class:`~rlcore.algorithms.train_step.StepMetrics`)."""
        ...

    def save(self, path: Path, rollout_id: int) -> None:
        """Write model, optimizer and scheduler state and ``rollout_id`` into the folder ``path``.
        The caller has created ``path`` (an empty folder inside a temporary checkpoint folder,
        which it later moves into place atomically)."""
        ...


@runtime_checkable
class HFExporter(Protocol):
    """A training stack that can also write its model as a Hugging Face folder, for
    ``--save-hf`` (an optional capability: a run asking for it refuses a stack without it before
    training starts)."""

    def save_hf(self, folder: Path) -> None:
        """Write the model's weights (safetensors) and ``config.json`` into the folder ``folder``,
        in the dtype the model trains in, so that
        ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it. The caller has
        created ``folder`` (empty, inside a temporary folder it later moves into place) and adds
        the tokenizer's files itself."""
        ...


class TeacherServer(Protocol):
    """A distillation teacher served outside the run (``--opd-type sglang``): the loop asks it
    for the teacher's log-probs of every rollout as the rollout is made
    (:func:`rlcore.loop.rollouts.rollout_source`). It is not a stack: nothing of it can be trained,
    loaded or synced."""

    def score(self, samples: Sequence[Sample], temperature: float) -> list[tuple[float, ...]]:
        """Per response token of each sample: its log-probability under the teacher tempered
        at ``temperature`` (the rollout's: ``softmax(logits / T)``, as the student's log-probs
        are; :func:`rlcore.logits.tempered`), given the sample's prompt and the response tokens
        before it. Raises :class:`~rlcore.errors.RolloutError` naming the server when it cannot
        answer."""
        ...


class Backend(Protocol):
    """Builds stacks. The planner decides what to build; a backend only knows how.

    Contract: ``build_eval_stack`` returns an :class:`EvalStack` (a model only: no optimizer
    state, no gradient buffers, ``kind == "eval"``), never a training stack; the loop refuses one
    that exposes an optimizer, a scheduler or a ``train_step`` with a
    :class:`~rlcore.errors.BackendContractError` naming the backend.
    Both methods raise :class:`~rlcore.errors.RLCoreError` subclasses, never backend internals.
    """

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack: ...

    def build_eval_stack(self, spec: EvalSpec) -> EvalStack: ...


class RolloutEngine(Protocol):
    """Generates responses from the current policy weights.

    ``generate`` returns exactly one :class:`Generation` per prompt, in order (repeat a prompt to
    sample it several times). ``receive_weights(version)`` opens a weight update: it yields the
    sinks that must each receive the full new weights (see :class:`WeightSink`), and when the
    block ends without an error the engine serves them as ``version`` (later generations carry
    it). When the block raises, the engine does not record the version. The caller never has to
    hold the weights: a :class:`WeightSource` sends them. Failures raise
    :class:`~rlcore.errors.RolloutError`; nothing waits forever.
    """

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]: ...

    def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]: ...

    @property
    def weight_version(self) -> int: ...

    def close(self) -> None:
        """Release servers, processes and memory. Safe to call twice."""
        ...


@runtime_checkable
class PartialRolloutEngine(RolloutEngine, Protocol):
    """A rollout engine that takes new weights while ``generate`` runs in another thread: the
    partial rollouts of an off-policy schedule (``--partial-rollout``).

    ``receive_weights_interrupting(version)`` interrupts every in-flight request at a token
    boundary and yields the sinks, like ``receive_weights``; once they hold the new weights, the
    requests continue from the tokens already made, sampled from ``version`` (the context is
    recomputed with the new weights). A generation's ``first_weight_version`` and
    ``weight_version`` say which versions made its first and last token, and each token's log-prob
    is the one the version that sampled it gave. ``interrupts_generation`` is ``True`` when it
    does so (a wrapper answers for the engine it wraps); ``receive_weights`` alone, from another
    thread, waits for in-flight requests to finish instead.
    """

    @property
    def interrupts_generation(self) -> bool: ...

    def receive_weights_interrupting(
        self, version: int
    ) -> AbstractContextManager[Sequence[WeightSink]]: ...


@runtime_checkable
class RestartingEngine(RolloutEngine, Protocol):
    """A rollout engine that restarts a server that died or stopped answering and resubmits the
    requests it held (``--use-fault-tolerance``). A restarted server starts from the model
    folder, so the engine must get the weights it serves again: ``restore_weights_from(source)``
    names the :class:`WeightSource` that holds them (the loop passes the policy each time it
    pushes its weights, which in the synchronous schedule stay the served ones while the engine
    generates), or ``None`` when no source holds them (a restart then fails, naming why).
    """

    def restore_weights_from(self, source: WeightSource | None) -> None: ...


class RewardFn(Protocol):
    """Scores one generation for one prompt. ``prompt.label`` holds the reference answer.

    The parameters are positional-only: any callable taking a prompt and a generation fits,
    whatever it names them (``def reward(p, g)``)."""

    def __call__(self, prompt: Prompt, generation: Generation, /) -> float: ...


class PromptSource(Protocol):
    """Where a rollout draws its prompts from (the run's :class:`~rlcore.data.PromptSampler`)."""

    def take(self, n: int) -> tuple[Prompt, ...]:
        """The next ``n`` prompts of the run's stream. Its position is what checkpoints record,
        so resuming continues the stream exactly."""
        ...


class GroupFilter(Protocol):
    """Dynamic sampling's judge (``--dynamic-sampling-filter-path``): whether a prompt's group of
    scored samples is worth training on (DAPO drops groups whose rewards all equal, as their
    group-normalised advantages are all 0)."""

    def __call__(self, group: Sequence[Sample], /) -> bool: ...


class RolloutFn(Protocol):
    """The rollout seam (slime's rollout function, ``--rollout-function-path``): everything that
    turns prompts into the groups one rollout trains on.

    It receives a :class:`RolloutContext` (rollout id, prompt source, engine,
    reward function, sampling parameters, the groups wanted, dynamic-sampling settings and the
    groups carried over from the previous rollout) and returns a
    :class:`RolloutOutput`: exactly ``ctx.batch_size`` groups of
    ``ctx.n_samples_per_prompt`` scored samples each, metrics, and any surplus groups to carry
    to the next rollout. The default is :func:`rlcore.rollout.default_rollout` (generate, reward,
    filter, top up). The loop checks the counts and raises
    :class:`~rlcore.errors.RolloutError` naming the function when they are wrong.
    """

    def __call__(self, ctx: RolloutContext, /) -> RolloutOutput: ...


class MetricsSink(Protocol):
    """Receives namespaced metrics (``rollout/...``, ``train/...``, ``eval/...``) at a rollout
    id."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class HostedProcess(Protocol):
    """A process a :class:`ProcessHost` started (a rollout server), seen from the caller."""

    @property
    def pid(self) -> int:
        """Its process id on its host."""
        ...

    def poll(self) -> int | None:
        """Its exit code once it has exited, else ``None`` (as ``subprocess.Popen.poll``)."""
        ...

    def stop(self, timeout_s: float) -> None:
        """End it and every process it started (SIGTERM, then SIGKILL after ``timeout_s``).
        Safe to call twice."""
        ...

    def log_tail(self, lines: int) -> list[str]:
        """The last ``lines`` lines of its output (stdout and stderr)."""
        ...


class ProcessHost(Protocol):
    """A place a cluster reserved for one rollout server: a machine and its accelerators.

    An engine that runs servers starts one per host it is given (``rlcore.engines.EngineSetup``);
    the run's placement decides where hosts are and which GPUs they hold, the engine decides what
    to run there. :class:`rlcore.engines.hosts.LocalProcessHost` is this machine.
    """

    @property
    def address(self) -> str:
        """The machine's IP address; a server started here listens on it."""
        ...

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        """The CUDA ordinals (as processes on the host number them) reserved for the server, in
        order; empty on a host without GPUs."""
        ...

    @property
    def cpus(self) -> int:
        """CPU threads the server may use without oversubscribing its machine."""
        ...

    def free_port(self) -> int:
        """A TCP port free on the host a moment ago."""
        ...

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> HostedProcess:
        """Start ``argv`` in the host's environment updated with ``env``, output to ``log_path``
        (a path on the host), in a process group of its own. Does not wait for it to be ready.
        Raises :class:`~rlcore.errors.RolloutError` when the program cannot be started."""
        ...


# --------------------------------------------------------------------------------------------
# Tokenizers

Message = Mapping[str, str]
"""One chat message: ``{"role": "user", "content": "..."}``."""


@runtime_checkable
class Tokenizer(Protocol):
    """What rlcore needs from a tokenizer."""

    @property
    def pad_token_id(self) -> int:
        """The id used to left-pad prompts in a batch."""
        ...

    @property
    def eos_token_id(self) -> int:
        """The end-of-sequence id: the rollout engine's default stop token."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` including the tokenizer's special prefix (``<bos>``), if any."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` with special tokens (pad, bos, eos) left out."""
        ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer with a chat template (needed for ``apply_chat_template=True``)."""

    def render_chat(self, messages: Sequence[Message]) -> str:
        """The conversation as prompt text, ending where the assistant's reply begins
        (``add_generation_prompt``). The text already holds any special prefix the template
        writes."""
        ...

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of rendered chat text, adding no special tokens (the template wrote them)."""
        ...


# --------------------------------------------------------------------------------------------
# The rollout seam's values: what a rollout function is given and what it returns

Group = tuple[Sample, ...]
"""One prompt's scored samples (``n_samples_per_prompt`` of them)."""

DEFAULT_MAX_ROUNDS: Final = 8
"""Generation rounds one rollout may take (``--dynamic-sampling-max-rounds``)."""


@attrs.frozen
class DynamicSampling:
    """Dynamic sampling's settings as a rollout function sees them: prompts per round, the round
    limit, whether surplus groups are kept, and the loaded group filter (``None``: keep all)."""

    over_sampling_batch_size: int
    max_rounds: int = DEFAULT_MAX_ROUNDS
    keep_surplus: bool = False
    group_filter: GroupFilter | None = None


@attrs.frozen
class RolloutContext:
    """Everything a rollout function is given for rollout ``rollout_id``.

    It should return ``batch_size`` groups of ``n_samples_per_prompt`` samples. ``prompts`` hands
    out the run's prompt stream (what it takes is consumed: checkpoints record the position);
    ``carried`` are the surplus groups the previous rollout returned (already scored and
    filtered; their generations carry the older weight version they were sampled with).
    """

    rollout_id: int
    """Counted from 0, as slime's ``rollout_id``: the run's files, metrics steps and logs call
    this rollout ``rollout_id + 1``."""
    prompts: PromptSource
    engine: RolloutEngine
    reward_fn: RewardFn
    params: SamplingParams
    n_samples_per_prompt: int
    batch_size: int
    sampling: DynamicSampling
    carried: tuple[Group, ...] = ()


@attrs.frozen
class RolloutOutput:
    """A rollout function's result: the groups to train on, ``rollout/...`` metrics to log, and
    surplus groups to hand to the next rollout as ``carried`` (empty to drop them)."""

    groups: tuple[Group, ...]
    metrics: Mapping[str, float] = attrs.field(factory=dict)
    surplus: tuple[Group, ...] = ()


def takes_weights_midway(engine: RolloutEngine) -> bool:
    """Whether ``engine`` takes new weights mid-generation
    (:class:`~rlcore.protocols.PartialRolloutEngine`)."""
    return isinstance(engine, PartialRolloutEngine) and engine.interrupts_generation


def receive_weights_midway(
    engine: RolloutEngine, version: int
) -> AbstractContextManager[Sequence[WeightSink]]:
    """``engine.receive_weights_interrupting(version)``; a
    :class:`~rlcore.errors.RolloutError` naming the engine when it cannot take weights
    mid-generation."""
    if not isinstance(engine, PartialRolloutEngine) or not engine.interrupts_generation:
        raise RolloutError(
            f"rollout engine {type(engine).__name__} cannot take new weights mid-generation "
            "(--partial-rollout); use the embedded or SGLang engine, or drop --partial-rollout"
        )
    return engine.receive_weights_interrupting(version)


def keep_weight_source(engine: RolloutEngine, source: WeightSource | None) -> None:
    """Tell an engine that restarts servers (:class:`RestartingEngine`) where the weights it now
    serves are; nothing for other engines."""
    if isinstance(engine, RestartingEngine):
        engine.restore_weights_from(source)
