"""``python -m rlcore_megatron.run``: flags or ``--config`` -> RunConfig -> plan -> Ray -> Megatron
stacks in train groups -> rollout engine -> the core loop.

With no flags at all it runs the self-contained CPU demo (:mod:`rlcore_megatron.demo`). Data is
read and checked before any model is built, so a malformed file stops the run at once with the
file and line. Metrics go to ``OUTPUT_DIR/metrics.jsonl`` (and TensorBoard / wandb when asked);
the log to ``OUTPUT_DIR/run.log`` and the console.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from rlcore.config import RunConfig
from rlcore.data import HFTokenizer, load_eval_sets, load_prompts
from rlcore.errors import ConfigError, ConfigProblem, RLCoreError
from rlcore.flags import build_parser, load_config
from rlcore.loop import RunData, RunResult, run
from rlcore.metrics import JsonlSink, MultiSink, TensorBoardSink
from rlcore.plan import Plan, TrainPlan, plan, resolve_num_rollout
from rlcore.protocols import MetricsSink, RolloutEngine
from rlcore.rewards import get_reward_fn
from rlcore.samples import Prompt
from rlcore_megatron.console import ProgressSink, WandbSink, setup_logging
from rlcore_megatron.demo import demo_flags, prepare_demo

__all__ = ["engine_dtype", "load_run_data", "main", "make_engine"]

log = logging.getLogger("rlcore")

DEMO_FOLDER = Path("runs/demo")
DESCRIPTION = (
    "RL post-training with a Megatron backend, Ray and a rollout engine. With no flags, runs a "
    "small self-contained demo on the CPU. Flags keep slime's names; --config reads a TOML file "
    "(sections as below) and flags override it. --num-rollout 0 evaluates only."
)


def _tokenizer(config: RunConfig) -> HFTokenizer:
    from transformers import AutoTokenizer

    folder = config.model.hf_checkpoint
    if folder is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "model.hf_checkpoint (--hf-checkpoint)",
                    "no model given",
                    "point --hf-checkpoint at a Hugging Face model folder",
                )
            ]
        )
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    except OSError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "model.hf_checkpoint (--hf-checkpoint)",
                    f"no tokenizer in {folder}: {exc}",
                    "save the tokenizer beside the model",
                )
            ]
        ) from exc


def load_run_data(config: RunConfig, tokenizer: HFTokenizer) -> RunData:
    """Every prompt the run needs, read and validated before anything heavy is built."""
    d = config.data
    train: tuple[Prompt, ...] = ()
    if not config.is_eval_only:
        if d.prompt_data is None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "data.prompt_data (--prompt-data)",
                        "a training run needs prompts",
                        "add --prompt-data FILE.jsonl, or --num-rollout 0 to evaluate only",
                    )
                ]
            )
        train = load_prompts(
            d.prompt_data,
            tokenizer=tokenizer,
            input_key=d.input_key,
            label_key=d.label_key,
            apply_chat_template=d.apply_chat_template,
        )
    eval_sets = load_eval_sets(
        [(e.name, e.path) for e in config.eval.prompt_data],
        tokenizer=tokenizer,
        input_key=d.input_key,
        label_key=d.label_key,
        apply_chat_template=d.apply_chat_template,
    )
    return RunData(train_prompts=train, eval_sets=eval_sets, seed=config.seed)


def engine_dtype(config: RunConfig) -> str:
    """The rollout engine's dtype: the trainer's (``bfloat16`` with ``--bf16``, else ``float32``),
    so that the weights synced after every step arrive unconverted and the engine's log-probs are
    comparable with the trainer's."""
    return "bfloat16" if config.model.bf16 else "float32"


def make_engine(config: RunConfig, tokenizer: HFTokenizer) -> RolloutEngine:
    """The rollout engine the config names, loaded with the initial HF weights, in
    :func:`engine_dtype`."""
    assert config.model.hf_checkpoint is not None
    if config.rollout.engine == "sglang":
        import torch

        from rlcore.engines.sglang import EngineOptions, SGLangEngine
        from rlcore.engines.sglang_server import LaunchSettings

        options = EngineOptions(weight_sync=config.rollout.weight_sync)
        if config.rollout.sglang_urls:
            return SGLangEngine.connect(config.rollout.sglang_urls, options)
        on_gpu = torch.cuda.is_available()
        settings = LaunchSettings(
            model_path=config.model.hf_checkpoint,
            device="cuda" if on_gpu else "cpu",
            dtype=engine_dtype(config),
            random_seed=config.seed,
            log_dir=config.output_dir / "sglang",
        )
        return SGLangEngine.launch(settings, config.rollout.sglang_num_servers, options)
    import torch

    from rlcore.engines.embedded import EmbeddedEngine

    return EmbeddedEngine.from_pretrained(
        config.model.hf_checkpoint,
        tokenizer,
        seed=config.seed,
        dtype=torch.bfloat16 if engine_dtype(config) == "bfloat16" else torch.float32,
    )


def _sinks(config: RunConfig, the_plan: Plan) -> MetricsSink:
    """Every sink the config asks for; when one fails to start, those already started are closed
    (the progress display included) before the error propagates."""
    out = config.output_dir
    sinks: list[MetricsSink] = []
    try:
        sinks.append(JsonlSink(out / "metrics.jsonl"))
        if isinstance(the_plan, TrainPlan):
            sinks.append(ProgressSink(total=the_plan.num_rollout))
        if config.use_tensorboard:
            sinks.append(TensorBoardSink(out / "tensorboard"))
        if config.use_wandb:
            sinks.append(WandbSink(out, config))
    except BaseException:
        MultiSink(sinks).close()
        raise
    return MultiSink(sinks)


def _start_ray(config: RunConfig) -> None:
    import ray

    from rlcore_megatron.ray_group import RayGroupError

    if ray.is_initialized():
        return
    if config.ray_address is not None:
        try:
            ray.init(address=config.ray_address, log_to_driver=False)
        except ConnectionError as exc:
            # Ray's reason, on its last line.
            cause = str(exc.__cause__ or "").strip().splitlines()[-1:]
            raise RayGroupError(
                f"--ray-address {config.ray_address}: could not join the Ray cluster: {exc}"
                + "".join(f"\n{line}" for line in cause)
                + "\n"
                "Is it running (`ray status --address ...`)? A cluster with token authentication "
                "(what Ray starts by default) also needs RAY_AUTH_MODE=token here, with its token "
                "in ~/.ray/auth_token or RAY_AUTH_TOKEN: Ray sends no token to an explicit address "
                "unasked."
            ) from exc
        log.info("ray: joined the cluster at %s", ray.get_runtime_context().gcs_address)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False)
        log.info("ray: started a local instance at %s", ray.get_runtime_context().gcs_address)


def write_summary(path: Path, result: RunResult) -> None:
    """``summary.json``: what the run built, trained, saved and evaluated, and its last metrics."""
    path.write_text(json.dumps(attrs.asdict(result), indent=1) + "\n")


def execute(config: RunConfig) -> RunResult:
    """Run one configured job to the end; the pieces are closed whatever happens."""
    import ray

    from rlcore_megatron.ray_group import GroupOptions
    from rlcore_megatron.ray_stacks import RayMegatronBackend

    setup_logging(config.output_dir / "run.log")
    tokenizer = _tokenizer(config)
    data = load_run_data(config, tokenizer)
    if not config.is_eval_only:
        config = resolve_num_rollout(config, len(data.train_prompts))
    the_plan = plan(config)
    reward_fn = get_reward_fn(config.data.rm_type, config.data.custom_rm_path)
    log.info("plan: %s, output in %s", type(the_plan).__name__, config.output_dir)
    started_ray = not ray.is_initialized()
    _start_ray(config)
    threads = max(1, (os.cpu_count() or 1))
    backend = RayMegatronBackend(GroupOptions(cpus_per_rank=1.0, threads_per_rank=threads))
    engine: RolloutEngine | None = None
    sink: MetricsSink | None = None
    try:
        sink = _sinks(config, the_plan)
        engine = make_engine(config, tokenizer)
        result = run(the_plan, backend, engine, reward_fn, data, sink)
        write_summary(config.output_dir / "summary.json", result)
        return result
    finally:
        if sink is not None:
            sink.close()
        if engine is not None:
            engine.close()
        backend.close()
        if started_ray:
            ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for configuration problems, 1 for run
    errors)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(description=DESCRIPTION)
    if not args:
        prepare_demo(DEMO_FOLDER)
        args = demo_flags(DEMO_FOLDER)
        print(
            f"No flags: running the CPU demo in {DEMO_FOLDER} (see --help for the real thing).",
            file=sys.stderr,
        )
    try:
        config = load_config(args, parser)
        result = execute(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RLCoreError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    evals = {k: round(v, 4) for k, v in result.last_eval.items()}
    trained = (
        f"rollouts {result.trained[0]}..{result.trained[-1]}"
        if result.trained
        else "nothing (eval-only)"
    )
    print(
        f"done: trained {trained}, saved {list(result.saved)}, built {list(result.built)}, "
        f"last eval {evals}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
