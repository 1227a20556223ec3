"""Multi-turn episodes on the real embedded engine: the ids the trainer scores are the ids the
engine continued from, turn after turn (token-in/token-out), and the turns of concurrent episodes
go to the engine in one batch per step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.algorithms.batching import tensorize_samples, token_log_probs
from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.engines.embedded import EmbeddedEngine
from rlcore.rollout.environments import StepResult
from rlcore.rollout.multiturn import EpisodeEngine
from rlcore.samples import Prompt, Sample, SamplingParams, Turn
from rlcore.testing.tiny import build_char_tokenizer, build_tiny_llama

ALPHABET = "0123456789+= "


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_mt")
    tok = build_char_tokenizer(folder, ALPHABET)
    build_tiny_llama(folder, vocab_size=len(tok), hidden_size=32, max_position_embeddings=128)
    return folder


class Echo:
    """Answers each model turn with ``" = "`` and the turn's length, three times, then ends."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.steps = 0

    async def step(self, turn: Turn) -> StepResult:
        self.steps += 1
        if self.steps == 3:
            return StepResult(reward=1.0, done=True)
        text = f" = {len(turn.token_ids)} "
        return StepResult(tuple(self.tokenizer.encode_rendered(text)), text)


def test_episode_ids_are_what_the_trainer_scores(model_folder: Path) -> None:
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(model_folder)))
    engine = EmbeddedEngine.from_pretrained(model_folder, tokenizer, seed=3)
    episodes = EpisodeEngine(
        engine, tokenizer, max_turns=4, make_environment=lambda p, t: Echo(tokenizer)
    )
    prompts = [Prompt(i, s, tuple(tokenizer.encode(s))) for i, s in enumerate(["12+3=", "7="])]
    prompts = [p for p in prompts for _ in range(3)]
    # Many stop tokens: turns end after a few tokens, so episodes take several turns.
    stops = tuple(tokenizer.encode_rendered("02468+"))
    params = SamplingParams(max_new_tokens=40, stop_token_ids=stops)
    gens = episodes.generate(prompts, params)

    finished = [g for g in gens if g.finish_reason == "stop"]
    assert finished, "some episode should end by the environment"
    for g in finished:
        assert [t.role for t in g.turns] == ["model", "environment"] * 2 + ["model"]
        assert g.env_reward == 1.0
    # Batched: one engine call per step (at most 3 model turns), not one per episode and turn.
    assert episodes.engine_calls == 3
    for g in gens:
        assert g.token_ids == tuple(i for t in g.turns for i in t.token_ids)
        assert g.loss_mask == tuple(int(t.role == "model") for t in g.turns for _ in t.token_ids)

    # The trainer's view: prompt + response ids, scored in one forward pass with the trainer's
    # log-prob code. Every model token's engine log-prob matches, so the engine sampled each
    # turn from exactly these ids (observations included): nothing was re-encoded.
    model = AutoModelForCausalLM.from_pretrained(str(model_folder))
    samples = [Sample(p, g, 0.0, i) for i, (p, g) in enumerate(zip(prompts, gens, strict=True))]
    batch = tensorize_samples(samples, tokenizer.pad_token_id)
    for row, (p, g) in zip(batch.tokens.tolist(), zip(prompts, gens, strict=True), strict=True):
        conversation = p.token_ids + tuple(i for t in g.turns for i in t.token_ids)
        assert tuple(row[: len(conversation)]) == conversation
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits
    trainer = token_log_probs(logits, batch)
    engine_lp = torch.zeros_like(trainer)
    for i, g in enumerate(gens):
        engine_lp[i, : len(g.log_probs)] = torch.tensor(g.log_probs)
    mask = batch.loss_mask
    assert int(mask.sum()) == sum(g.model_tokens for g in gens)
    assert int((batch.response_mask & ~mask).sum()) > 0  # observations are in the context
    torch.testing.assert_close(trainer[mask], engine_lp[mask], atol=1e-4, rtol=0)
    assert torch.all(engine_lp[batch.response_mask & ~mask] == 0)
