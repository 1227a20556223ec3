"""``python -m rlcore.launch [--train-backend NAME] [flags]``: :func:`rlcore.launch.cli.main`."""

import sys

from rlcore.launch.cli import main

sys.exit(main())
