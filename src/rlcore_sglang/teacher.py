"""A distillation teacher served by SGLang (``--opd-type sglang``): the
:class:`~rlcore.protocols.TeacherServer` the loop asks for the teacher's log-probs of every rollout
as it is made (:func:`rlcore.loop.stages.rollout_source`).

Each sample is sent whole, prompt then response, to ``/generate`` with ``max_new_tokens`` 0 and
``return_logprob``; the server returns its ``input_token_logprobs`` (from the raw logits:
temperature 1) from ``logprob_start_len`` on, computed in one prefill, as slime's OPD example asks
its teacher. SGLang gives the first position of that range no log-prob (it has no logits before
it), so the range starts at the prompt's last token, and the entries after it are the response
tokens' log-probs given everything before them. Nothing is generated, so the server's weights and
sampling state are untouched; a teacher server may serve other runs at the same time.

The server is someone's SGLang server (``python -m sglang.launch_server --model-path DIR``);
:meth:`SGLangTeacher.connect` waits for its ``/health`` and reads which model it serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Final, final

from rlcore.errors import RolloutError
from rlcore.samples import Sample
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import CallPolicy, SGLangServer, post_with_retries, run_all

__all__ = ["SGLangTeacher"]

_DEFAULT_OPTIONS: Final = EngineOptions()


@final
class SGLangTeacher:
    """An SGLang server that scores token sequences for on-policy distillation. It has
    :meth:`score` and nothing else: no weights are sent to it, nothing of it is trained."""

    def __init__(self, server: SGLangServer, options: EngineOptions = _DEFAULT_OPTIONS) -> None:
        self.server = server
        self.options = options
        self._policy = CallPolicy(options.connect_retries, options.retry_backoff_s)

    @classmethod
    def connect(cls, url: str, options: EngineOptions = _DEFAULT_OPTIONS) -> SGLangTeacher:
        """The teacher served at ``url``, once its ``/health`` answers (within
        ``options.health_timeout_s``; else :class:`~rlcore.errors.RolloutError`)."""
        server = SGLangServer(url)
        server.wait_until_healthy(options.health_timeout_s)
        return cls(server, options)

    def model_folder(self) -> Path | None:
        """The folder the server loaded its tokenizer from (``/server_info``'s
        ``tokenizer_path``, else ``model_path``), when this machine can read it: what a run
        compares with the student's before it starts. ``None`` when the server does not say or
        the folder is on another machine."""
        info = self.server.info(timeout_s=30.0)
        for key in ("tokenizer_path", "model_path"):
            value = info.get(key)
            if isinstance(value, str) and (Path(value) / "config.json").is_file():
                return Path(value)
        return None

    def score(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        """Per response token of each sample: its log-probability under the teacher, given the
        prompt and the response before it. Samples go in requests of at most
        ``options.max_prompts_per_request``, at most ``options.max_concurrent_requests`` at a
        time; a connection error is retried (``options.connect_retries``)."""
        scored = [s for s in samples if s.response.token_ids]  # an empty response has nothing
        step = self.options.max_prompts_per_request
        chunks = [scored[i : i + step] for i in range(0, len(scored), step)]
        jobs = [partial(self._score_chunk, chunk) for chunk in chunks]
        results = iter(
            scores
            for chunk in run_all(jobs, self.options.max_concurrent_requests)
            for scores in chunk
        )
        return [next(results) if s.response.token_ids else () for s in samples]

    def _score_chunk(self, samples: list[Sample]) -> list[tuple[float, ...]]:
        payload = {
            "input_ids": [[*s.prompt.token_ids, *s.response.token_ids] for s in samples],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": [len(s.prompt.token_ids) - 1 for s in samples],
        }
        answer = post_with_retries(
            self.server, "/generate", payload, self.options.request_timeout_s, self._policy
        )
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != len(samples):
            raise RolloutError(
                f"teacher {self.server.describe()} returned {len(items)} results for "
                f"{len(samples)} samples"
            )
        return [self._parse(item, sample) for item, sample in zip(items, samples, strict=True)]

    def _parse(self, item: object, sample: Sample) -> tuple[float, ...]:
        """The response tokens' log-probs from one answer: ``input_token_logprobs`` holds
        ``[logprob, token_id, text]`` for every input token from ``logprob_start_len`` on: the
        prompt's last token (no log-prob), then the response's. The token ids there are not
        compared with the response's: SGLang 0.5.23 reports id 0 for a vocabulary's last token
        (its scheduler clips input ids ``>= vocab_size - 1`` to 0, meant for image-token hashes);
        the log-prob is the right token's, checked against transformers in tests/sglang."""
        length = len(sample.response.token_ids)
        try:
            assert isinstance(item, Mapping)
            entries = item["meta_info"]["input_token_logprobs"]
            assert len(entries) == length + 1 and entries[0][0] is None
            log_probs = tuple(float(entry[0]) for entry in entries[1:])
        except (AssertionError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise RolloutError(
                f"teacher {self.server.describe()} sent a /generate answer rlcore cannot read "
                f"({exc!r}; expected the log-probs of the prompt's last token, none, and of the "
                f"{length} response tokens; is the server an SGLang 0.5.x?): {str(item)[:500]}"
            ) from exc
        return log_probs
