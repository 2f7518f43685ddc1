"""The truncation guard (shm/truncation_guard.py): a segment another user may write and shrink is
grown back when this process touches a lost page, or at its periodic ``restore``, instead of a
SIGBUS; a page /dev/shm then has no room for is replaced by a private one until ``restore`` can
put it back; an unguarded one still kills, and a SIGBUS outside the guarded mappings keeps its
meaning.

Each case runs in a child process: a failure there is a signal, which must not end the test run.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

from conftest import PYTHON, ROOT, free_port
from shm_filler import FILL

from shmserve.shm import truncation_guard



def test_the_guard_is_built_where_a_compiler_is():
    """``make`` installs shmserve on this machine, which has ``cc``: the optional extension must
    have been built (a failed build is only a warning in pip's log)."""
    assert shutil.which("cc") and truncation_guard.available()


def _child(body: str, tmpfs_mb: int = 0) -> subprocess.CompletedProcess:
    """Run ``body`` in a child that made ``seg``; ``tmpfs_mb``: in a mount namespace of its own,
    with a tmpfs that small on /dev/shm (which the child may then fill, and which goes with it)."""
    name = f"/shmtest.guard.{os.getpid()}"
    program = textwrap.dedent("""
        import os, subprocess
        from shmserve.shm.segment import Segment
        from shmserve.shm import truncation_guard
        name = {name!r}
        path = "/dev/shm" + name
        def cut():  # another process shrinks it, as a client would
            subprocess.run(["truncate", "-s", "0", path], check=True)
        seg = Segment.create(name, 1 << 20, readers=(65534,))  # nobody may write it, as --local-client-users=nobody
        try:
    """).format(name=name) + textwrap.indent(textwrap.dedent(body), "    ") + textwrap.dedent("""
        finally:
            seg.unlink()
    """)
    try:
        command = [sys.executable, "-c", program]
        if tmpfs_mb:
            mount = f'mount -t tmpfs -o size={tmpfs_mb}m tmpfs /dev/shm && exec "$@"'
            command = ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)
    finally:
        for leftover in (name, name + ".2"):  # (what a child killed by its signal could not remove)
            if os.path.exists("/dev/shm" + leftover):
                os.unlink("/dev/shm" + leftover)


def test_a_touch_past_a_truncation_grows_the_segment_back():
    done = _child("""
        seg.buf[100] = 7
        seg.buf[(1 << 20) - 1] = 9
        cut()
        assert os.stat(path).st_size == 0
        print(seg.buf[100], seg.buf[(1 << 20) - 1], seg.read(0, 16) == bytes(16))  # zero pages, no signal
        seg.buf[5] = 1  # writes too
        print(os.stat(path).st_size, truncation_guard.regrown())
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", "True", str(1 << 20), "1"]


def test_a_page_dev_shm_has_no_room_for_after_a_truncation_is_replaced_then_put_back():
    """A truncation gives the object's pages back, and grown back they are taken only when touched:
    a writer that truncates and then fills /dev/shm left a page the touch could not have, a SIGBUS
    again. The handler replaces such a page by a private zero page (the process lives, and what
    it writes there the object does not see), and ``restore`` puts the object's page back once
    there is room: what is written then is the object's again."""
    done = _child(FILL + textwrap.dedent("""
        seg.buf[100] = 7
        cut()
        fill("/dev/shm/filler")  # another user fills /dev/shm
        print(seg.buf[100], seg.buf[5000])  # no signal: zero pages, the process's own
        seg.buf[200] = 5
        with open(path, "rb") as f:
            print(seg.buf[200], f.read(4096)[200], truncation_guard.replaced())  # not the object's
            print(truncation_guard.restore(), truncation_guard.restored())  # still no room: kept
            os.unlink("/dev/shm/filler")  # the room is back
            truncation_guard.restore()
            print(truncation_guard.restored())
            seg.buf[300] = 9
            f.seek(0)
            print(f.read(4096)[300], os.stat(path).st_size)  # the object's page again
    """), tmpfs_mb=8)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["0", "0", "5", "0", "2", "0", "0", "2", "9", str(1 << 20)]


def test_restore_grows_back_what_nobody_touched():
    """A process that maps the object anew must find it whole (an empty file cannot be mapped)."""
    done = _child("""
        cut()
        print(truncation_guard.restore(), os.stat(path).st_size)
        again = Segment.attach(name)
        print(again.size)
        again.close()
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", str(1 << 20), str(1 << 20)]


def test_a_file_grown_back_by_another_before_the_handler_looks_is_touched_again():
    """The handler may find the file whole already (another process, or another thread's fault,
    grew it back first): the touch is only made again, and the guard stays for the next cut. A
    client cutting and growing in a loop while this process reads all its pages kills nothing."""
    done = _child("""
        cutter = subprocess.Popen(["python3", "-c", "import os, sys, time\\n"
                                   "end = time.monotonic() + 2\\n"
                                   "while time.monotonic() < end:\\n"
                                   "    os.truncate(sys.argv[1], 0)\\n"
                                   "    os.truncate(sys.argv[1], 1 << 20)\\n", path])
        pages = 0
        while cutter.poll() is None:
            for page in range(0, 1 << 20, 4096):
                seg.buf[page]
                pages += 1
        cut()  # the guard is still there after the race
        print(seg.buf[4096], pages > 1000, truncation_guard.regrown() > 0)
    """)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["0", "True", "True"]


def test_a_child_forked_while_a_fault_is_handled_can_still_release_a_guard():
    """A model may fork (multiprocessing) while another of its threads is in the handler: the child,
    which has no such thread, must not wait for that handler to end before it lets a guard go."""
    done = _child("""
        import ctypes, threading, time
        other = Segment.create(name + ".2", 4096, readers=(65534,))  # guarded: the child lets it go
        address = ctypes.addressof(ctypes.c_char.from_buffer(seg.buf))
        stop = threading.Event()
        def cut_and_touch():  # ctypes.memset runs without the GIL, so the fork may land in the handler
            while not stop.is_set():
                os.truncate(path, 0)
                ctypes.memset(address + 4096, 1, 1)
        cutter = threading.Thread(target=cut_and_touch)
        cutter.start()
        hung = 0
        for _ in range(200):
            pid = os.fork()
            if pid == 0:
                other.close()
                os._exit(0)
            deadline = time.monotonic() + 2
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    hung += 1
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.001)
        stop.set()
        cutter.join()
        other.close()
        other.unlink()
        print(hung, truncation_guard.regrown() > 100)
    """)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.split() == ["0", "True"]


def test_only_what_another_user_may_write_is_guarded():
    """Each guard holds a descriptor: an object only this process's user may write is left alone,
    one another user may write (an ACL entry, its mode, or its owner) is guarded."""
    done = _child("""
        from shmserve.shm.truncation_guard import others_may_write
        mine = Segment.create(name + ".2", 4096)
        fd = os.open(path + ".2", os.O_RDWR)
        print(others_may_write(fd), end=" ")
        os.fchmod(fd, 0o620)
        print(others_may_write(fd), end=" ")
        os.fchmod(fd, 0o600)
        os.fchown(fd, 65534, -1)
        print(others_may_write(fd), end=" ")
        os.close(fd)
        fd = os.open(path, os.O_RDWR)
        print(others_may_write(fd))
        os.close(fd)
        mine.close()
        mine.unlink()
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "True"]


def test_an_unguarded_mapping_still_dies_of_sigbus():
    """What the guard was let go of (a segment closed) is the kernel's again: the handler passes
    a fault with nothing to grow back to the action before it, here the default."""
    done = _child("""
        seg._guard.release()
        cut()
        print(seg.buf[10])
    """)
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr)


def test_a_closed_segment_releases_its_guard():
    done = _child("""
        other = Segment.create(name + ".2", 4096, readers=(65534,))
        other.close()
        subprocess.run(["truncate", "-s", "0", path + ".2"], check=True)
        print(truncation_guard.restore(), os.stat(path + ".2").st_size)  # no longer this process's to grow
        other.unlink()
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0"]


def test_without_the_library_the_server_warns_under_local_client_users(tmp_path):
    """An install that found no C compiler has no guard: the server says so where it matters."""
    port, grpc, metrics = free_port(), free_port(), free_port()
    server_id = f"noguard{os.getpid()}"
    program = ("import sys\nfrom shmserve.shm import truncation_guard\ntruncation_guard._lib = None  # as built with no cc\n"
               "from shmserve.server.__main__ import main\nsys.exit(main())")
    proc = subprocess.Popen([PYTHON, "-c", program, "--model-repository", str(ROOT / "model_repository"),
                             "--model-control-mode=explicit", "--local-client-users=nobody", f"--id={server_id}",
                             f"--http-port={port}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving HTTP" in line or len(lines) > 200:
                break
        text = "".join(lines)
        assert "--local-client-users: shmserve was installed without its truncation guard" in text, text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert not [n for n in os.listdir("/dev/shm") if server_id in n]
