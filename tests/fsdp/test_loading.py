"""The FSDP backend reads a folder's weights straight into its shards (issue #36,
:mod:`rlcore_fsdp.loading`): the model it builds is transformers' ``from_pretrained`` bit for bit
(tied and untied heads, a critic's freshly initialized value head with the same draws, peft's
LoRA adapters, a bf16 folder, a folder of several files, activation checkpointing and CPU
offload), on one rank and as two ranks' shards; the test families all take that path; and the
build never holds a second copy of the weights (peak RSS of the build in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from rlcore.new_model import Sizes, build_model, write_model
from rlcore.specs import ModelSpec, ParallelSpec
from rlcore_fsdp.backend import _load
from rlcore_fsdp.loading import empty_model
from rlcore_fsdp.lora import add_adapters
from rlcore_fsdp.options import FSDPOptions
from tests.fsdp.test_families import CONFIGS
from tests.megatron.helpers import run_two_ranks

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
SEED = 7


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in ("gpt2", "mistral"):  # tied (and GPT-2's Conv1D), untied
        out[family] = tmp_path_factory.mktemp(family)
        write_model(out[family], CONFIGS[family]().to_dict(), seed=3)
    # the same weights in bf16, in three files with an index
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(out["mistral"])
    out["bf16-sharded"] = tmp_path_factory.mktemp("bf16")
    model.to(torch.bfloat16).save_pretrained(out["bf16-sharded"], max_shard_size="20KB")
    return out


def _theirs(folder: Path, role: str, options: FSDPOptions) -> dict[str, torch.Tensor]:
    """What the backend built before this change: from_pretrained (+ peft) after the seed."""
    torch.manual_seed(SEED)
    if role == "critic":
        model: Any = transformers.AutoModelForTokenClassification.from_pretrained(
            folder, dtype=torch.float32, num_labels=1
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if options.lora_rank:
        model = add_adapters(model, options, role == "critic")
    return dict(model.state_dict())


def _ours(folder: Path, role: str, options: FSDPOptions) -> dict[str, torch.Tensor]:
    model, _ = _load(ModelSpec(role, folder, seed=SEED), options)  # type: ignore[arg-type]  # a role string
    return {
        name: t.full_tensor() if isinstance(t, DTensor) else t
        for name, t in model.state_dict().items()
    }


def _assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name].cpu(), tensor), name


@pytest.mark.parametrize(
    ("family", "role", "options"),
    [
        ("gpt2", "actor", FSDPOptions()),
        ("mistral", "actor", FSDPOptions()),
        ("gpt2", "critic", FSDPOptions()),
        ("mistral", "critic", FSDPOptions()),
        ("gpt2", "actor", FSDPOptions(lora_rank=4, lora_alpha=8)),
        ("mistral", "actor", FSDPOptions(lora_rank=4, lora_alpha=8)),
        ("mistral", "critic", FSDPOptions(lora_rank=4, lora_alpha=8)),
        # an embedding's adapters are not linear layers: from_pretrained's path
        ("mistral", "actor", FSDPOptions(lora_rank=4, target_modules=("embed_tokens", "q_proj"))),
        ("mistral", "actor", FSDPOptions(gradient_checkpointing=True, fsdp_cpu_offload=True)),
        ("bf16-sharded", "actor", FSDPOptions()),
    ],
    ids=["gpt2", "mistral", "gpt2-critic", "mistral-critic", "gpt2-lora", "mistral-lora",
         "mistral-lora-critic", "lora-on-embeddings", "checkpointing-offload", "bf16-sharded"],
)  # fmt: skip
def test_the_shards_are_from_pretrained_bit_for_bit(
    folders: dict[str, Path], family: str, role: str, options: FSDPOptions
) -> None:
    _assert_same(_ours(folders[family], role, options), _theirs(folders[family], role, options))


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
def test_the_families_load_into_the_shards(
    family: str, critic: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = CONFIGS[family]()
    if critic and type(config) not in transformers.AutoModelForTokenClassification._model_mapping:
        pytest.skip(f"transformers has no token classifier for {family}")
    folder = tmp_path_factory.mktemp(family)
    write_model(folder, config.to_dict(), seed=3)
    config = transformers.AutoConfig.from_pretrained(folder)
    config.num_labels = 1
    built = empty_model(folder, config, critic, remote=False)
    assert not isinstance(built, str), built


def test_a_folder_transformers_converts_goes_through_from_pretrained(tmp_path: Path) -> None:
    # qwen3_moe's checkpoint holds each expert's weights apart; transformers merges them on load
    sizes = Sizes(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=64)  # fmt: skip
    config = build_model(tmp_path, vocab_size=40, family="qwen3_moe", sizes=sizes)
    reason = empty_model(tmp_path, config, critic=False, remote=False)
    assert reason == "transformers converts Qwen3MoeForCausalLM's checkpoint tensors on load"
    _assert_same(_ours(tmp_path, "actor", FSDPOptions()), _theirs(tmp_path, "actor", FSDPOptions()))


def two_rank_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    for role in ("actor", "critic"):
        spec = ModelSpec(role, Path(folder), seed=SEED, parallel=ParallelSpec(world_size=world))
        model, _ = _load(spec, FSDPOptions())
        local = {n: t.to_local().clone() for n, t in model.state_dict().items()}
        torch.save(local, Path(out) / f"{role}{rank}.pt")
    torch.distributed.destroy_process_group()


def test_two_ranks_hold_the_rows_of_their_shards(folders: dict[str, Path], tmp_path: Path) -> None:
    # GPT-2's 40-row embedding, 3 x 32-row attention, 1-row critic head: uneven and empty shards
    run_two_ranks(two_rank_worker, str(folders["gpt2"]), str(tmp_path))
    for role in ("actor", "critic"):
        theirs = _theirs(folders["gpt2"], role, FSDPOptions())
        ranks = [torch.load(tmp_path / f"{role}{r}.pt") for r in range(2)]
        for name, tensor in theirs.items():
            got = torch.cat([ranks[0][name], ranks[1][name]]) if tensor.ndim else ranks[0][name]
            assert torch.equal(got, tensor), (role, name)


_MEASURE = """
import json, resource, sys, torch
from pathlib import Path
from rlcore.specs import ModelSpec
from rlcore_fsdp.backend import _load
from rlcore_fsdp.options import FSDPOptions
import transformers, peft  # imported before the baseline, as the build imports them
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model, _ = _load(ModelSpec("actor", Path(sys.argv[1])), FSDPOptions())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"held": (peak - base) * 1024, "weights": params * 4}))
"""


def test_the_build_holds_the_weights_once(tmp_path: Path) -> None:
    """The build's peak RSS above its imports is about the weights once (fp32 ~50M, 200 MB),
    where from_pretrained then fully_shard held them about twice."""
    sizes = Sizes(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4,
                  intermediate_size=1024)  # fmt: skip
    build_model(tmp_path, vocab_size=48000, sizes=sizes)  # untied: 2 x 24.6M in the root
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["held"] < 1.35 * got["weights"], got
