"""The embedded engine's decode loop: one batch of prompts sampled token by token with a KV cache.

:class:`DecodeLoop` runs ``model(input_ids, cache=..., use_cache=True)`` rather than
``model.generate``: it does only what RL rollouts need (temperature / top-k / top-p sampling, stop
tokens, log-probs of the sampled tokens), and it prefills each *distinct* prompt once and gathers
its KV cache rows for the repeats, since an RL batch samples every prompt ``n_samples_per_prompt``
times. Keys and values go into a cache preallocated to prompt + ``max_new_tokens`` and written in
place (:class:`~rlcore.engines.kv_cache.DecodeCache`), and rows whose answer ended leave the batch
(once they are an eighth of it). On the CPU in fp32 the attention of a decode step runs in rlcore's
kernel (:mod:`rlcore.engines.decode_attention`) where it applies. A pending weight update stops
the loop at the next token boundary (partial rollouts); the engine
(:class:`~rlcore.engines.embedded.EmbeddedEngine`) puts the segments between updates together.

This module imports torch and transformers; ``import rlcore`` does not import it.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from typing import final

import attrs
import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from rlcore.engines.decode_attention import ATTENTION, load_kernel
from rlcore.engines.kv_cache import DecodeCache
from rlcore.engines.sampling import sample_next_tokens
from rlcore.errors import RolloutError
from rlcore.protocols.tokenizer import Tokenizer
from rlcore.samples import Prompt, SamplingParams

__all__ = ["DecodeLoop", "Decoded"]

_DROP_FRACTION = 1 / 8
"""Ended rows leave the cache once they are this fraction of the rows in it. Dropping copies the
live rows' cache, about as much memory traffic as one step's attention; keeping an ended row costs
its share of every step. Dropping at 1/8 bounds the wasted share of a step to 12.5% and the number
of copies to about ``log(B) / log(8/7)``."""


@attrs.define
class Decoded:
    """The decode loop's output, one row per prompt: ``tokens``, ``log_probs``:
    ``Tensor[B, max_new_tokens]`` (valid up to ``steps`` columns); ``lengths``: ``Tensor[B]``, the
    response length of each row; ``stopped``: ``Tensor[B]`` (bool), whether it ended on a stop
    token."""

    tokens: torch.Tensor
    log_probs: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor
    steps: int = 0
    interrupted: bool = False
    """New weights are waiting: decoding stopped after ``steps`` tokens, and the rows that had
    neither stopped nor reached ``max_new_tokens`` continue once they are in."""


@final
class DecodeLoop:
    """Samples responses to a batch of prompts from a Hugging Face causal LM, token by token.

    Sampling draws from one ``torch.Generator`` on the model's device, seeded with ``seed``, so a
    loop built the same way produces the same tokens for the same calls. ``decode_kernel``: as for
    :class:`~rlcore.engines.embedded.EmbeddedEngine` (``None``: the CPU kernel where it applies and
    builds; ``False``: never; ``True``: always, or a :class:`~rlcore.errors.RolloutError` saying
    why not). ``interrupt``: set while a weight update waits, which stops decoding at the next
    token boundary.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Tokenizer,
        *,
        seed: int,
        decode_kernel: bool | None,
        interrupt: threading.Event,
    ) -> None:
        self._tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed)
        self._decode_kernel = decode_kernel
        self._kernel_ready: bool | None = None  # decided on the first generate
        self._interrupt = interrupt
        # transformers 5 renamed ``past_key_values`` to ``cache`` (the old name warns until 5.40).
        forward_params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    def decode(
        self,
        model: PreTrainedModel,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        stops: Sequence[int],
    ) -> Decoded:
        """One response per prompt, up to ``params.max_new_tokens`` tokens, ending at any of
        ``stops``; torch's errors (out of memory included) as a
        :class:`~rlcore.errors.RolloutError` that says the batch's size."""
        try:
            with torch.inference_mode():
                return self._decode(model, prompts, params, stops)
        except (
            RuntimeError,
            ValueError,
            IndexError,
        ) as exc:  # torch's errors, out of memory included
            raise RolloutError(
                f"EmbeddedEngine: generation failed for {len(prompts)} prompts "
                f"(longest {max(len(p.token_ids) for p in prompts)} tokens, max_new_tokens "
                f"{params.max_new_tokens}): {type(exc).__name__}: {exc}"
            ) from exc

    def _decode(
        self,
        model: PreTrainedModel,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        stops: Sequence[int],
    ) -> Decoded:
        """The decode loop over a :class:`~rlcore.engines.kv_cache.DecodeCache`.

        Per step it samples one token for each live row, records it, and runs the model on the live
        rows only: rows whose response ended are dropped from the cache (in batches, see
        ``_DROP_FRACTION``), so the step's cost follows the rows still generating, and the cache is
        written in place, so it does not grow with the answer either.
        """
        device, batch = self._device, len(prompts)
        # Prefill each distinct prompt once, then copy its KV cache rows to every repeat: RL batches
        # sample each prompt n_samples_per_prompt times, so this removes most of the prefill.
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(p.token_ids, len(distinct)) for p in prompts]
        lengths = [len(ids) for ids in distinct]
        width = max(lengths)
        input_ids = torch.full(
            (len(distinct), width), self._tokenizer.pad_token_id, dtype=torch.long
        )
        for row, ids in enumerate(distinct):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        input_ids = input_ids.to(device)
        prefill = DynamicCache(config=model.config)
        mask: torch.Tensor | None = None
        positions: torch.Tensor | None = None
        if any(n != width for n in lengths):
            # Left padding: mask the pads and count positions from each row's first real token.
            # Without padding both are left to the model (plain causal attention, the fast path).
            mask = torch.zeros((len(distinct), width), dtype=torch.long)
            for row, n in enumerate(lengths):
                mask[row, width - n :] = 1  # by length: a prompt may itself contain the pad id
            mask = mask.to(device)
            positions = (mask.cumsum(dim=-1) - 1).clamp_(min=0)
        logits = self._forward(model, input_ids, prefill, mask, positions)
        index = None
        if len(distinct) < batch:
            index = torch.tensor(rows, dtype=torch.long, device=device)
            logits = logits[index]
        # The last sampled token is never fed back, so max_new_tokens - 1 positions follow the
        # prompt.
        max_new = params.max_new_tokens
        cache = DecodeCache(
            prefill, index, capacity=width + max_new - 1, blocked_keys=self._use_kernel(model)
        )
        del prefill
        full_mask: torch.Tensor | None = None  # Tensor[rows, width + max_new - 1], int64
        next_position: torch.Tensor | None = None  # Tensor[rows, 1]: position of the next token
        if mask is not None and positions is not None:
            full_mask = mask.new_ones((len(distinct), width + max_new - 1))
            full_mask[:, :width] = mask
            next_position = positions[:, -1:] + 1
            if index is not None:
                full_mask, next_position = full_mask[index], next_position[index]

        stop_ids = torch.tensor(list(stops), dtype=torch.long, device=device)
        out = Decoded(
            tokens=torch.full(
                (batch, max_new), self._tokenizer.pad_token_id, dtype=torch.long, device=device
            ),
            log_probs=torch.zeros((batch, max_new), dtype=torch.float32, device=device),
            lengths=torch.full((batch,), max_new, dtype=torch.long, device=device),
            stopped=torch.zeros(batch, dtype=torch.bool, device=device),
        )
        live = torch.arange(batch, device=device)  # the output row of each cache row
        ended = torch.zeros(batch, dtype=torch.bool, device=device)  # per cache row
        n_ended = 0
        for step in range(max_new):
            token, log_prob = sample_next_tokens(logits, params, self._generator)
            # Rows that ended but are still in the cache write past their end: cut by ``lengths``.
            out.tokens[live, step] = token
            out.log_probs[live, step] = log_prob
            if stops:
                stopping = torch.isin(token, stop_ids) & ~ended
                n_stopping = int(stopping.sum())  # the loop's one host sync per step
                if n_stopping:
                    out.lengths[live[stopping]] = step + 1
                    out.stopped[live[stopping]] = True
                    ended |= stopping
                    n_ended += n_stopping
            if step + 1 == max_new or n_ended == len(live):
                break
            if self._interrupt.is_set():  # new weights are waiting: stop at this token boundary
                out.lengths[live[~ended]] = step + 1
                out.interrupted = True
                break
            if n_ended and n_ended >= _DROP_FRACTION * len(live):
                keep = (~ended).nonzero().squeeze(-1)
                cache.keep_rows(keep)
                live, token, ended, n_ended = live[keep], token[keep], ended[keep], 0
                if full_mask is not None and next_position is not None:
                    full_mask, next_position = full_mask[keep], next_position[keep]
            step_mask = None if full_mask is None else full_mask[:, : width + step + 1]
            logits = self._forward(model, token.unsqueeze(-1), cache, step_mask, next_position)
            if next_position is not None:
                next_position = next_position + 1
        out.steps = step + 1
        return out

    def _use_kernel(self, model: PreTrainedModel) -> bool:
        """Whether decode steps run the CPU kernel; decided (and the model switched to its
        attention implementation) on the first call."""
        if self._kernel_ready is None:
            self._kernel_ready = self._enable_kernel(model)
        return self._kernel_ready

    def _enable_kernel(self, model: PreTrainedModel) -> bool:
        if self._decode_kernel is False:
            return False
        reasons = []
        if self._device.type != "cpu":
            reasons.append(f"the model is on {self._device}, the kernel runs on the CPU")
        dtypes = {p.dtype for p in model.parameters()}
        if dtypes != {torch.float32}:
            reasons.append(f"the model's weights are {sorted(map(str, dtypes))}, not float32")
        implementation = model.config._attn_implementation
        if implementation not in ("sdpa", ATTENTION):
            reasons.append(f"the model uses {implementation!r} attention, not 'sdpa'")
        if not reasons and load_kernel() is None:
            reasons.append("the kernel could not be built (the warning logged above says why)")
        if not reasons:
            model.set_attn_implementation(ATTENTION)
            if model.config._attn_implementation != ATTENTION:  # transformers logged why
                reasons.append(f"{type(model).__name__}'s attention cannot be switched")
        if reasons:
            if self._decode_kernel:
                raise RolloutError("EmbeddedEngine(decode_kernel=True): " + "; ".join(reasons))
            return False
        return True

    def _forward(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        cache: Cache,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """One forward step over ``input_ids: Tensor[B, S]`` appending to ``cache``; returns the
        last position's logits, ``Tensor[B, V]`` in fp32."""
        kwargs: dict[str, object] = {self._cache_kwarg: cache}
        if mask is not None:
            kwargs["attention_mask"] = mask
            kwargs["position_ids"] = positions
        output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **kwargs)
        logits: torch.Tensor = output.logits[:, -1, :]
        return logits.float()
