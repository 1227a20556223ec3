"""`python -m rlcore_megatron.run` with the mistakes a newcomer makes first: each stops at once,
before Ray or any model starts, with an error naming the flag and the file, exit code 2, no
traceback, no process started, no folder left behind and no request to a model hub."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlcore.checkpoint_files import CheckpointMeta
from rlcore.config.flags import load_config
from rlcore.errors import ConfigError, PlanError
from rlcore.launch import checks as prepare_module
from rlcore.launch.prepare import prepare
from rlcore.loop.checkpoints import write_checkpoint
from tests.e2e.cli import WatchedCLI, model_hub


def _flags(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--prompt-data",
        str(demo / "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "answer",
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--output-dir",
        str(out),
        *extra,
    ]


def _refused(flags: list[str], tmp_path: Path) -> str:
    """Run the CLI against a recording model hub; check it refused the run the way every case
    must, and return its stderr."""
    with model_hub() as (env, requests):
        cli = WatchedCLI(flags, tmp_path / "cli", env)
        code = cli.wait(timeout_s=300)
    err = cli.stderr
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert cli.seen == {}, "nothing may start (no Ray, no engine) before the checks pass"
    assert requests == [], "a local path must never reach a model hub"
    assert not (tmp_path / "out").exists(), "the output folder is removed again"
    return err


def test_a_model_folder_that_does_not_exist(demo: Path, tmp_path: Path) -> None:
    # A relative name that also looks like a hub model id: it was looked up on the hub for 30 s.
    err = _refused(_flags(demo, tmp_path / "out", "--hf-checkpoint", "my-model"), tmp_path)
    assert err.splitlines()[1] == (
        "  - model.hf_checkpoint (--hf-checkpoint): my-model does not exist (point it at a local "
        "Hugging Face model folder (config.json, model.safetensors, tokenizer files); model hub "
        "names are not downloaded)"
    )


def test_an_empty_model_folder_says_which_files_are_missing(demo: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    err = _refused(
        _flags(demo, tmp_path / "out", "--hf-checkpoint", str(tmp_path / "empty")), tmp_path
    )
    assert (
        f"{tmp_path / 'empty'} has no config.json, weights (model.safetensors, or "
        "model.safetensors.index.json and shards) and tokenizer (tokenizer.json, tokenizer.model "
        "or vocab files)"
    ) in err


@pytest.mark.slow
@pytest.mark.megatron  # config.json is read by Megatron's validator
def test_an_unsupported_model_type_is_found_in_config_json(demo: Path, tmp_path: Path) -> None:
    bert = tmp_path / "bert"
    shutil.copytree(demo / "model", bert)
    config = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    err = _refused(_flags(demo, tmp_path / "out", "--hf-checkpoint", str(bert)), tmp_path)
    assert err.splitlines() == [
        "error: 1 configuration problem(s):",
        f"  - model.hf_checkpoint (--hf-checkpoint): {bert / 'config.json'}: model_type: 'bert' "
        "is not supported (the Megatron backend builds llama, qwen2, qwen3, qwen3_moe models)",
    ]


@pytest.mark.slow
@pytest.mark.megatron  # config.json is read by Megatron's validator
def test_a_truncated_safetensors_file_is_named_incomplete(demo: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(demo / "model", model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:  # a copy that stopped 1 kB short
        f.truncate(size - 1024)
    err = _refused(_flags(demo, tmp_path / "out", "--hf-checkpoint", str(model)), tmp_path)
    assert (
        f"{weights} is incomplete: {size - 1024} bytes of the {size} its header describes "
        "(an interrupted copy or download?) (copy or download the file again)"
    ) in err


@pytest.mark.slow
@pytest.mark.megatron  # a valid model folder: config.json is read by Megatron's validator
def test_output_folders_that_cannot_be_written(demo: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    flags = _flags(demo, a_file / "out", "--hf-checkpoint", str(demo / "model"))
    flags += ["--save", "/proc/rlcore-ckpt", "--save-interval", "1"]  # a virtual file system
    err = _refused(flags, tmp_path)
    assert err.splitlines()[1:] == [
        f"  - output_dir (--output-dir): cannot create {a_file / 'out'}: Not a directory (choose "
        "a folder this user can write)",
        "  - checkpoint.save (--save): cannot create /proc/rlcore-ckpt: No such file or directory "
        "(choose a folder this user can write)",
    ]


def test_non_finite_numbers_are_blamed_on_their_own_flags(demo: Path, tmp_path: Path) -> None:
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    err = _refused(
        [*flags, "--lr", "nan", "--rollout-temperature", "nan", "--eps-clip=inf"], tmp_path
    )
    assert err.splitlines()[1:] == [
        "  - rollout.temperature (--rollout-temperature): must be a finite number, got nan",
        "  - algorithm.eps_clip (--eps-clip): must be a finite number, got inf",
        "  - optim.lr (--lr): must be a finite number, got nan",
    ]


def test_a_negative_number_is_the_value_of_its_flag(demo: Path, tmp_path: Path) -> None:
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    err = _refused([*flags, "--lr", "-1e-6"], tmp_path)
    assert err.splitlines()[1:] == ["  - optim.lr (--lr): must be > 0, got -1e-06"]


def test_ranks_that_cannot_fit_this_machine_are_said_first(demo: Path, tmp_path: Path) -> None:
    """64 ranks on this machine, with a batch that 64 ranks cannot split either: the placement
    refusal comes first (no batch size would make the run start), then the config's problems."""
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    err = _refused([*flags, "--actor-num-gpus-per-node", "64"], tmp_path)
    lines = err.splitlines()
    assert lines[0].startswith("error: PlacementError: the run does not fit on this Ray cluster"), (
        err
    )
    assert "it needs 64 CPU slots" in err
    problems = [line for line in lines if line.startswith("error: ")]
    assert problems[1:] == ["error: 1 configuration problem(s) in flags:"], err
    assert "= 4 x 64 (pick sizes that divide)" in err  # the batch problem, still said
    # The same ranks with a batch that splits: the placement alone, as before.
    split = _refused(
        [
            *flags,
            "--actor-num-gpus-per-node",
            "64",
            "--global-batch-size",
            "256",
            "--micro-batch-size",
            "4",
            "--rollout-batch-size",
            "128",
        ],
        tmp_path,
    )
    assert (
        split.startswith("error: PlacementError: the run does not fit")
        and len([line for line in split.splitlines() if line.startswith("error: ")]) == 1
    ), split


def test_a_teacher_that_cannot_score_the_students_tokens_is_refused(
    demo: Path, tmp_path: Path
) -> None:
    """--use-opd: a teacher folder that does not exist, or whose vocabulary or tokenizer is not
    the student's, is refused before anything starts."""
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"), "--use-opd")
    missing = tmp_path / "nowhere"
    err = _refused([*flags, "--opd-teacher-hf-checkpoint", str(missing)], tmp_path)
    assert (
        f"opd.opd_teacher_hf_checkpoint (--opd-teacher-hf-checkpoint): {missing} does not exist"
        in err
    )

    other = tmp_path / "other"
    shutil.copytree(demo / "model", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 99}))
    (other / "tokenizer.json").write_text('{"version": "a different tokenizer"}')
    err = _refused([*flags, "--opd-teacher-hf-checkpoint", str(other)], tmp_path)
    assert f"the teacher's vocabulary has 99 tokens and the student's {config['vocab_size']}" in err
    assert f"{other / 'tokenizer.json'} differs from the student's" in err
    assert "distill from a teacher with the student's tokenizer" in err


def _teacher_checkpoints(save: Path, model: Path, rollout_ids: tuple[int, ...] = (0,)) -> None:
    """Checkpoints as an rlcore run of ``model`` writes them: its settings recorded in
    ``rlcore.json``, the actor's Megatron record (``rollout.json``) of that model's shape."""
    from rlcore_megatron.checkpoint import FORMAT
    from rlcore_megatron.model.arch import model_info, read_hf_config

    record = {"format": FORMAT, "model": model_info(read_hf_config(model), "actor")}
    settings = {"model": {"hf_checkpoint": str(model)}}

    def actor(folder: Path) -> None:
        (folder / "rollout.json").write_text(json.dumps({**record, "rollout_id": 0}))

    for rollout_id in rollout_ids:
        write_checkpoint(
            save, CheckpointMeta(rollout_id, 8, ("actor",), settings), {"actor": actor}
        )


@pytest.mark.megatron  # a valid model folder: config.json is read by Megatron's validator
def test_a_teacher_checkpoint_that_cannot_be_the_teacher_is_refused(
    demo: Path, tmp_path: Path
) -> None:
    """--opd-teacher-load: a folder that is not there, a step that is not there (the ones that
    are named), a checkpoint whose recorded model folder has another vocabulary than the student's
    or no longer fits the weights saved: each refused before anything starts."""
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"), "--use-opd")
    missing = tmp_path / "nowhere"
    err = _refused([*flags, "--opd-teacher-load", str(missing)], tmp_path)
    assert (
        f"opd.opd_teacher_load (--opd-teacher-load): checkpoint folder {missing} does not exist"
        in err
    )

    save = tmp_path / "teacher_run"
    _teacher_checkpoints(save, demo / "model", rollout_ids=(0, 2))
    err = _refused(
        [*flags, "--opd-teacher-load", str(save), "--opd-teacher-ckpt-step", "5"], tmp_path
    )
    assert err.splitlines()[1] == (
        f"  - opd.opd_teacher_ckpt_step (--opd-teacher-ckpt-step): {save} has no checkpoint of "
        "rollout 5: it holds checkpoints of rollouts 1, 3 (pick one of them)"
    )

    other = tmp_path / "other"  # a model of another vocabulary, that its run trained
    shutil.copytree(demo / "model", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 99}))
    _teacher_checkpoints(tmp_path / "other_run", other)
    err = _refused([*flags, "--opd-teacher-load", str(tmp_path / "other_run")], tmp_path)
    assert f"the teacher's vocabulary has 99 tokens and the student's {config['vocab_size']}" in err

    deeper = tmp_path / "deeper"  # the recorded folder, replaced since by a deeper model
    shutil.copytree(demo / "model", deeper)
    _teacher_checkpoints(tmp_path / "deeper_run", deeper)
    layers = config["num_hidden_layers"]
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers + 1}))
    err = _refused(
        [*flags, "--opd-teacher-load", str(tmp_path / "deeper_run"), "--opd-teacher-ckpt-step=1"],
        tmp_path,
    )
    assert err.splitlines()[1] == (
        f"  - opd.opd_teacher_load (--opd-teacher-load): {tmp_path / 'deeper_run/rollout_000001'}"
        f"/actor holds weights of another shape than {deeper / 'config.json'} describes: "
        f"num_layers is {layers} there, {layers + 1} in the folder (the teacher's weights must "
        "fit the model folder its run recorded: restore that folder, or distill from another "
        "checkpoint)"
    )


def test_a_fresh_run_refuses_a_save_folder_with_another_runs_checkpoints(
    demo: Path, tmp_path: Path
) -> None:
    save = tmp_path / "ckpt"
    for rollout_id in (0, 2):  # the checkpoints of rollouts 1 and 3
        write_checkpoint(save, CheckpointMeta(rollout_id, 8, ("actor",)), {"actor": lambda f: None})
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    err = _refused([*flags, "--save", str(save)], tmp_path)
    assert err.splitlines()[1:] == [
        f"  - checkpoint.save (--save): {save} already holds 2 checkpoint(s) of another run "
        "(rollout_000001 .. rollout_000003), and this run starts afresh: its checkpoints would "
        f"mix with them under one 'latest' (resume that run with --load {save} (without "
        "--finetune), save into a new folder, or add --overwrite-save to remove them)"
    ]
    # --finetune starts afresh too; and --overwrite-save may not remove what --load names.
    err = _refused(
        [*flags, "--save", str(save), "--load", str(save), "--finetune", "--overwrite-save"],
        tmp_path,
    )
    assert (
        f"checkpoint.save (--save): --overwrite-save would remove {save / 'rollout_000003'}, "
        "the checkpoint --load names (save into a new folder)"
    ) in err
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_000001", "rollout_000003"]


@pytest.mark.slow
@pytest.mark.megatron  # a valid model folder: config.json is read by Megatron's validator
def test_load_of_a_checkpoint_at_the_last_rollout(demo: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, CheckpointMeta(2, 12, ("actor",)), {"actor": lambda f: None})
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    err = _refused([*flags, "--load", str(ckpt)], tmp_path)
    assert err == (
        f"error: --load {ckpt}: the checkpoint rollout_000003 is of rollout 3, so training would "
        "start at rollout 4, but --num-rollout is 3: nothing is left to train. Raise "
        "--num-rollout above 3 to train on, or evaluate the checkpoint with --num-rollout 0 "
        f"--load {ckpt}\n"
    )


@pytest.mark.megatron  # a valid model folder: config.json is read by Megatron's validator
def test_prompts_too_long_for_the_model_are_left_out_or_refused(demo: Path, tmp_path: Path) -> None:
    """The demo model has 64 positions: with 16 new tokens, prompts of more than 48 tokens are
    left out when the data is read (said in the log), and a file of nothing else is refused."""
    data = tmp_path / "long.jsonl"
    short, long = "407>", "1" * 60 + ">"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in (short, long)))
    flags = [
        *_flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model")),
        "--rollout-max-response-len",
        "16",
    ]
    elsewhere = ["--output-dir", str(tmp_path / "prepared")]  # (prepare keeps what it made)
    prepared = prepare(load_config([*flags, "--prompt-data", str(data), *elsewhere]))
    assert [p.text for p in prepared.data.train_prompts] == [short]
    assert prepared.notes == (
        f"data: left out 1 of the 2 prompts in {data}: longer than 48 tokens "
        f"(--rollout-max-prompt-len); the first, {data}:2 (62 tokens)",
    )
    err = _refused([*flags, "--prompt-data", str(data), "--rollout-max-prompt-len", "3"], tmp_path)
    assert err.startswith(f"error: DataError: {data}: every prompt is longer than 3 tokens"), err


def test_a_damaged_checkpoint_is_refused_with_the_intact_one_to_load(
    demo: Path, tmp_path: Path
) -> None:
    """A shard cut in half: found before anything starts, the file named, and the newest
    intact checkpoint offered instead."""
    ckpt = tmp_path / "ckpt"

    def shard_of_4_kib(folder: Path) -> None:
        (folder / "shard.distcp").write_bytes(b"w" * 4096)

    for rollout_id in (0, 1):
        write_checkpoint(ckpt, CheckpointMeta(rollout_id, 8, ("actor",)), {"actor": shard_of_4_kib})
    shard = ckpt / "rollout_000002" / "actor" / "shard.distcp"
    shard.write_bytes(b"w" * 2048)
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    err = _refused([*flags, "--load", str(ckpt)], tmp_path)
    assert err.splitlines()[1:] == [
        f"  - checkpoint.load (--load): checkpoint {ckpt / 'rollout_000002'} is damaged: {shard} "
        f"has 2048 bytes, 4096 when it was saved (load the newest intact checkpoint instead: "
        f"--load {ckpt / 'rollout_000001'})"
    ]


@pytest.mark.megatron  # a valid model folder: config.json is read by Megatron's validator
def test_fault_tolerance_without_servers_to_restart_is_refused(demo: Path, tmp_path: Path) -> None:
    """--use-fault-tolerance restarts servers the run launches: the embedded engine (in this
    process) and servers given by --sglang-url are refused before anything starts."""
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    for engine in (
        [],
        ["--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:1"],
    ):
        with pytest.raises(ConfigError) as caught:
            prepare(load_config([*flags, *engine, "--use-fault-tolerance"]))
        message = str(caught.value)
        assert "rollout.use_fault_tolerance (--use-fault-tolerance): the " in message
        assert "runs no server that this run launches" in message
    assert not (tmp_path / "out").exists()  # prepare removes what it made


@contextmanager
def _fake_teacher_server(model_folder: Path) -> Iterator[str]:
    """An HTTP server that answers ``/health`` and says in ``/server_info`` that it serves
    ``model_folder``, as an SGLang server does: enough for the checks before a run starts."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"{}"
            if self.path == "/server_info":
                body = json.dumps({"tokenizer_path": str(model_folder)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_teacher_server_that_cannot_score_the_students_tokens_is_refused(
    demo: Path, tmp_path: Path
) -> None:
    """--opd-type sglang: a server serving a model whose tokenizer is not the student's is
    refused before anything starts, naming the server, its folder and the flag."""
    other = tmp_path / "other"
    shutil.copytree(demo / "model", other)
    (other / "tokenizer.json").write_text('{"version": "a different tokenizer"}')
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    with _fake_teacher_server(other) as url:
        served = ["--use-opd", "--opd-type", "sglang", "--opd-teacher-url", url]
        err = _refused([*flags, *served], tmp_path)
    assert (
        f"opd.opd_teacher_url (--opd-teacher-url): the server at {url} serves {other}: "
        f"{other / 'tokenizer.json'} differs from the student's"
    ) in err


def test_a_teacher_server_that_does_not_answer_is_refused(
    demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare_module, "TEACHER_HEALTH_TIMEOUT_S", 1.0)
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    with pytest.raises(ConfigError) as caught:
        prepare(
            load_config([*flags, "--use-opd", "--opd-type", "sglang", "--opd-teacher-url", url])
        )
    message = str(caught.value)
    assert (
        "opd.opd_teacher_url (--opd-teacher-url): the teacher's server does not answer" in message
    )
    assert "python -m sglang.launch_server --model-path TEACHER" in message
    assert not (tmp_path / "out").exists()  # prepare removes what it made


@pytest.mark.megatron  # a valid model folder: config.json is read by Megatron's validator
def test_a_group_filter_is_checked_before_anything_starts(demo: Path, tmp_path: Path) -> None:
    """--dynamic-sampling-filter-path: a function that is not there, and the reward filter with
    --opd-only (where no sample is scored, so it would keep no group)."""
    flags = _flags(demo, tmp_path / "out", "--hf-checkpoint", str(demo / "model"))
    with pytest.raises(ConfigError, match=r"--dynamic-sampling-filter-path"):
        prepare(load_config([*flags, "--dynamic-sampling-filter-path", "rlcore.rollout:nope"]))
    only = ["--use-opd", "--opd-teacher-hf-checkpoint", str(demo / "model"), "--opd-only"]
    reward_filter = ["--dynamic-sampling-filter-path", "rlcore.rollout:check_reward_nonzero_std"]
    with pytest.raises(PlanError, match=r"so it would keep none; drop it"):
        prepare(load_config([*flags, *only, *reward_filter]))
    assert not (tmp_path / "out").exists()  # prepare removes what it made


@pytest.mark.megatron  # the layer count is read by the Megatron backend's own check
def test_more_recomputed_layers_than_the_model_has_are_refused_before_start(
    demo: Path, tmp_path: Path
) -> None:
    recompute = ["--recompute-granularity", "full", "--recompute-method", "block"]
    config = load_config(
        _flags(demo, tmp_path / "out", *recompute, "--recompute-num-layers", "99")
        + ["--hf-checkpoint", str(demo / "model")]
    )
    with pytest.raises(ConfigError) as info:
        prepare_module.preflight(config)
    layers = json.loads((demo / "model" / "config.json").read_text())["num_hidden_layers"]
    assert [str(p) for p in info.value.problems] == [
        f"megatron.recompute_num_layers (--recompute-num-layers): the model has {layers} layers, "
        f"fewer than 99 (set it to at most {layers})"
    ]
    assert not (tmp_path / "out").exists()
