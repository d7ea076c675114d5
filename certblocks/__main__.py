"""``python -m certblocks``: the ``certblocks`` command (:mod:`certblocks.cli`)."""

import sys

from certblocks.cli import main

if __name__ == "__main__":
    sys.exit(main())
