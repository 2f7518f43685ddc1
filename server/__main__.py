"""``shmserve`` / ``python -m shmserve``: parse flags, then run the launcher."""
from __future__ import annotations

import logging
import sys

from shmserve.shm.names import set_title


def main(argv: list[str] | None = None) -> int:
    from shmserve.shm import logs

    from .cli import log_settings, parse_args

    args = parse_args(argv)
    logs.configure(log_settings(args))
    log = logging.getLogger("shmserve")
    for level, line in args.notices:  # Triton's flags that do less here than there, by name
        log.log(level, "%s", line)
    set_title(f"shmserve launcher {args.id}")
    from .launcher import Launcher

    return Launcher(args).run()


if __name__ == "__main__":
    sys.exit(main())
