"""Ray's side of a launch, for any backend: one Ray actor per rank of a model
(:mod:`~rlcore.launch.ray.ranks`, set up by the backend kind's rank runtime), the stacks that fan
calls out to them (:mod:`~rlcore.launch.ray.stacks`) and the slots a run reserves on the cluster
(:mod:`~rlcore.launch.ray.cluster`). These modules import Ray; only a launch imports them."""
