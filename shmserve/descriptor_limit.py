"""Every long-lived process of a server raises its soft descriptor limit at start, as Go's runtime
and nginx's ``worker_rlimit_nofile`` do: a frontend holds one descriptor per connection, and the
broker and workers one per guarded mapping of an object a client of another user may write
(shm/truncation_guard.py), so a default soft limit of 1,024 would cap what the hard limit allows."""
from __future__ import annotations

import resource

# Not past this: a huge hard limit would only make the derived connection bound meaningless.
MAX_FDS = 1 << 20
# Descriptors a frontend (HTTP or gRPC) keeps for itself besides its connections: the listening
# socket, its epoll and event fds, log files, its client segment and FIFO, the broker's and the
# trace segment, and one per worker segment it routes to (16 in all with one worker, measured): a
# fixed floor plus a share of the limit, so a server with many workers is not starved either.
RESERVED_FDS = 128
RESERVED_SHARE = 16  # and one descriptor in every 16


def raise_descriptor_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (capped at ``MAX_FDS``); returns
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_FDS if hard == resource.RLIM_INFINITY else min(hard, MAX_FDS)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return min(soft, MAX_FDS) if soft != resource.RLIM_INFINITY else MAX_FDS
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft
    return want


def connection_bound(descriptor_limit: int) -> int:
    """A frontend's default connection bound under ``descriptor_limit``: what is left once its
    own descriptors are kept aside (``RESERVED_FDS`` plus one in ``RESERVED_SHARE``)."""
    return max(1, descriptor_limit - RESERVED_FDS - descriptor_limit // RESERVED_SHARE)
