"""A rollout engine for any causal language model written in plain PyTorch.

A backend whose model is a Hugging Face causal LM uses
:class:`~rlcore.engines.embedded.EmbeddedEngine` (a KV cache, a decode kernel). Any other
``torch.nn.Module`` that maps token ids to next-token logits, ``model(tokens: LongTensor[B, T]) ->
FloatTensor[B, T, V]`` (the logits at position ``t`` predict token ``t + 1``), gets
:class:`TorchEngine`: it samples from that model in this process, and takes the training stack's
weights by name (``model.state_dict()`` keys) after every step.

There is no KV cache: every decode step runs the model over the whole sequence so far, which costs
``O(length^2)`` but asks nothing of the model beyond its forward. Prompts are batched by length,
so no row is ever padded and the model needs no attention mask: a row's tokens are exactly the
prompt and what was sampled after it, as the trainer scores them.

This module imports torch; ``import rlcore`` does not import it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import final

import torch

from rlcore.engines.sampling import check_params, copy_weights, sample_next_tokens
from rlcore.errors import RolloutError
from rlcore.protocols.tokenizer import Tokenizer
from rlcore.samples import Generation, Prompt, SamplingParams
from rlcore.weights import InProcess, NamedTensors

__all__ = ["TorchEngine", "TorchWeightSink"]


@final
class TorchEngine:
    """A :class:`~rlcore.protocols.engine.RolloutEngine` over an in-process ``torch.nn.Module`` that
    returns next-token logits (module docstring).

    ``model`` is used, not copied: weight updates write into it, so give the engine its own
    instance (the loop sends it the actor's weights before the first rollout). Sampling draws
    from one ``torch.Generator`` seeded with ``seed``: an engine built the same way produces the
    same generations for the same calls. Log-probs are those of the sampled tokens under the
    tempered distribution that sampled them (:func:`rlcore.logits.tempered`), whatever top-k or
    top-p cut, as the trainer computes them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        *,
        seed: int = 0,
        weight_version: int = 0,
    ) -> None:
        self._model: torch.nn.Module | None = model.eval()
        self._tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed)
        self._version = weight_version

    @property
    def model(self) -> torch.nn.Module:
        """The model sampled from (raises :class:`~rlcore.errors.RolloutError` after
        :meth:`close`)."""
        if self._model is None:
            raise RolloutError("TorchEngine: the engine is closed; build a new one")
        return self._model

    @property
    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        """Drop the model. Safe to call twice."""
        self._model = None

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        """One response per prompt, in order. A response ends at the first stop token
        (``params.stop_token_ids``, default the tokenizer's eos), which it includes, or after
        ``max_new_tokens``."""
        model = self.model
        check_params(params, "TorchEngine")
        stops = (
            () if params.ignore_eos else params.stop_token_ids or (self._tokenizer.eos_token_id,)
        )
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            if not prompt.token_ids:
                raise RolloutError(f"TorchEngine: prompt {prompt.index} has no tokens")
            by_length.setdefault(len(prompt.token_ids), []).append(i)
        out: list[Generation | None] = [None] * len(prompts)
        try:
            with torch.inference_mode():
                for length in sorted(by_length):
                    rows = by_length[length]
                    tokens = torch.tensor(
                        [prompts[i].token_ids for i in rows], dtype=torch.long, device=self._device
                    )
                    for i, generation in zip(
                        rows, self._decode(model, tokens, params, stops), strict=True
                    ):
                        out[i] = generation
        except (RuntimeError, ValueError, IndexError) as exc:  # torch's errors
            raise RolloutError(
                f"TorchEngine: generation failed for {len(prompts)} prompts: "
                f"{type(exc).__name__}: {exc}; does the model map token ids [B, T] to logits "
                "[B, T, V], and were the prompts encoded with its tokenizer?"
            ) from exc
        return [g for g in out if g is not None]

    def _decode(
        self,
        model: torch.nn.Module,
        tokens: torch.Tensor,
        params: SamplingParams,
        stops: Sequence[int],
    ) -> list[Generation]:
        """Sample after ``tokens: Tensor[B, T]`` (prompts of one length) until every row stopped
        or ``max_new_tokens`` were made; ended rows leave the batch."""
        batch = tokens.shape[0]
        sampled: list[list[int]] = [[] for _ in range(batch)]
        log_probs: list[list[float]] = [[] for _ in range(batch)]
        stopped = [False] * batch
        live = list(range(batch))
        stop_ids = set(stops)
        for _ in range(params.max_new_tokens):
            logits = model(tokens)
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
                raise RolloutError(
                    f"TorchEngine: the model returned {type(logits).__name__} "
                    f"{getattr(logits, 'shape', '')}; it must return logits Tensor[B, T, V]"
                )
            last = logits[:, -1, :].float()
            token, log_prob = sample_next_tokens(last, params, self._generator)
            keep = []
            for position, (row, t, lp) in enumerate(
                zip(live, token.tolist(), log_prob.tolist(), strict=True)
            ):
                sampled[row].append(t)
                log_probs[row].append(lp)
                if t in stop_ids:
                    stopped[row] = True
                else:
                    keep.append(position)
            if not keep:
                break
            index = torch.tensor(keep, dtype=torch.long, device=self._device)
            live = [live[p] for p in keep]
            tokens = torch.cat([tokens[index], token[index].unsqueeze(-1)], dim=-1)
        return [
            Generation(
                token_ids=tuple(sampled[row]),
                log_probs=tuple(log_probs[row]),
                text=self._tokenizer.decode(sampled[row]),
                finish_reason="stop" if stopped[row] else "length",
                weight_version=self._version,
            )
            for row in range(batch)
        ]

    @contextmanager
    def receive_weights(self, version: int) -> Iterator[list[TorchWeightSink]]:
        """One :class:`TorchWeightSink` (in this process: the model lives here); ``version`` is
        recorded when the block completes."""
        yield [TorchWeightSink(self, version)]
        self._version = version


@final
class TorchWeightSink:
    """Copies named tensors (``model.state_dict()`` keys) into a :class:`TorchEngine`'s model, in
    place, after checking every name and shape (:func:`~rlcore.engines.sampling.copy_weights`).
    It runs in the engine's process (:class:`~rlcore.weights.InProcess`)."""

    def __init__(self, engine: TorchEngine, version: int) -> None:
        self._engine = engine
        self._version = version

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, weights: NamedTensors) -> None:
        copy_weights(
            self._engine.model.state_dict(keep_vars=True),
            weights,
            what=f"TorchEngine weight update (version {self._version})",
        )
