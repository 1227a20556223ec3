"""``python -m rlcore_megatron`` is ``python -m rlcore_megatron.run``."""

import sys

from rlcore_megatron.run import main

sys.exit(main())
