from collections.abc import Iterable
from typing import ClassVar

class SamplingParams:
    """The ``sampling_params`` of ``/generate`` (a ``msgspec.Struct``; keyword-only)."""

    __struct_fields__: ClassVar[tuple[str, ...]]
    max_new_tokens: int | None
    stop_token_ids: set[int] | None
    temperature: float
    top_p: float
    top_k: int
    skip_special_tokens: bool
    ignore_eos: bool
    def __init__(
        self,
        *,
        max_new_tokens: int | None = ...,
        stop_token_ids: Iterable[int] | None = ...,
        temperature: float = ...,
        top_p: float = ...,
        top_k: int = ...,
        min_p: float = ...,
        frequency_penalty: float = ...,
        presence_penalty: float = ...,
        repetition_penalty: float = ...,
        min_new_tokens: int = ...,
        n: int = ...,
        ignore_eos: bool = ...,
        skip_special_tokens: bool = ...,
        no_stop_trim: bool = ...,
        sampling_seed: int | None = ...,
    ) -> None: ...
    def verify(self, vocab_size: int) -> None: ...
