"""Weights into SGLang servers from whichever process holds them: the three weight sinks.

- :class:`~rlcore_sglang.weight_sync.tensor.TensorSink` (``--weight-sync tensor``,
  :mod:`~rlcore_sglang.weight_sync.tensor`): ``/update_weights_from_tensor`` with shared-memory
  handles (CUDA IPC handles for GPU tensors), run on the servers' machine.
- :class:`~rlcore_sglang.weight_sync.distributed.BroadcastSink` (``distributed``,
  :mod:`~rlcore_sglang.weight_sync.distributed`): a broadcast from a process group whose rank 0 is
  the sending process, run anywhere the servers can reach.
- :class:`~rlcore_sglang.weight_sync.disk.DiskSink` (``disk``,
  :mod:`~rlcore_sglang.weight_sync.disk`): safetensors shards in a folder the servers read, run
  anywhere that shares the folder with them.
- :mod:`~rlcore_sglang.weight_sync.base`: what the three share, the servers as a sink knows them
  and the buckets.
- :mod:`~rlcore_sglang.weight_sync.session`: the engine's side, which sinks an update hands out
  and the update session around them on every server.

Every sink reads the weights once, as they come, in buckets holding at most ``bucket_bytes``
(``--update-weight-buffer-size``; a larger tensor goes alone), and puts the new version and a
cache flush on its last call. A sink is a small frozen value (URLs, options, the version) that
pickles: a Megatron rank that holds the tensor-parallel-gathered weights runs it, so the weights
never pass through the driver. What a sink keeps between syncs in the process it runs in (the
shared-memory buffers, the broadcast group) lives in its module's per-process state.
"""
