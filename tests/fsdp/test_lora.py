"""LoRA on the FSDP backend (``--lora-rank``): only the adapters train (the base weights stay the
folder's, bit for bit), the engine gets the merged weights under the base model's names (what
peft's ``merge_and_unload`` gives), ``--save-hf`` writes a merged model that transformers loads
with the stack's log-probs and an adapter folder peft loads, a checkpoint holds the adapters and
their AdamW state and resumes exactly, the reference is the actor's base with the adapters
disabled (no second copy of the weights, in process and in the actor's Ray actors), a critic
trains its adapters and its value head, and the flags are checked before start."""

from __future__ import annotations

import random
import re
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.tensor import DTensor

from rlcore.config.flags import load_config
from rlcore.errors import CheckpointError, ConfigError
from rlcore.samples import ForwardRows, Sample, TrainBatch
from rlcore.specs import EvalSpec
from rlcore.testing.tiny import build_tiny_llama
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.lora import is_adapter, value_head
from rlcore_fsdp.options import FSDPOptions
from rlcore_fsdp.stacks import ADAPTER_FOLDER, FSDPBaseView, full_tensors
from tests.megatron.helpers import (
    TINY,
    assert_same_step,
    make_batch,
    make_samples,
    run_two_ranks,
    sent_weights,
    train_spec,
    weights,
)

LORA = FSDPOptions(lora_rank=4, lora_alpha=8)

# peft asks transformers for a property this transformers version deprecates (loading the folder)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_llama(folder, **{**TINY, "tie_word_embeddings": True})
    return folder


def _log_probs(model: torch.nn.Module, samples: list, vocab: int) -> list[list[float]]:  # type: ignore[type-arg]  # Sample list
    out = []
    for s in samples:
        tokens = torch.tensor([[*s.prompt.token_ids, *s.response.token_ids]])
        logits = model(input_ids=tokens).logits.float()[0, :-1].log_softmax(-1)
        picked = logits.gather(-1, tokens[0, 1:, None])[:, 0]
        out.append(picked[-len(s.response.token_ids) :].tolist())
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_only_the_adapters_train_and_the_engine_gets_peft_s_merge(
    llama: Path, tmp_path: Path, checkpointing: bool
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    samples = make_samples(4, seed=7)
    options = attrs.evolve(LORA, gradient_checkpointing=checkpointing)
    stack = FSDPBackend(options).build_training_stack(train_spec(llama))
    trained = {n for n, p in stack.model.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(n) for n in trained)
    in_optimizer = {id(p) for g in stack.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in stack.model.parameters() if p.requires_grad}
    before = {n: t.clone() for n, t in full_tensors(stack.model)}
    for seed in (8, 9):
        stack.train_step(make_batch(samples, seed=seed, rollout=True))
    after = dict(full_tensors(stack.model))
    assert after.keys() == before.keys()
    for name in before:
        if is_adapter(name):
            assert ".lora_A." in name or not torch.equal(after[name], before[name]), name
        else:
            assert torch.equal(after[name], before[name]), name  # the base, bit for bit

    sent = sent_weights(stack)
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    assert sent.keys() == set(base.state_dict()) - {"lm_head.weight"}  # tied: sent once

    stack.save_hf(tmp_path / "hf")
    adapter = tmp_path / "hf" / ADAPTER_FOLDER
    peft_model = PeftModel.from_pretrained(base, adapter)
    for name, tensor in load_file(str(adapter / "adapter_model.safetensors")).items():
        assert not tensor.eq(0).all() or ".lora_B." not in name  # trained adapters were saved
    expected = peft_model.merge_and_unload().state_dict()
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    got = _log_probs(merged, samples, TINY["vocab_size"])
    for g, want in zip(got, stack.forward(samples), strict=True):
        assert g == pytest.approx(want, abs=1e-5)


def test_reference_is_the_base_and_a_checkpoint_resumes_exactly(
    llama: Path, tmp_path: Path
) -> None:
    samples = make_samples(4, seed=3)
    batches = [make_batch(samples, seed=s, rollout=True) for s in (1, 2, 3)]
    spec = train_spec(llama)
    backend = FSDPBackend(LORA)
    straight = backend.build_training_stack(spec)
    reference = backend.build_eval_stack(EvalSpec(train_spec(llama, "reference").model))
    plain = FSDPBackend().build_eval_stack(EvalSpec(spec.model))
    assert reference.forward(samples) == plain.forward(samples)
    assert straight.forward(samples) == plain.forward(samples)  # B = 0: the base at the start
    for batch in batches:
        straight.train_step(batch)

    first = FSDPBackend(LORA).build_training_stack(spec)
    first.train_step(batches[0])
    first.save(tmp_path / "ckpt", rollout_id=0)
    held = FileSystemReader(tmp_path / "ckpt" / "model").read_metadata().state_dict_metadata
    assert held and all(is_adapter(name) for name in held)  # the adapters, not the base
    resumed = FSDPBackend(LORA).build_training_stack(spec)
    assert resumed.load(tmp_path / "ckpt") == 0
    for batch in batches[1:]:
        resumed.train_step(batch)
    a, b = dict(full_tensors(straight.model)), dict(full_tensors(resumed.model))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert reference.forward(samples) != straight.forward(samples)

    with pytest.raises(CheckpointError, match="lora is None there"):  # not LoRA's
        FSDPBackend(LORA).build_training_stack(spec).load(_full_checkpoint(llama, tmp_path))
    with pytest.raises(CheckpointError, match="lora is .'rank': 4.* there, None here"):
        FSDPBackend().build_training_stack(spec).load(tmp_path / "ckpt")


def _local_storage(model: torch.nn.Module, base: bool) -> set[int]:
    """Where this rank's shards of the base weights (or of the adapters) lie."""
    return {
        (p.to_local() if isinstance(p, DTensor) else p).data_ptr()
        for n, p in model.named_parameters()
        if is_adapter(n) != base
    }


def test_the_reference_is_the_actor_s_base_with_the_adapters_off_not_a_copy(
    llama: Path, tmp_path: Path
) -> None:
    """In process: the backend that built the LoRA actor gives the reference as a view of the
    actor's model (its base weights' storage, no second copy) whose log-probs are the base
    model's as transformers computes them, before and after steps that moved the adapters; its
    ``load`` takes a LoRA checkpoint's rollout id and changes nothing."""
    from transformers import AutoModelForCausalLM

    samples = make_samples(4, seed=11)
    backend = FSDPBackend(LORA)
    actor = backend.build_training_stack(train_spec(llama))
    reference = backend.build_eval_stack(EvalSpec(train_spec(llama, "reference").model))
    assert isinstance(reference, FSDPBaseView)
    assert reference.kind == "eval" and not hasattr(reference, "optimizer")
    assert _local_storage(reference.model, base=True) == _local_storage(actor.model, base=True)
    in_optimizer = {p.data_ptr() for g in actor.optimizer.param_groups for p in g["params"]}
    assert not in_optimizer & _local_storage(reference.model, base=True)

    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    want = _log_probs(base, samples, TINY["vocab_size"])
    for seed in (None, 1, 2, 3):
        if seed is not None:
            actor.train_step(make_batch(samples, seed=seed, rollout=True))
        for got, expected in zip(reference.forward(samples), want, strict=True):
            assert got == pytest.approx(expected, abs=1e-5)
    moved = actor.forward(samples)
    assert any(m != pytest.approx(w, abs=1e-3) for m, w in zip(moved, want, strict=True))
    sent = {n: t.clone() for n, t in reference.export_weights()}
    assert sent.keys() == set(base.state_dict()) - {"lm_head.weight"}  # tied: sent once
    assert all(torch.equal(t, base.state_dict()[n]) for n, t in sent.items())

    actor.save(tmp_path / "ckpt", rollout_id=2)
    assert reference.load(tmp_path / "ckpt") == 2
    for got, expected in zip(reference.forward(samples), want, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
    with pytest.raises(CheckpointError, match="holds full weights, not LoRA adapters"):
        reference.load(_full_checkpoint(llama, tmp_path))


def _full_checkpoint(llama: Path, tmp_path: Path) -> Path:
    FSDPBackend().build_training_stack(train_spec(llama)).save(tmp_path / "full", rollout_id=0)
    return tmp_path / "full"


def test_bf16_trains_the_adapters_over_fp32_weights_and_sends_bf16(llama: Path) -> None:
    stack = FSDPBackend(LORA).build_training_stack(train_spec(llama, precision="bfloat16"))
    before = {n: t.clone() for n, t in full_tensors(stack.model)}
    samples = make_samples(4, seed=5)
    for seed in (1, 2):
        stack.train_step(make_batch(samples, seed=seed, rollout=True))
    after = dict(full_tensors(stack.model))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(is_adapter(n) for n in changed)
    assert all(t.dtype == torch.float32 for t in after.values())  # master weights
    assert {t.dtype for t in sent_weights(stack).values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0"),
        (["--lora-rank", "4", "--lora-dropout", "0.1"], "--lora-dropout must be 0"),
        (["--target-modules", "all-linear", "--target-modules", "q_proj"], "stands alone"),
        (["--train-backend", "megatron", "--lora-rank", "4"], "add --train-backend fsdp"),
    ],
)
def test_lora_flags_are_checked_before_start(flags: list[str], says: str) -> None:
    base = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--num-rollout", "1"]
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(base + flags)


def test_lora_flags_reach_the_options() -> None:
    flags = ["--train-backend", "fsdp", "--hf-checkpoint", "m", "--num-rollout", "1"]
    config = load_config(
        [*flags, "--lora-rank", "8", "--target-modules", "q_proj", "--target-modules", "v_proj"]
    )
    assert config.model.backend_options == FSDPOptions(
        lora_rank=8, target_modules=("q_proj", "v_proj")
    )


def _critic_batch(samples: list[Sample], values: ForwardRows, seed: int) -> TrainBatch:
    rng = random.Random(seed)
    returns = tuple(tuple(rng.uniform(0.5, 1.5) for _ in s.response.token_ids) for s in samples)
    old = tuple(tuple(v) for v in values)
    return TrainBatch(samples=tuple(samples), advantages=returns, returns=returns, old_values=old)


def test_a_lora_critic_trains_its_adapters_and_its_value_head_and_resumes_exactly(
    llama: Path, tmp_path: Path
) -> None:
    """With ``--lora-rank`` the critic gets adapters too, and its value head (new, drawn at
    random) no adapter but full training: only those change, the backbone stays the folder's bit
    for bit, the values start as the full critic's, and a checkpoint (the adapters and the head)
    resumes exactly."""
    spec = train_spec(llama, "critic", global_batch_size=4, micro_batch_size=2)
    samples = make_samples(4, seed=5)
    critic = FSDPBackend(LORA).build_training_stack(spec)
    inner = critic.model.get_submodule("base_model.model")  # the token classifier in peft
    assert value_head(inner) == ["score"]
    assert type(inner.score) is torch.nn.Linear  # no adapter on the head
    trained = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    head = {n for n in trained if not is_adapter(n)}
    assert head == {f"base_model.model.score.{leaf}" for leaf in ("weight", "bias")}
    assert len(trained) > len(head)
    in_optimizer = {id(p) for g in critic.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in critic.model.parameters() if p.requires_grad}
    full = FSDPBackend().build_training_stack(spec)
    assert critic.forward(samples) == full.forward(samples)  # B = 0, the same head drawn

    before = {n: t.clone() for n, t in full_tensors(critic.model)}
    batches = [_critic_batch(samples, critic.forward(samples), seed) for seed in (1, 2, 3)]
    losses = [critic.train_step(batches[0]).loss, critic.train_step(batches[0]).loss]
    assert losses[1] < losses[0]
    after = dict(full_tensors(critic.model))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert head < changed and all(is_adapter(n) for n in changed - head)  # base bit for bit
    assert any(".lora_B." in n for n in changed)

    first = FSDPBackend(LORA).build_training_stack(spec)
    first.train_step(batches[0])
    first.save(tmp_path / "ckpt", rollout_id=0)
    held = set(FileSystemReader(tmp_path / "ckpt" / "model").read_metadata().state_dict_metadata)
    assert head < held and all(is_adapter(n) for n in held - head)  # not the base
    resumed = FSDPBackend(LORA).build_training_stack(spec)
    assert resumed.load(tmp_path / "ckpt") == 0
    for batch in batches[1:]:
        first.train_step(batch)
        resumed.train_step(batch)
    a, b = dict(full_tensors(first.model)), dict(full_tensors(resumed.model))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(CheckpointError, match="lora is .'rank': 4.* there, None here"):
        full.load(tmp_path / "ckpt")


@pytest.mark.slow
def test_two_ranks_train_the_adapters_as_one_and_their_checkpoint_loads_into_one(
    tmp_path: Path,
) -> None:
    """GPT-2 (its Conv1D layers hold transposed weights, peft's ``fan_in_fan_out``) with LoRA on
    two gloo ranks: the merged weights sent after the step are one process's, and the adapters'
    checkpoint loads into one process (DCP reshards it)."""
    from tests.fsdp import multirank_worker
    from tests.fsdp.test_two_ranks import batch_and_spec, gpt2_folder

    folder = gpt2_folder(tmp_path / "gpt2")
    run_two_ranks(multirank_worker.run, str(folder), str(tmp_path), 4, timeout=300)
    sent: dict[str, torch.Tensor] = torch.load(tmp_path / "rank0.pt")["sent"]
    batch, spec = batch_and_spec(folder)
    one = FSDPBackend(FSDPOptions(lora_rank=4)).build_training_stack(spec)
    before = weights(one.export_weights())
    one.train_step(batch)
    expected = weights(one.export_weights())
    assert sent.keys() == expected.keys()
    assert any(not torch.equal(expected[n], before[n]) for n in expected)
    for name, tensor in expected.items():
        assert_same_step(sent[name], tensor, before[name], name)

    loaded = FSDPBackend(FSDPOptions(lora_rank=4)).build_training_stack(spec)
    assert loaded.load(tmp_path / "ckpt") == 3
    assert weights(loaded.export_weights()).keys() == sent.keys()
    assert all(torch.equal(t, sent[n]) for n, t in weights(loaded.export_weights()).items())
