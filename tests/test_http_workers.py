"""--http-workers' default: one HTTP frontend process per two cores the server may use (its CPU
affinity), at least 1 and at most 8 (tritonserver's --http-thread-count pool of 8 threads)."""
from __future__ import annotations

import os

from conftest import PRODUCT_MODELS, PYTHON, Server, cmdline, descendants

from shmserve.server.cli import TRITON_HTTP_THREADS, build_parser, default_http_workers


def frontends(s: Server) -> int:
    return sum(cmdline(p).startswith(f"shmserve frontend {s.id} #") for p in descendants(s.pid))


def serving(s: Server) -> bool:
    with s.client() as c:
        return c.is_model_ready("add_sub")


def test_the_default_is_half_the_cores_up_to_tritons_eight(server_factory):
    s = server_factory.create([PRODUCT_MODELS])
    s.one_frontend = False  # no --http-workers on its command line
    s.start().wait_ready()
    expected = min(max(1, len(os.sched_getaffinity(0)) // 2), TRITON_HTTP_THREADS)
    assert expected == default_http_workers() == build_parser().parse_args(["--model-repository=x"]).http_workers
    s.wait_until(lambda: frontends(s) == expected, f"{expected} frontend processes")
    assert serving(s)


class OneCoreServer(Server):
    """A server whose launcher may run on one core only (its CPU affinity, as ``taskset -c``)."""

    def command(self) -> list[str]:
        cpu = min(os.sched_getaffinity(0))
        return [PYTHON, "-c", f"import os, sys; os.sched_setaffinity(0, {{{cpu}}}); os.execv(sys.argv[1], sys.argv[1:])",
                *super().command()]


def test_the_default_follows_the_cpu_affinity(server_factory, tmp_path):
    s = OneCoreServer([PRODUCT_MODELS], tmp_path)
    s.one_frontend = False
    server_factory.servers.append(s)
    s.start().wait_ready()
    assert frontends(s) == 1, [cmdline(p) for p in descendants(s.pid)]
    assert serving(s)
    assert "at most 8 as Triton's HTTP threads" in " ".join(build_parser().format_help().split())
