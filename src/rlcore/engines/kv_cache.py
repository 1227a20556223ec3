"""The embedded engine's KV cache: preallocated once per batch, written in place, rows droppable.

transformers' ``DynamicCache`` grows each layer's keys and values by concatenation, so every decode
step copies the whole cache: the cost of a token grows with the answer. ``StaticCache`` writes in
place but hands attention its full preallocated length at every step, so a step costs as much as
the last one. :class:`DecodeCache` does neither: each full-attention layer owns one buffer
``Tensor[rows, kv_heads, capacity, head_dim]`` sized to the prompt plus ``max_new_tokens``, a step
writes its new position into it, and attention reads the view ``[:, :, :length]`` of the positions
written so far. :meth:`DecodeCache.keep_rows` drops finished rows by copying the live rows' filled
positions into a smaller buffer, so a batch whose answers mostly stop early stops paying for them.

With ``blocked_keys`` (what the CPU decode kernel in :mod:`rlcore.engines.decode_attention` reads)
a layer stores its keys in blocks of :data:`KEY_BLOCK` positions,
``Tensor[rows, kv_heads, blocks, head_dim, KEY_BLOCK]``, and :meth:`PreallocatedLayer.update` hands
attention that whole 5-d buffer in place of the keys (the values' length says how many positions
hold states); :func:`unblock_keys` turns it back into the usual ``[rows, kv_heads, length,
head_dim]``.

The cache speaks transformers' ``Cache`` API (``update``, ``get_seq_length``, ``get_mask_sizes``),
which every causal LM transformers builds calls from its attention layers, so the engine stays
generic: layers that are not plain full attention (sliding-window, linear-attention, KV-sharing
layers) keep the cache layer transformers made for them, and follow the same row selections.

This module imports torch and transformers; ``import rlcore`` does not import it.
"""

from __future__ import annotations

from typing import Any, cast, final

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

__all__ = ["KEY_BLOCK", "DecodeCache", "PreallocatedLayer", "unblock_keys"]

KEY_BLOCK = 16
"""Positions per key block in the blocked layout (the decode kernel's vector width)."""


def _blocks(positions: int) -> int:
    return -(-positions // KEY_BLOCK)


def unblock_keys(blocked: torch.Tensor, length: int) -> torch.Tensor:
    """``Tensor[rows, kv_heads, blocks, head_dim, KEY_BLOCK]`` -> the first ``length`` positions as
    ``Tensor[rows, kv_heads, length, head_dim]`` (a copy)."""
    rows, heads, _, dim, _ = blocked.shape
    used = blocked[:, :, : _blocks(length)].transpose(-1, -2)
    return used.reshape(rows, heads, -1, dim)[:, :, :length]


def _write_blocked(blocked: torch.Tensor, start: int, states: torch.Tensor) -> None:
    """Write ``states: Tensor[rows, kv_heads, n, head_dim]`` at positions ``[start, start + n)`` of
    the blocked keys ``Tensor[rows, kv_heads, blocks, head_dim, KEY_BLOCK]``."""
    by_position = blocked.transpose(-1, -2)  # [rows, kv_heads, blocks, KEY_BLOCK, head_dim], a view
    done, count = 0, states.shape[2]
    shape, dim = states.shape[:2], states.shape[3]
    while done < count:
        block, offset = divmod(start + done, KEY_BLOCK)
        if offset == 0 and count - done >= KEY_BLOCK:  # whole blocks in one copy
            whole = (count - done) // KEY_BLOCK
            chunk = states[:, :, done : done + whole * KEY_BLOCK]
            by_position[:, :, block : block + whole].copy_(
                chunk.view(*shape, whole, KEY_BLOCK, dim)
            )
            done += whole * KEY_BLOCK
        else:
            take = min(KEY_BLOCK - offset, count - done)
            by_position[:, :, block, offset : offset + take].copy_(states[:, :, done : done + take])
            done += take


@final
class PreallocatedLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init_subclass__ unannotated
    """One full-attention layer's keys and values in buffers allocated once.

    ``value_buffer`` is ``Tensor[rows, kv_heads, capacity, head_dim]``, and so is ``key_buffer``
    unless ``blocked_keys``: then it is ``Tensor[rows, kv_heads, blocks, head_dim, KEY_BLOCK]``
    with ``blocks * KEY_BLOCK >= capacity``. Positions ``[0, length)`` hold the states seen so far,
    positions beyond are unwritten memory (which only the blocked layout's last block exposes, and
    the decode kernel masks). :meth:`update` writes the new states at ``[length, length + new)``
    and returns views of the written prefix (the whole blocked key buffer when keys are blocked).
    """

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(
        self,
        key_buffer: torch.Tensor,
        value_buffer: torch.Tensor,
        length: int,
        *,
        blocked_keys: bool = False,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        self._key_buffer, self._value_buffer, self._length = key_buffer, value_buffer, length
        self.blocked_keys = blocked_keys
        self.device = key_buffer.device
        self.is_initialized = True
        self._set_views()

    @classmethod
    def from_prompt(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor | None,
        capacity: int,
        *,
        blocked_keys: bool = False,
    ) -> PreallocatedLayer:
        """Allocate buffers of ``capacity`` positions and fill them with a prefill's states.

        ``keys``, ``values``: ``Tensor[P, kv_heads, S, head_dim]`` for ``P`` distinct prompts;
        ``rows``: ``Tensor[B]`` (int64), the prompt each of the ``B`` buffer rows starts from
        (``None``: row ``i`` is prompt ``i``).
        """
        length = keys.shape[2]
        if capacity < length:
            raise ValueError(f"capacity {capacity} is below the prompt length {length}")
        batch = keys.shape[0] if rows is None else rows.shape[0]
        heads, dim = keys.shape[1], keys.shape[3]

        def gather(states: torch.Tensor, out: torch.Tensor) -> None:
            if rows is None:
                out.copy_(states)
            else:
                torch.index_select(states, 0, rows, out=out)

        # empty, not zeros: positions past ``length`` are never read before being written.
        value_buffer = values.new_empty((batch, heads, capacity, dim))
        gather(values, value_buffer[:, :, :length])
        if blocked_keys:
            key_buffer = keys.new_empty((batch, heads, _blocks(capacity), dim, KEY_BLOCK))
            _write_blocked(key_buffer, 0, keys if rows is None else keys[rows])
        else:
            key_buffer = keys.new_empty((batch, heads, capacity, dim))
            gather(keys, key_buffer[:, :, :length])
        return cls(key_buffer, value_buffer, length, blocked_keys=blocked_keys)

    def _set_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        # ``keys`` / ``values`` are what transformers' own layers expose; keep them meaningful.
        if self.blocked_keys:
            keys = self.keys = self._key_buffer
        else:
            keys = self.keys = self._key_buffer[:, :, : self._length]
        values = self.values = self._value_buffer[:, :, : self._length]
        return keys, values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("PreallocatedLayer is built from a prefill; it never initializes lazily")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``Tensor[rows, kv_heads, new, head_dim]`` states after the stored ones; return
        the views ``Tensor[rows, kv_heads, length, head_dim]`` attention reads (for blocked keys,
        the whole blocked key buffer)."""
        start, end = self._length, self._length + key_states.shape[2]
        if end > self._value_buffer.shape[2]:
            raise RuntimeError(
                f"PreallocatedLayer: {end} positions do not fit the {self._value_buffer.shape[2]} "
                "allocated (prompt + max_new_tokens)"
            )
        if self.blocked_keys:
            _write_blocked(self._key_buffer, start, key_states)
        else:
            self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self._length = end
        return self._set_views()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def get_seq_length(self) -> int:
        return self._length

    def get_max_length(self) -> int:
        return int(self._value_buffer.shape[2])

    def reset(self) -> None:
        self._length = 0
        self._set_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.keep_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keep_rows(indices)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (``Tensor[R]``, int64), in that order, in new buffers of ``R`` rows.

        Only the written positions are copied, and the old buffers are released, so memory
        shrinks with the batch.
        """
        filled = _blocks(self._length) if self.blocked_keys else self._length
        new_buffers = []
        for buffer, used in ((self._key_buffer, filled), (self._value_buffer, self._length)):
            new = buffer.new_empty((rows.shape[0], *buffer.shape[1:]))
            torch.index_select(buffer[:, :, :used], 0, rows, out=new[:, :, :used])
            new_buffers.append(new)
        self._key_buffer, self._value_buffer = new_buffers
        self._set_views()


@final
class DecodeCache(Cache):
    """A transformers ``Cache`` for the decode loop, built from a prefill's ``DynamicCache``.

    Every plain full-attention layer (transformers' ``DynamicLayer``) becomes a
    :class:`PreallocatedLayer` with room for ``capacity`` positions; any other layer kind keeps the
    layer transformers built for it. ``rows`` (``Tensor[B]``, int64) expands the prefill's distinct
    prompts to the batch (``None``: one row per prompt). ``blocked_keys``: the preallocated layers
    keep their keys in the decode kernel's blocked layout (see the module docstring).
    """

    def __init__(
        self,
        prefill: DynamicCache,
        rows: torch.Tensor | None,
        capacity: int,
        *,
        blocked_keys: bool = False,
    ) -> None:
        layers: list[Any] = []
        for layer in prefill.layers:
            if type(layer) is DynamicLayer and layer.is_initialized:
                assert layer.keys is not None and layer.values is not None  # initialized
                layers.append(
                    PreallocatedLayer.from_prompt(
                        layer.keys, layer.values, rows, capacity, blocked_keys=blocked_keys
                    )
                )
            else:
                if rows is not None:
                    # reorder_cache is beam search's row gather; its annotation asks for the
                    # legacy LongTensor type.
                    layer.reorder_cache(cast("torch.LongTensor", rows))
                layers.append(layer)
        super().__init__(layers=layers)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (``Tensor[R]``, int64) of every layer, in that order."""
        for layer in self.layers:
            if isinstance(layer, PreallocatedLayer):
                layer.keep_rows(rows)
            else:
                layer.reorder_cache(cast("torch.LongTensor", rows))
