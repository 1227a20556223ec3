"""The embedded rollout engine: a Hugging Face causal LM sampling on the local device.

The default engine (``--rollout-engine embedded``): no server, no extra process. It runs its own
decode loop (:mod:`rlcore.engines.decode_loop`) over ``model(input_ids, cache=...,
use_cache=True)`` rather than ``model.generate``: the loop does only what RL rollouts need
(temperature / top-k / top-p sampling, stop tokens, log-probs of the sampled tokens), and it
prefills each *distinct* prompt once and gathers its KV cache rows for the repeats, since an RL
batch samples every prompt ``n_samples_per_prompt`` times. Keys and values go into a cache
preallocated to prompt + ``max_new_tokens`` and written in place
(:class:`~rlcore.engines.kv_cache.DecodeCache`), and rows whose answer ended leave the batch (once
they are an eighth of it), so a token's cost grows only with the attention over a longer context,
and a batch whose answers mostly stop early stops paying for them. On the CPU in fp32 that
attention runs in rlcore's decode kernel (:mod:`rlcore.engines.decode_attention`), which reads the
cache at close to the machine's memory bandwidth where torch's SDPA reads it at about half. This
module puts the loop's segments (one per weight version) together into generations and takes
weight updates, from this thread or, mid-generation, from another.

``python -m benchmarks.rollout_scaling`` measures it beside ``model.generate`` with its logits and
beside itself with SDPA (issue #13's 17M Llama, 32 prompts x 4 samples, 17-token prompts,
temperature 1, 2 threads). Medians of 3 alternating rounds on the 2-core machine, tokens per
second at 32 / 128 / 512 new tokens: 2,331 / 2,394 / 1,814 (with SDPA 2,461 / 2,032 / 1,405;
``model.generate`` 1,922 / 1,746 / 562). So a token at 512 costs 1.28x what it costs at 32 (1.75x
with SDPA), and the engine has 3.2x ``model.generate``'s throughput there.

Log-probs are those of the sampled tokens under the tempered distribution that sampled them
(``softmax(logits / T)``, :func:`rlcore.logits.tempered`), whatever top-k or top-p cut from it:
the trainer computes the same, so the rollout-vs-trainer mismatch metric compares like with like.

This module imports torch and transformers; ``import rlcore`` does not import it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final, final

import attrs
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlcore.engines.decode_loop import Decoded, DecodeLoop
from rlcore.engines.sampling import check_params, copy_weights
from rlcore.errors import RolloutError
from rlcore.protocols.tokenizer import Tokenizer
from rlcore.samples import Generation, Prompt, SamplingParams
from rlcore.weights import InProcess, NamedTensors, Takes, deliver

__all__ = ["EmbeddedEngine", "EmbeddedWeightSink"]


@attrs.define
class _Response:
    """One prompt's response as it is put together from the segments between weight updates."""

    token_ids: list[int] = attrs.field(factory=list)
    log_probs: list[float] = attrs.field(factory=list)
    stopped: bool = False
    first_version: int | None = None
    last_version: int = 0


_EXPERT = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)


def _target(targets: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The tensor (or view) that the checkpoint tensor ``name`` is written into; ``None`` if the
    model has none.

    transformers 5 keeps a mixture-of-experts layer's experts fused, ``experts.gate_up_proj``
    ``[E, 2 * I, H]`` (gate rows first) and ``experts.down_proj`` ``[E, H, I]``, where published
    checkpoints (and rlcore's exports) have one ``gate_proj``/``up_proj``/``down_proj`` per expert.
    """
    if name in targets:
        return targets[name]
    match = _EXPERT.fullmatch(name)
    if match is None:
        return None
    prefix, expert, proj = match["experts"], int(match["index"]), match["proj"]
    fused = targets.get(f"{prefix}.{'down' if proj == 'down' else 'gate_up'}_proj")
    if fused is None or fused.dim() != 3 or not 0 <= expert < fused.shape[0]:
        return None
    if proj == "down":
        return fused[expert]
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj == "gate" else fused[expert, half:]


@final
class EmbeddedEngine:
    """A :class:`~rlcore.protocols.engine.RolloutEngine` over an in-process Hugging Face causal LM.

    ``EmbeddedEngine(model, tokenizer, seed=...)`` wraps a model already in memory (it is used,
    not copied: :meth:`update_weights` writes into it); :meth:`from_pretrained` loads one from a
    Hugging Face folder. Sampling draws from one ``torch.Generator`` seeded with ``seed``, so an
    engine built the same way produces the same generations for the same calls.

    ``decode_kernel``: decode attention with rlcore's CPU kernel
    (:mod:`rlcore.engines.decode_attention`). ``None`` (the default): where it applies (a float32
    model on the CPU with SDPA attention) and builds; ``False``: never (torch's SDPA); ``True``:
    always, and :meth:`generate` raises :class:`~rlcore.errors.RolloutError` saying why where it
    cannot. Using it switches the model to the ``rlcore_decode`` attention implementation, which
    is SDPA wherever the engine's decode cache is not involved.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Tokenizer,
        *,
        seed: int = 0,
        weight_version: int = 0,
        decode_kernel: bool | None = None,
    ) -> None:
        model.eval()  # type: ignore[no-untyped-call]  # transformers leaves PreTrainedModel.eval unannotated
        self._model: PreTrainedModel | None = model
        self._tokenizer = tokenizer
        self._version = weight_version
        # Decoding and weight updates take turns; a pending interrupting update stops decoding at
        # the next token boundary (partial rollouts).
        self._busy = threading.Lock()
        self._interrupt = threading.Event()  # set while an interrupting update waits or runs
        self._no_update = threading.Event()  # its complement, for a generation to wait on
        self._no_update.set()
        self._loop = DecodeLoop(
            model, tokenizer, seed=seed, decode_kernel=decode_kernel, interrupt=self._interrupt
        )

    @classmethod
    def from_pretrained(
        cls,
        folder: Path,
        tokenizer: Tokenizer,
        *,
        device: str | torch.device = "cpu",
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        decode_kernel: bool | None = None,
    ) -> EmbeddedEngine:
        """Load the causal LM in the Hugging Face folder ``folder`` onto ``device``
        (``decode_kernel``: as for the constructor).

        Raises :class:`~rlcore.errors.RolloutError` naming the folder when it cannot be loaded.
        """
        try:
            # A local folder only: never a model hub lookup (which waits on the network).
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise RolloutError(
                f"EmbeddedEngine: cannot load a causal LM from {folder} ({exc}); point at a "
                "Hugging Face folder with config.json and the weights"
            ) from exc
        # functools.wraps on PreTrainedModel.to hides its real signature from mypy:
        model.to(device)  # type: ignore[arg-type]  # see above
        return cls(model, tokenizer, seed=seed, decode_kernel=decode_kernel)

    @property
    def model(self) -> PreTrainedModel:
        """The wrapped model (raises :class:`~rlcore.errors.RolloutError` after :meth:`close`)."""
        if self._model is None:
            raise RolloutError("EmbeddedEngine: the engine is closed; build a new one")
        return self._model

    @property
    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        """Drop the model so its memory can be freed. Safe to call twice."""
        self._model = None

    # ----------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        """Sample one response per prompt, in order, in one batch with a KV cache.

        Prompts of different lengths are left-padded (with matching attention mask and position
        ids). A response ends at the first stop token (``params.stop_token_ids``, default the
        tokenizer's eos), which it includes (``finish_reason="stop"``), or after
        ``max_new_tokens`` (``"length"``; always, with ``params.ignore_eos``). Decoding stops as
        soon as every response has ended.
        """
        model = self.model
        check_params(params, "EmbeddedEngine")
        if not prompts:
            return []
        embedding = model.get_input_embeddings().weight
        assert isinstance(embedding, torch.Tensor)  # an embedding table: Tensor[vocab, hidden]
        vocab = embedding.shape[0]
        for prompt in prompts:
            if (
                not prompt.token_ids
                or not 0 <= min(prompt.token_ids) <= max(prompt.token_ids) < vocab
            ):
                raise RolloutError(
                    f"EmbeddedEngine: prompt {prompt.index} ({prompt.text[:40]!r}) has no "
                    f"tokens or a token id outside the model's vocabulary [0, {vocab}); was it "
                    "encoded with this model's tokenizer?"
                )
        stops = (
            () if params.ignore_eos else params.stop_token_ids or (self._tokenizer.eos_token_id,)
        )
        responses = [_Response() for _ in prompts]
        active = list(range(len(prompts)))
        budget = params.max_new_tokens
        while active:
            # One segment per weight version: new weights that arrive mid-generation stop it at a
            # token boundary; the unfinished rows go on from their tokens with the new weights.
            batch = [
                attrs.evolve(
                    prompts[i], token_ids=prompts[i].token_ids + tuple(responses[i].token_ids)
                )
                for i in active
            ]
            self._no_update.wait()  # an interrupted segment goes on only once the update is in
            with self._busy:
                version = self._version
                decoded = self._loop.decode(
                    model, batch, attrs.evolve(params, max_new_tokens=budget), stops
                )
            active = self._collect(decoded, active, responses, version)
            budget -= decoded.steps
        texts: dict[tuple[int, ...], str] = {}  # RL batches repeat responses; decode each once
        return [self._to_generation(r, texts) for r in responses]

    @staticmethod
    def _collect(
        decoded: Decoded, active: list[int], responses: list[_Response], version: int
    ) -> list[int]:
        """Append a segment's tokens to the responses of rows ``active``; the rows that go on."""
        steps = decoded.steps
        tokens = decoded.tokens[:, :steps].tolist()
        log_probs = decoded.log_probs[:, :steps].tolist()
        going_on = []
        for row, (i, length, stopped) in enumerate(
            zip(active, decoded.lengths.tolist(), decoded.stopped.tolist(), strict=True)
        ):
            response = responses[i]
            if length:
                response.token_ids += tokens[row][:length]
                response.log_probs += log_probs[row][:length]
                if response.first_version is None:
                    response.first_version = version
                response.last_version = version
            response.stopped = bool(stopped)
            if decoded.interrupted and not stopped and length == steps:
                going_on.append(i)
        return going_on

    def _to_generation(self, response: _Response, texts: dict[tuple[int, ...], str]) -> Generation:
        ids = tuple(response.token_ids)
        text = texts.get(ids)
        if text is None:
            text = texts[ids] = self._tokenizer.decode(ids)
        return Generation(
            token_ids=ids,
            log_probs=tuple(response.log_probs),
            text=text,
            finish_reason="stop" if response.stopped else "length",
            weight_version=response.last_version if ids else self._version,
            first_weight_version=(
                response.first_version if response.first_version is not None else self._version
            ),
        )

    # ----------------------------------------------------------------------------------------

    @contextmanager
    def receive_weights(self, version: int) -> Iterator[list[EmbeddedWeightSink]]:
        """One :class:`EmbeddedWeightSink` (in this process: the model lives here); ``version``
        is recorded when the block completes. Called while another thread generates, it waits
        for the generation to finish."""
        with self._busy:
            yield [EmbeddedWeightSink(self, version)]
            self._version = version

    @property
    def interrupts_generation(self) -> bool:
        """Always: :meth:`receive_weights_interrupting` stops a generation in another thread at
        its next token and lets it continue with the new weights."""
        return True

    @contextmanager
    def receive_weights_interrupting(self, version: int) -> Iterator[list[EmbeddedWeightSink]]:
        """As :meth:`receive_weights`, but a generation running in another thread is stopped at
        its next token boundary instead of waited for; once the weights are in, it recomputes
        its context with them and goes on (a partial rollout: see
        :class:`~rlcore.protocols.engine.PartialRolloutEngine`)."""
        self._no_update.clear()
        self._interrupt.set()
        try:
            with self._busy:
                yield [EmbeddedWeightSink(self, version)]
                self._version = version
        finally:
            self._interrupt.clear()
            self._no_update.set()

    def update_weights(self, weights: NamedTensors, version: int) -> None:
        """Copy Hugging Face-named tensors into the model and record ``version`` (the same as
        sending ``weights`` to :meth:`receive_weights`' sink)."""
        with self.receive_weights(version) as sinks:
            deliver(weights, sinks)

    def _copy_in(self, weights: NamedTensors, version: int) -> None:
        """Names are those of the model's published checkpoints
        (``model.layers.0.mlp.experts.3.gate_proj.weight`` for an expert that transformers holds
        inside one fused ``experts.gate_up_proj`` tensor); see
        :func:`~rlcore.engines.sampling.copy_weights`."""
        copy_weights(
            self.model.state_dict(keep_vars=True),
            weights,
            what=f"EmbeddedEngine.update_weights (version {version})",
            resolve=_target,
        )


@final
class EmbeddedWeightSink:
    """Copies Hugging Face-named tensors into an :class:`EmbeddedEngine`'s model, in place.

    Any subset of the model's weights may be given. Every name and shape is checked before
    anything is written, so a bad update leaves the model as it was: an unknown name or a shape
    mismatch raises :class:`~rlcore.errors.RolloutError` listing each offender. It runs in the
    engine's process (:class:`~rlcore.weights.InProcess`): a source whose weights are elsewhere
    brings them here, which is the one weight path that passes through the driver (Ray's rank
    groups hand over shared memory on the driver's machine, so that this copy is the only one:
    :mod:`rlcore.launch.ray.stacks`). It takes weights as row blocks (q, k and v as views of a
    fused QKV weight) and in any floating dtype (cast as copied: fp32 master weights for a bf16
    model), so that those too are copied once (:class:`~rlcore.weights.Takes`).
    """

    takes: Final = Takes(row_blocks=True, any_dtype=True)

    def __init__(self, engine: EmbeddedEngine, version: int) -> None:
        self._engine = engine
        self._version = version

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, weights: NamedTensors) -> None:
        self._engine._copy_in(weights, self._version)
