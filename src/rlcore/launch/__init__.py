"""The launcher: a :class:`~rlcore.config.RunConfig` run to its end on any backend, as the command
line runs it (``python -m rlcore.launch --train-backend NAME``; ``python -m rlcore_megatron.run``
is the same entry with ``megatron`` as its default).

- :mod:`~rlcore.launch.cli`: the entry point (:func:`~rlcore.launch.cli.main`), and
  :func:`~rlcore.launch.cli.execute` for a config in Python: checks, then Ray, the backend's
  ranks, the rollout engine and the loop; signals, restarts, exit codes.
- :mod:`~rlcore.launch.prepare`: every check before anything starts (the model folder and a
  checkpoint's shape asked of the backend's kind, the data, the tokenizer, the placement), and
  what a run reads (:class:`~rlcore.launch.prepare.Prepared`).
- :mod:`~rlcore.launch.record`: what a run leaves behind (``summary.json``, rewinds, messages);
  :mod:`~rlcore.launch.console`: the log and the progress display;
  :mod:`~rlcore.launch.placement`: the slots a run asks of a cluster (pure);
  :mod:`~rlcore.launch.watchdog`: nothing a run starts outlives it.
- :mod:`~rlcore.launch.ray`: Ray's side (rank groups, the stacks over them, cluster placement);
  it imports Ray, and only a launch imports it.
- :mod:`~rlcore.launch.demo`, :mod:`~rlcore.launch.tool_demo`: the CPU demos.

No module here imports a backend or an engine package: backends and engines are found by name
(:mod:`rlcore.backends`, :mod:`rlcore.engines`). ``import rlcore`` does not import this room.
"""
