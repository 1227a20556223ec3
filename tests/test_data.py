"""Prompt files, the tokenizer protocol and the resumable prompt sampler."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.data.prompts import load_eval_sets, load_prompts
from rlcore.data.sampler import PromptSampler
from rlcore.errors import DataError
from rlcore.protocols.tokenizer import ChatTokenizer, Tokenizer
from rlcore.samples import Prompt

ALPHABET = "0123456789+= "


class CharTokenizer:
    """bench-tiny's tokenizer in plain Python: <pad>=0, <bos>=1, <eos>=2, then the alphabet."""

    pad_token_id = 0
    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [1] + [3 + ALPHABET.index(c) for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(ALPHABET[i - 3] for i in token_ids if i >= 3)


class ChatCharTokenizer(CharTokenizer):
    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return "".join(m["content"] for m in messages) + "="

    def encode_rendered(self, text: str) -> list[int]:
        return [3 + ALPHABET.index(c) for c in text]


def write_jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_protocols_are_satisfied_structurally() -> None:
    assert isinstance(CharTokenizer(), Tokenizer)
    assert not isinstance(CharTokenizer(), ChatTokenizer)
    assert isinstance(ChatCharTokenizer(), ChatTokenizer)


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"input": "12+34=", "label": "46"}\n\n{"input": "1+1=", "label": 2, "extra": [1]}\n',
        encoding="utf-8",
    )
    prompts = load_prompts(path, tokenizer=CharTokenizer())
    assert prompts == (
        Prompt(
            index=0,
            text="12+34=",
            token_ids=(1, 4, 5, 13, 6, 7, 14),
            label="46",
            target_token_ids=(7, 9, 2),
        ),
        Prompt(
            index=1, text="1+1=", token_ids=(1, 4, 13, 4, 14), label="2", target_token_ids=(5, 2)
        ),
    )


def test_custom_keys_and_no_label(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1=", "answer": "1"}])
    (p,) = load_prompts(path, tokenizer=CharTokenizer(), input_key="prompt", label_key="answer")
    assert (p.text, p.label) == ("1=", "1")
    (p,) = load_prompts(path, tokenizer=CharTokenizer(), input_key="prompt", label_key=None)
    assert p.label == ""


def test_load_parquet(tmp_path: Path) -> None:
    # Imported, not importorskip'd: pyarrow is a test dependency, and a missing one must fail.
    import pyarrow as pa  # type: ignore[import-untyped]  # pyarrow ships no type information
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # likewise

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"input": ["1+2=", "3="], "label": ["3", "3"]}), path)
    prompts = load_prompts(path, tokenizer=CharTokenizer())
    assert [(p.index, p.text, p.label) for p in prompts] == [(0, "1+2=", "3"), (1, "3=", "3")]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"input": ["1=", None], "label": ["1", "2"]}), bad)
    with pytest.raises(DataError, match=r"bad\.parquet:row 2: 'input' must be a string"):
        load_prompts(bad, tokenizer=CharTokenizer())

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot read as Parquet"):
        load_prompts(broken, tokenizer=CharTokenizer())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"input": "1=", "label": "1"}\n{"input": "2=", "label": \n',
            r"p\.jsonl:2: not valid JSON",
        ),
        ('{"input": "1=", "label": "1"}\n\n{"label": "1"}\n', r"p\.jsonl:3: missing key 'input'"),
        ('{"input": "1="}\n', r"p\.jsonl:1: missing key 'label'.*--label-key"),
        ('{"input": 12, "label": "1"}\n', r"p\.jsonl:1: 'input' must be a string, got int"),
        ('{"input": ["1"], "label": "1"}\n', r"p\.jsonl:1: 'input' must be a string, got list"),
        ('{"input": "1=", "label": true}\n', r"p\.jsonl:1: 'label' must be a string or a number"),
        ('["1=", "1"]\n', r"p\.jsonl:1: expected a JSON object, got list"),
        ("", r"p\.jsonl: the file holds no prompts"),
        ("\n  \n", r"p\.jsonl: the file holds no prompts"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=message):
        load_prompts(path, tokenizer=CharTokenizer())


def test_non_utf8_names_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"input": "1=", "label": "1"}\n{"input": "\xff"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not UTF-8"):
        load_prompts(path, tokenizer=CharTokenizer())


def test_unknown_extension_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"p\.csv: unknown prompt file extension '\.csv'.*\.jsonl"):
        load_prompts(tmp_path / "p.csv", tokenizer=CharTokenizer())
    with pytest.raises(DataError, match=r"nope\.jsonl: cannot open prompt file"):
        load_prompts(tmp_path / "nope.jsonl", tokenizer=CharTokenizer())


def test_chat_template(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"input": "1+1", "label": "2"},
            {
                "input": [{"role": "user", "content": "2"}, {"role": "user", "content": "+3"}],
                "label": "5",
            },
        ],
    )
    a, b = load_prompts(path, tokenizer=ChatCharTokenizer(), apply_chat_template=True)
    assert (a.text, a.token_ids) == ("1+1=", (4, 13, 4, 14))  # no bos added by encode_rendered
    assert (b.text, b.token_ids) == ("2+3=", (5, 13, 6, 14))

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input": [{"role": "user"}], "label": "1"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: .*message list"):
        load_prompts(bad, tokenizer=ChatCharTokenizer(), apply_chat_template=True)
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        load_prompts(path, tokenizer=CharTokenizer(), apply_chat_template=True)  # type: ignore[call-overload]  # the point of the test


def test_load_eval_sets(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": "1=", "label": "1"}])
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"input": "2=", "label": "2"}, {"input": "3=", "label": "3"}]
    )
    sets = load_eval_sets([("a", a), ("b", b)], tokenizer=CharTokenizer())
    assert [(s.name, len(s.prompts)) for s in sets] == [("a", 1), ("b", 2)]
    with pytest.raises(DataError, match="'a' is used twice"):
        load_eval_sets([("a", a), ("a", b)], tokenizer=CharTokenizer())


def test_hf_tokenizer_adapter(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from rlcore.testing.tiny import build_char_tokenizer

    build_char_tokenizer(tmp_path, ALPHABET)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    tok = HFTokenizer(hf)
    assert isinstance(tok, ChatTokenizer)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    assert tok.encode("12+34=") == [1, 4, 5, 13, 6, 7, 14]
    assert tok.decode([1, 4, 5, 2, 0]) == "12"
    with pytest.raises(DataError, match="cannot apply the chat template"):
        tok.render_chat([{"role": "user", "content": "1"}])
    hf.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}="
    assert tok.render_chat([{"role": "user", "content": "1+2"}]) == "1+2="
    assert tok.encode_rendered("1=") == [4, 14]
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "12+34=", "label": "46"}])
    assert load_prompts(path, tokenizer=tok)[0].token_ids == (1, 4, 5, 13, 6, 7, 14)


def _prompts(n: int) -> tuple[Prompt, ...]:
    return tuple(Prompt(index=i, text=str(i), token_ids=(1,)) for i in range(n))


def test_sampler_epochs_are_seeded_permutations() -> None:
    prompts = _prompts(10)
    sampler = PromptSampler(prompts, batch_size=5, seed=3)
    epoch0 = sampler.next_batch() + sampler.next_batch()
    epoch1 = sampler.next_batch() + sampler.next_batch()
    assert sorted(p.index for p in epoch0) == list(range(10))
    assert sorted(p.index for p in epoch1) == list(range(10))
    assert epoch0 != epoch1  # reshuffled per epoch
    assert sampler.consumed == 20 and sampler.epoch == 2
    again = PromptSampler(prompts, batch_size=10, seed=3)
    assert again.next_batch() == epoch0  # the order depends on (seed, epoch), not on batch size
    assert PromptSampler(prompts, batch_size=10, seed=4).next_batch() != epoch0


def test_sampler_wraps_around_an_epoch_boundary() -> None:
    prompts = _prompts(5)
    sampler = PromptSampler(prompts, batch_size=3, seed=0)
    order0 = [prompts[i] for i in sampler.epoch_order(0)]
    order1 = [prompts[i] for i in sampler.epoch_order(1)]
    assert sampler.next_batch() == tuple(order0[:3])
    # 2 prompts left in epoch 0: the batch takes them, then the first of epoch 1's order.
    assert sampler.next_batch() == (order0[3], order0[4], order1[0])
    assert sampler.next_batch() == tuple(order1[1:4])
    assert sampler.consumed == 9 and sampler.epoch == 1


def test_sampler_batch_larger_than_dataset_spans_epochs() -> None:
    prompts = _prompts(2)
    sampler = PromptSampler(prompts, batch_size=5, seed=1)
    batch = sampler.next_batch()
    expected = [prompts[i] for e in range(3) for i in sampler.epoch_order(e)][:5]
    assert list(batch) == expected
    assert sampler.consumed == 5


def test_sampler_rejects_bad_arguments() -> None:
    with pytest.raises(DataError, match="no prompts"):
        PromptSampler((), batch_size=1, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(_prompts(3), batch_size=0, seed=0)
    with pytest.raises(ValueError, match="consumed"):
        PromptSampler(_prompts(3), batch_size=1, seed=0, consumed=-1)


@given(
    n=st.integers(1, 12),
    batch_size=st.integers(1, 15),
    seed=st.integers(0, 2**32),
    stop_after=st.integers(0, 8),
    follow=st.integers(1, 6),
)
def test_resuming_from_consumed_continues_the_same_stream(
    n: int, batch_size: int, seed: int, stop_after: int, follow: int
) -> None:
    prompts = _prompts(n)
    uninterrupted = PromptSampler(prompts, batch_size, seed)
    expected = list(itertools.islice(uninterrupted, stop_after + follow))[stop_after:]

    first = PromptSampler(prompts, batch_size, seed)
    for _ in range(stop_after):
        first.next_batch()
    resumed = PromptSampler(prompts, batch_size, seed, consumed=first.consumed)
    assert [resumed.next_batch() for _ in range(follow)] == expected
    assert resumed.consumed == (stop_after + follow) * batch_size


@given(n=st.integers(1, 12), batch_size=st.integers(1, 15), seed=st.integers(0, 2**32))
def test_every_epoch_shows_each_prompt_once(n: int, batch_size: int, seed: int) -> None:
    sampler = PromptSampler(_prompts(n), batch_size, seed)
    stream = [p.index for batch in itertools.islice(sampler, 3 * n) for p in batch]
    for e in range(3):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))


def test_labels_become_sft_targets_in_context(tmp_path: Path) -> None:
    from rlcore.testing.tiny import build_char_tokenizer

    hf = build_char_tokenizer(tmp_path / "tok", "0123456789>")
    from rlcore.data.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(hf)
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "123>", "label": "321"}\n{"input": "9>", "label": ""}\n')
    first, unlabelled = load_prompts(path, tokenizer=tokenizer)
    assert first.target_token_ids == (*tokenizer.encode("321")[1:], tokenizer.eos_token_id)
    assert tokenizer.decode(first.token_ids + first.target_token_ids) == "123>321"
    assert unlabelled.target_token_ids == ()


def test_a_character_the_tokenizer_cannot_encode_is_named_with_its_line(tmp_path: Path) -> None:
    """A word-level vocabulary without an unknown token raises a bare ``Exception`` (it ended a
    run with a raw traceback); reading the data names the file, line, key and character."""
    from rlcore.data.hf_tokenizer import HFTokenizer
    from rlcore.testing.tiny import build_char_tokenizer

    tokenizer = HFTokenizer(build_char_tokenizer(tmp_path / "tok", "0123456789>"))
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "12>", "label": "21"}\n{"input": "4é>", "label": "4"}\n')
    with pytest.raises(DataError) as info:
        load_prompts(path, tokenizer=tokenizer)
    assert str(info.value).startswith(
        f"{path}:2: the tokenizer cannot encode 'input': 'é' (U+00E9) at character 2 (Exception: "
    )
    assert "remove the character from the data" in str(info.value)
    path.write_text('{"input": "12>", "label": "2x"}\n')
    with pytest.raises(
        DataError, match=r":1: the tokenizer cannot encode 'label': 'x' \(U\+0078\) at character 2"
    ):
        load_prompts(path, tokenizer=tokenizer)


def test_prompts_longer_than_the_limit_are_left_out_and_counted(tmp_path: Path) -> None:
    from rlcore.data.hf_tokenizer import HFTokenizer
    from rlcore.testing.tiny import build_char_tokenizer

    tokenizer = HFTokenizer(build_char_tokenizer(tmp_path / "tok", "0123456789>"))
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "12>"}\n{"input": "123456>"}\n{"input": "9>"}\n')
    dropped: list[str] = []
    kept = load_prompts(
        path, tokenizer=tokenizer, label_key=None, max_prompt_len=4, dropped=dropped
    )
    assert [p.text for p in kept] == ["12>", "9>"] and [p.index for p in kept] == [0, 1]
    assert dropped == [f"{path}:2 (8 tokens)"]  # <bos> and 7 characters
    with pytest.raises(DataError, match=r"every prompt is longer than 2 tokens \(the first: "):
        load_prompts(path, tokenizer=tokenizer, label_key=None, max_prompt_len=2)
