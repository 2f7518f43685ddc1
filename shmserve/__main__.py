"""``python -m shmserve``: the same as the ``shmserve`` command."""
import sys

from shmserve.server.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
