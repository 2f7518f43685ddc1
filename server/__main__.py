"""``shmserve`` / ``python -m shmserve``: parse flags, copy cloud repositories, then run the launcher."""
from __future__ import annotations

import argparse
import logging
import signal
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
    if any("://" in r for r in args.model_repository):
        return _serve_cloud(args)
    from .launcher import Launcher

    return Launcher(args).run()


def _serve_cloud(args: argparse.Namespace) -> int:
    """Copy each cloud repository to a local folder (a missing bucket or bad credentials: one line,
    exit 1), serve the copies, and remove them when the server exits."""
    from .broker.cloud_repository import CloudError, make_copies, remove_copies
    from .launcher import Launcher

    signal.signal(signal.SIGTERM, _interrupted)  # until the launcher sets its own: no copy is left behind
    try:
        copies = make_copies(args.model_repository, args.id)
    except CloudError as e:
        sys.stderr.write(f"shmserve: error: {e}\n")
        return 1
    except KeyboardInterrupt:  # SIGINT or SIGTERM while copying
        return 1
    args.model_repository = [copies.get(r, r) for r in args.model_repository]
    args.cloud_repositories = {local: url for url, local in copies.items()}
    try:
        return Launcher(args).run()
    finally:
        remove_copies(copies.values())


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
