"""What the engine sends, checked with SGLang's own parsers (in-process, no server)."""

from __future__ import annotations

import pytest
import torch

from rlcore.samples import SamplingParams
from rlcore_sglang.generate import sampling_payload
from rlcore_sglang.weight_sync.tensor import pickle_b64

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8),
        SamplingParams(max_new_tokens=8, temperature=0.0),
        SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(2,)),
        SamplingParams(max_new_tokens=4, ignore_eos=True),
    ],
)
def test_sampling_params_are_accepted_by_sglang(params: SamplingParams) -> None:
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    payload = sampling_payload(params, {})
    # A dict[str, object] of keys the stub lists; their values are checked by SGLang itself.
    theirs = SGLangSamplingParams(**payload)  # type: ignore[arg-type]  # see above
    theirs.verify(vocab_size=42)
    assert theirs.max_new_tokens == params.max_new_tokens
    assert theirs.top_p == params.top_p
    assert set(theirs.stop_token_ids or ()) == set(params.stop_token_ids)
    assert theirs.ignore_eos == params.ignore_eos
    if params.temperature == 0.0:
        assert theirs.top_k == 1  # SGLang's spelling of greedy
    else:
        assert theirs.temperature == params.temperature
        # rlcore's "off" (0) must reach SGLang as "all tokens", never as "top-0".
        assert theirs.top_k == params.top_k if params.top_k else theirs.top_k >= 2**20


def test_tensor_payload_passes_sglang_safe_unpickler() -> None:
    from sglang.srt.utils.common import MultiprocessingSerializer

    # torch leaves set_sharing_strategy and share_memory_ unannotated.
    set_strategy = torch.multiprocessing.set_sharing_strategy
    set_strategy("file_system")  # type: ignore[no-untyped-call]  # see above
    buffer = torch.arange(12, dtype=torch.float32)
    buffer.share_memory_()  # type: ignore[no-untyped-call]  # see above
    named = [("a.weight", buffer[:6].view(2, 3)), ("b.bias", buffer[6:])]
    decoded = MultiprocessingSerializer.deserialize(pickle_b64(named))
    assert isinstance(decoded, list)
    assert [name for name, _ in decoded] == ["a.weight", "b.bias"]
    for (_, ours), (_, theirs) in zip(named, decoded, strict=True):
        assert torch.equal(ours, theirs)


def test_this_environment_runs_the_sglang_the_engine_targets() -> None:
    import sglang

    assert sglang.__version__.startswith("0.5."), sglang.__version__


def test_sampling_params_stub_names_real_fields() -> None:
    """stubtest cannot read a msgspec.Struct's C-generated __init__ (stubs/sglang-allowlist.txt),
    so the stub's keyword-only parameters are checked against the struct's fields here."""
    import ast
    import pathlib

    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    stub = pathlib.Path(__file__).parents[2] / "stubs/sglang/srt/sampling/sampling_params.pyi"
    (cls,) = [
        node
        for node in ast.parse(stub.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "SamplingParams"
    ]
    (init,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    declared = {arg.arg for arg in init.args.kwonlyargs}
    attributes = {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and not n.target.id.startswith("__")
    }
    fields = set(SGLangSamplingParams.__struct_fields__)
    assert declared and declared <= fields, declared - fields
    assert attributes <= fields, attributes - fields
