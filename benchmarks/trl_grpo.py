"""bench-tiny with TRL's ``GRPOTrainer``: the mainstream trainer that :mod:`benchmarks.rl_step`
times rlcore against (``--trl``).

Configured as the workload defines one step (WORKLOAD.md section 5): 16 prompts x 8 generations
(128 completions per device batch, one generation batch per optimizer step, no gradient
accumulation, one iteration per generation, so no old-log-prob pass), ``max_completion_length``
8, temperature 1 with no top-k/top-p, the ``grpo`` loss with ``beta=0`` and group-std scaled
advantages, gradient clip 1.0, fused AdamW at a constant 1e-4, fp32 on the CPU; the prompts are
taken 16 at a time in the file's order (no shuffle), starting at ``offset * 16``.

TRL is not a dependency of rlcore: ``nox -s bench`` installs it (pyproject.toml's ``bench``
dependency group); where it is missing ``--trl`` says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.clock import Clock, wall_clock
from benchmarks.rl_step import NEW_TOKENS, PROMPTS, SAMPLES


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def trl_steps(
    assets: Path, steps: int, offset: int, out: Path, clock: Clock = wall_clock
) -> list[float]:
    """Seconds per step (end of step i-1 to end of step i, on ``clock``) of ``steps``
    GRPOTrainer steps on bench-tiny; the first one from the start of ``train()``."""
    import importlib

    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback

    from benchmarks.bench_tiny import prefix_credit

    # Only the bench session installs TRL (and its datasets), not the typecheck one: used as Any.
    datasets: Any = importlib.import_module("datasets")
    trl: Any = importlib.import_module("trl")

    rows = [json.loads(line) for line in (assets / "prompts.jsonl").read_text().splitlines()]
    start = (offset * PROMPTS) % len(rows)
    rows = rows[start:] + rows[:start]
    dataset = datasets.Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(str(assets / "tokenizer"))
    model = LlamaForCausalLM.from_pretrained(str(assets / "model"), dtype="float32")

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [prefix_credit(c, a) for c, a in zip(completions, answer, strict=True)]

    config = trl.GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL's default is on; the workload has none
        optim="adamw_torch_fused",
        max_steps=steps,
        shuffle_dataset=False,
        seed=offset,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    ends: list[float] = []

    class _Clock(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            ends.append(clock())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(clock())

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[_Clock()],
    )
    trainer.train()
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]
