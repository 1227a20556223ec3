"""SGLang's ``/generate`` as the engine speaks it: the request's sampling parameters, the call,
and the answer read back into rlcore's :class:`~rlcore.samples.Generation`.

:func:`sampling_payload` turns :class:`~rlcore.samples.SamplingParams` into SGLang's
``sampling_params``; :func:`post_generate` sends a batch of prompts as token ids and returns one
answer per prompt (a sampling parameter the server does not know is named with what to do);
:func:`parse_generation` reads one answer (tokens, their log-probs, the finish reason, the weight
version the server reports) and refuses one it cannot read. The engine
(:class:`~rlcore_sglang.client.SGLangEngine`) decides which server gets which prompts and when.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlcore.errors import RolloutError
from rlcore.samples import FinishReason, Generation, Prompt, SamplingParams
from rlcore_sglang.server import CallPolicy, SGLangHTTPError, SGLangServer, post_with_retries

__all__ = ["parse_generation", "post_generate", "sampling_payload"]


def sampling_payload(params: SamplingParams, extra: Mapping[str, object]) -> dict[str, object]:
    """rlcore's :class:`SamplingParams` as SGLang's ``/generate`` ``sampling_params``."""
    payload: dict[str, object] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        # rlcore's "off" is 0; SGLang's is -1.
        "top_k": params.top_k if params.top_k > 0 else -1,
        "skip_special_tokens": True,
    }
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra)
    return payload


def post_generate(
    server: SGLangServer,
    prompts: Sequence[Prompt],
    sampling: Mapping[str, object],
    timeout_s: float,
    policy: CallPolicy,
) -> list[object]:
    """``/generate`` on ``server`` for ``prompts`` (their token ids) with ``sampling``, retrying
    connection errors as ``policy`` says: one answer per prompt, in order, each still to be read
    by :func:`parse_generation`. A :class:`~rlcore.errors.RolloutError` naming the server (with
    its log tail) when it refuses the call or answers for another number of prompts."""
    payload = {
        "input_ids": [list(p.token_ids) for p in prompts],
        "sampling_params": sampling,
        "return_logprob": True,
    }
    try:
        answer = post_with_retries(server, "/generate", payload, timeout_s, policy)
    except SGLangHTTPError as exc:
        if exc.status == 400 and "unknown field" in exc.body:
            raise RolloutError(
                f"{server.describe()} rejected a sampling parameter: {exc.body.strip()}. "
                f"rlcore sent {sorted(sampling)}; remove the unknown name from "
                "EngineOptions.extra_sampling_params (or use an SGLang version that knows it)"
            ) from exc
        raise RolloutError(f"{exc}{server.log_tail_text()}") from exc
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != len(prompts):
        raise RolloutError(
            f"{server.describe()} returned {len(items)} results for {len(prompts)} prompts"
        )
    return items


def parse_generation(
    server: SGLangServer, item: object, dispatched: int, served: int
) -> Generation:
    """One ``/generate`` answer of ``server`` as a :class:`~rlcore.samples.Generation`. Its
    ``weight_version`` is the one the server reports, else ``served`` (the version the engine
    serves now); its ``first_weight_version`` is ``dispatched`` (the version when the request was
    sent), or the reported one if that is older. A :class:`~rlcore.errors.RolloutError` naming
    the server when the answer cannot be read or its log-probs name other tokens."""
    try:
        assert isinstance(item, dict)
        meta = item["meta_info"]
        token_ids = tuple(int(t) for t in item["output_ids"])
        entries = meta["output_token_logprobs"]
        log_probs = tuple(float(entry[0]) for entry in entries)
        logprob_ids = tuple(int(entry[1]) for entry in entries)
        finish = meta["finish_reason"]
        finish_type = finish["type"] if isinstance(finish, dict) else str(finish)
        text = str(item.get("text", ""))
        version_text = str(meta.get("weight_version", ""))
    except (AssertionError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise RolloutError(
            f"{server.describe()} sent a /generate answer rlcore cannot read ({exc!r}): "
            f"{str(item)[:500]}"
        ) from exc
    if logprob_ids != token_ids:
        raise RolloutError(
            f"{server.describe()}: output_token_logprobs name tokens {logprob_ids[:8]}... "
            f"but output_ids are {token_ids[:8]}...; is the server an SGLang 0.5.x?"
        )
    reason: FinishReason = "abort"
    if finish_type == "stop":
        reason = "stop"
    elif finish_type == "length":
        reason = "length"
    version = int(version_text) if version_text.isdigit() else served
    return Generation(
        token_ids,
        log_probs,
        text,
        reason,
        version,
        first_weight_version=min(dispatched, version),
    )
