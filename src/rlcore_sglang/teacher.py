"""A distillation teacher served by SGLang (``--opd-type sglang``): the
:class:`~rlcore.protocols.engine.TeacherServer` the loop asks for the teacher's log-probs of every
rollout as it is made (:func:`rlcore.loop.rollouts.rollout_source`), at the rollout's temperature.

At temperature 1 each sample is sent whole, prompt then response, to ``/generate`` with
``max_new_tokens`` 0 and ``return_logprob``; the server returns its ``input_token_logprobs``
from ``logprob_start_len`` on, computed in one prefill, as slime's OPD example asks its teacher.
SGLang gives the first position of that range no log-prob (it has no logits before it), so the
range starts at the prompt's last token, and the entries after it are the response tokens'
log-probs given everything before them.

SGLang (0.5.23) computes a prompt's log-probs from the raw logits whatever the request's
temperature; only the token it generates is scored at the temperature (``log_softmax(logits /
T)``, unless the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB``). So at another temperature
each response position is asked as a generation of one token after the prompt and the response
before it, with ``token_ids_logprob`` naming the response's token there. Positions go in rounds
(position 0 of every sample, then position 1, ...), so that the server's prefix cache holds what
the previous round read and each request computes one new token: about the cost of the server
generating the responses once, where temperature 1 costs one prefill.

Nothing the server generates is kept, so its weights and sampling state are untouched; a teacher
server may serve other runs at the same time. The server is someone's SGLang server (``python -m
sglang.launch_server --model-path DIR``); :meth:`SGLangTeacher.connect` waits for its ``/health``
and reads which model it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Final, TypeVar, final

from rlcore.errors import RolloutError
from rlcore.logits import logprob_temperature
from rlcore.samples import Sample
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import CallPolicy, SGLangServer, post_with_retries, run_all

__all__ = ["SGLangTeacher"]

_DEFAULT_OPTIONS: Final = EngineOptions()
_T = TypeVar("_T")


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

    def score(self, samples: Sequence[Sample], temperature: float) -> list[tuple[float, ...]]:
        """Per response token of each sample: its log-probability under the teacher at
        ``temperature`` (``softmax(logits / T)``; :func:`rlcore.logits.logprob_temperature`),
        given the prompt and the response before it (module docstring). Requests carry at most
        ``options.max_prompts_per_request`` sequences, at most
        ``options.max_concurrent_requests`` at a time; a connection error is retried
        (``options.connect_retries``)."""
        scored = [s for s in samples if s.response.token_ids]  # an empty response has nothing
        scale = logprob_temperature(temperature)
        if scale == 1.0:  # one prefill of prompt + response each
            rows = self._requests(self._prefill_chunk, scored)
        else:
            rows = self._by_position(scored, scale)
        results = iter(rows)
        return [next(results) if s.response.token_ids else () for s in samples]

    def _by_position(self, samples: list[Sample], temperature: float) -> list[tuple[float, ...]]:
        """Another temperature: response position ``t`` of every sample that has one, as a
        one-token generation after ``prompt + response[:t]``, in rounds of ``t``."""
        rows: list[list[float]] = [[] for _ in samples]
        send = partial(self._position_chunk, temperature=temperature)
        for t in range(max((len(s.response.token_ids) for s in samples), default=0)):
            live = [i for i, s in enumerate(samples) if len(s.response.token_ids) > t]
            asks = [(samples[i], t) for i in live]
            for i, (log_prob,) in zip(live, self._requests(send, asks), strict=True):
                rows[i].append(log_prob)
        return [tuple(row) for row in rows]

    def _requests(
        self, send: Callable[[list[_T]], list[tuple[float, ...]]], items: list[_T]
    ) -> list[tuple[float, ...]]:
        """``send`` over ``items`` in chunks of ``options.max_prompts_per_request``, at most
        ``options.max_concurrent_requests`` at a time; the results in the items' order."""
        step = self.options.max_prompts_per_request
        chunks = [items[i : i + step] for i in range(0, len(items), step)]
        jobs = [partial(send, chunk) for chunk in chunks]
        return [
            row for chunk in run_all(jobs, self.options.max_concurrent_requests) for row in chunk
        ]

    def _generate(self, payload: Mapping[str, object], count: int) -> list[object]:
        answer = post_with_retries(
            self.server, "/generate", payload, self.options.request_timeout_s, self._policy
        )
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != count:
            raise RolloutError(
                f"teacher {self.server.describe()} returned {len(items)} results for "
                f"{count} sequences: {str(answer)[:500]}"
            )
        return items

    def _prefill_chunk(self, samples: list[Sample]) -> list[tuple[float, ...]]:
        payload = {
            "input_ids": [[*s.prompt.token_ids, *s.response.token_ids] for s in samples],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": [len(s.prompt.token_ids) - 1 for s in samples],
        }
        items = self._generate(payload, len(samples))
        return [self._parse(item, sample) for item, sample in zip(items, samples, strict=True)]

    def _position_chunk(
        self, asks: list[tuple[Sample, int]], temperature: float
    ) -> list[tuple[float, ...]]:
        payload = {
            "input_ids": [[*s.prompt.token_ids, *s.response.token_ids[:t]] for s, t in asks],
            "sampling_params": {"max_new_tokens": 1, "temperature": temperature},
            "return_logprob": True,
            "token_ids_logprob": [[s.response.token_ids[t]] for s, t in asks],
        }
        items = self._generate(payload, len(asks))
        return [
            (self._parse_position(item, s.response.token_ids[t]),)
            for item, (s, t) in zip(items, asks, strict=True)
        ]

    def _parse(self, item: object, sample: Sample) -> tuple[float, ...]:
        """The response tokens' log-probs from one prefill's answer: ``input_token_logprobs``
        holds ``[logprob, token_id, text]`` for every input token from ``logprob_start_len``
        on: the prompt's last token (no log-prob), then the response's. The token ids there are
        not compared with the response's: SGLang 0.5.23 reports id 0 for a vocabulary's last
        token (its scheduler clips input ids ``>= vocab_size - 1`` to 0, meant for image-token
        hashes); the log-prob is the right token's, checked against transformers in
        tests/sglang."""
        length = len(sample.response.token_ids)
        try:
            assert isinstance(item, Mapping)
            entries = item["meta_info"]["input_token_logprobs"]
            assert len(entries) == length + 1 and entries[0][0] is None
            return tuple(float(entry[0]) for entry in entries[1:])
        except (AssertionError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise self._unreadable(
                item,
                exc,
                f"the log-probs of the prompt's last token, none, and of the {length} "
                "response tokens",
            ) from exc

    def _parse_position(self, item: object, token: int) -> float:
        """The log-prob of ``token`` from a one-token generation's answer:
        ``output_token_ids_logprobs`` holds, for the one generated position, ``[logprob,
        token_id, text]`` of each id asked for."""
        try:
            assert isinstance(item, Mapping)
            ((entry,),) = item["meta_info"]["output_token_ids_logprobs"]
            assert int(entry[1]) == token
            return float(entry[0])
        except (AssertionError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise self._unreadable(item, exc, f"the log-prob of token {token}") from exc

    def _unreadable(self, item: object, exc: Exception, expected: str) -> RolloutError:
        return RolloutError(
            f"teacher {self.server.describe()} sent a /generate answer rlcore cannot read "
            f"({exc!r}; expected {expected}; is the server an SGLang 0.5.x?): {str(item)[:500]}"
        )
