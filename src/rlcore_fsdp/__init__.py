"""The FSDP2 backend for rlcore (``--train-backend fsdp``): any Hugging Face causal LM, used as it
is, sharded with ``torch.distributed.fsdp.fully_shard`` over the data-parallel ranks.

``import rlcore_fsdp`` is light; the modules are: :mod:`~rlcore_fsdp.kind` (what the launcher
finds by name: options, rank runtime, checks before start), :mod:`~rlcore_fsdp.backend`
(:class:`~rlcore_fsdp.backend.FSDPBackend`), :mod:`~rlcore_fsdp.stacks` and
:mod:`~rlcore_fsdp.checkpoint` (``torch.distributed.checkpoint``).
"""

__all__: list[str] = []
