"""The prompt stream: batches of prompts, epoch after epoch, each epoch in its own seeded order.

:class:`PromptSampler` keeps its whole position in one integer, ``consumed``, so a checkpoint that
records it resumes the prompt stream exactly where it stopped. It is the run's
:class:`~rlcore.protocols.rollout.PromptSource`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import final

from rlcore.errors import DataError
from rlcore.samples import Prompt

__all__ = ["PromptSampler"]


@final
class PromptSampler:
    """Hands out batches of prompts, epoch after epoch, each epoch in its own seeded order.

    The stream is the concatenation of the epoch orders: epoch ``e`` is a shuffle of all prompts
    seeded by ``(seed, e)``. ``next_batch`` returns the next ``batch_size`` prompts of that stream.
    **Wrap-around:** a batch that runs past the end of an epoch is completed with the first prompts
    of the next epoch's order (as slime does), so no prompt is dropped and every epoch shows each
    prompt exactly once; such a batch can hold a prompt twice when ``batch_size`` is close to or
    above the number of prompts.

    ``consumed`` (prompts handed out so far) is the whole state: ``PromptSampler(prompts,
    batch_size, seed, consumed=n)`` continues exactly where a sampler that had handed out ``n``
    prompts stopped.
    """

    def __init__(
        self, prompts: Sequence[Prompt], batch_size: int, seed: int, consumed: int = 0
    ) -> None:
        if not prompts:
            raise DataError("PromptSampler: no prompts to sample from; check the prompt data")
        if batch_size < 1:
            raise ValueError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        if consumed < 0:
            raise ValueError(f"PromptSampler: consumed must be >= 0, got {consumed}")
        self._prompts = tuple(prompts)
        self._batch_size = batch_size
        self._seed = seed
        self._consumed = consumed
        self._order_epoch = -1
        self._order: tuple[int, ...] = ()

    @property
    def consumed(self) -> int:
        """How many prompts have been handed out: the state a checkpoint records."""
        return self._consumed

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0-based)."""
        return self._consumed // len(self._prompts)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """The positions of the prompts in epoch ``epoch``'s order (a permutation)."""
        if epoch != self._order_epoch:
            order = list(range(len(self._prompts)))
            # A string seed is hashed with SHA-512 by ``random``: stable across processes and
            # Python versions, and (seed, epoch) pairs never collide as seed + epoch would.
            random.Random(f"rlcore.PromptSampler:{self._seed}:{epoch}").shuffle(order)
            self._order_epoch, self._order = epoch, tuple(order)
        return self._order

    def next_batch(self) -> tuple[Prompt, ...]:
        """The next ``batch_size`` prompts; advances ``consumed`` by ``batch_size``."""
        return self.take(self._batch_size)

    def take(self, count: int) -> tuple[Prompt, ...]:
        """The next ``count`` prompts of the stream (dynamic sampling takes rounds of any size);
        advances ``consumed`` by ``count``. Satisfies
        :class:`~rlcore.protocols.rollout.PromptSource`."""
        if count < 0:
            raise ValueError(f"PromptSampler.take: count must be >= 0, got {count}")
        n = len(self._prompts)
        batch: list[Prompt] = []
        position = self._consumed
        while len(batch) < count:
            epoch, offset = divmod(position, n)
            take = min(count - len(batch), n - offset)
            order = self.epoch_order(epoch)
            batch.extend(self._prompts[i] for i in order[offset : offset + take])
            position += take
        self._consumed = position
        return tuple(batch)

    def __iter__(self) -> Iterator[tuple[Prompt, ...]]:
        """Endless batches (``itertools.islice`` it)."""
        while True:
            yield self.next_batch()
