"""``python -m flashlse``: the command line of :mod:`flashlse.cli` (audit, demo, bench)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
