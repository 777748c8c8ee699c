"""``python -m kvsieve``: the ``kvsieve`` command line."""

import sys

from kvsieve.cli import main

sys.exit(main())
