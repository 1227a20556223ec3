"""``python -m rlcore_megatron.run [flags]``: the launcher (:func:`rlcore.launch.cli.main`) with
``--train-backend megatron`` as its default, as it always was. Every flag and ``--config`` key is
the launcher's; ``--train-backend`` picks another backend through either entry."""

from __future__ import annotations

import sys

from rlcore.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
