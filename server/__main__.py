"""``shmserve`` / ``python -m server``: parse flags, then run the launcher."""
from __future__ import annotations

import logging
import sys

from shm.names import set_title


def main(argv: list[str] | None = None) -> int:
    from .cli import parse_args

    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.log_verbose else logging.INFO,
                        format="%(asctime)s %(levelname).1s [launcher] %(name)s: %(message)s")
    set_title(f"shmserve launcher {args.id}")
    from .launcher import Launcher

    return Launcher(args).run()


if __name__ == "__main__":
    sys.exit(main())
