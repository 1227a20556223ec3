"""``python -m rlcore_megatron`` is ``python -m rlcore_megatron.run``."""

import sys

from rlcore.launch.cli import main

sys.exit(main())
