"""A client's region read and written over real POSIX objects: through a mapping under the
truncation guard (where it is built), mapped anew when the object grew, and surviving a truncation
racing its copies; a truncated object fails the read or write (named), is never grown back by a
refused write, serves again at its full size; a key that names another object, or none, is
refused, and a new registration (another inode) opens the new object."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shm_filler import FILL
from shmserve.shm import truncation_guard
from shmserve.shm.region_io import RegionFiles, StaleRegion

_names = itertools.count()


@pytest.fixture
def obj():
    """(key, fd) of a new 4 KiB object holding 0..255 repeated; unlinked after the test."""
    key = f"/shmserve_unit_region_io_{os.getpid()}_{next(_names)}"
    fd = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.pwrite(fd, bytes(range(256)) * 16, 0)
    yield key, fd
    os.close(fd)
    try:
        os.unlink("/dev/shm" + key)
    except FileNotFoundError:
        pass


def entry(key: str, fd: int, off: int, size: int) -> dict:
    return {"seg": key, "ino": os.fstat(fd).st_ino, "region": "r", "off": off, "size": size}


def test_truncated_object_fails_reads_and_writes_and_serves_again_once_extended(obj):
    key, fd = obj
    files = RegionFiles()
    t = entry(key, fd, 256, 1024)
    assert files.read(t).tobytes() == (bytes(range(256)) * 16)[256:1280]
    os.ftruncate(fd, 512)
    with pytest.raises(StaleRegion, match="shared memory region 'r' was truncated since it was registered"):
        files.read(t)
    with pytest.raises(StaleRegion, match="which holds 512 now"):
        files.write(t, bytes(1024))
    assert os.fstat(fd).st_size == 512  # the refused write did not grow it back
    os.ftruncate(fd, 4096)
    files.write(t, np.full(1024, 7, dtype=np.uint8))
    assert files.read(t).tobytes() == bytes([7]) * 1024


def test_key_naming_another_object_is_refused_and_a_new_registration_opens_it(obj):
    key, fd = obj
    files = RegionFiles()
    old = entry(key, fd, 0, 16)
    files.read(old)  # kept open
    os.unlink("/dev/shm" + key)
    with pytest.raises(StaleRegion, match="was removed since it was registered"):
        files.read(old)
    fd2 = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd2, bytes([9]) * 16, 0)
        with pytest.raises(StaleRegion, match="was replaced since it was registered"):
            files.read(old)  # the old object is still open here: not read either
        fresh = {**old, "ino": os.fstat(fd2).st_ino}  # registered again
        assert files.read(fresh).tobytes() == bytes([9]) * 16
        with pytest.raises(StaleRegion, match="was replaced since it was registered"):
            files.read(old)
    finally:
        os.close(fd2)


def _maps_of(key: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if line.rstrip().endswith(key)]


def test_a_region_is_copied_through_a_guarded_mapping_mapped_anew_once_grown(obj):
    """pread and pwrite took twice a memcpy's CPU: where the guard is built (here: ``make``
    builds it), a region is mapped once and copied with memcpy."""
    assert truncation_guard.available()
    key, fd = obj
    files = RegionFiles()
    assert files.read(entry(key, fd, 0, 4096)).tobytes() == bytes(range(256)) * 16
    assert len(_maps_of(key)) == 1
    files.write(entry(key, fd, 100, 3), b"abc")
    assert os.pread(fd, 3, 100) == b"abc"  # the object's own pages
    os.ftruncate(fd, 8192)
    os.pwrite(fd, b"xyz", 8000)
    assert files.read(entry(key, fd, 8000, 3)).tobytes() == b"xyz"  # past the first mapping: mapped anew
    files.write(entry(key, fd, 6000, 2), b"hi")
    assert os.pread(fd, 2, 6000) == b"hi"
    del files
    assert not _maps_of(key), "both mappings go with the file"


def test_a_truncation_racing_the_copies_costs_the_process_nothing():
    """The client truncates its 16 MiB region and extends it again in a loop while this process
    reads and writes all of it: a touch past the end would be SIGBUS, which the guard undoes by
    zeroing the mapping (grown back instead, each page of a copy faulted, up to 20 s a copy);
    each copy either succeeds or is refused as truncated, and both happen. Counted in copies, not
    seconds: a copy racing the truncations is slow on a loaded host. In a child: a failure there is
    a signal."""
    key = f"/shmserve_unit_region_race_{os.getpid()}"
    program = textwrap.dedent("""
        import os, subprocess, sys, time
        import numpy as np
        from shmserve.shm.region_io import RegionFiles, StaleRegion
        key, size = sys.argv[1], 16 << 20
        fd = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        t = {"seg": key, "ino": os.fstat(fd).st_ino, "region": "r", "off": 0, "size": size}
        files = RegionFiles()
        files.read(t)  # mapped whole
        cutter = subprocess.Popen([sys.executable, "-c", "import os, sys\\n"
                                   "print(flush=True)\\n"
                                   "while True:\\n"
                                   "    os.truncate(sys.argv[1], 0)\\n"
                                   "    os.truncate(sys.argv[1], int(sys.argv[2]))\\n", "/dev/shm" + key, str(size)],
                                  stdout=subprocess.PIPE)
        cutter.stdout.readline()  # cutting from here on
        done = refused = 0
        data = np.ones(size, dtype=np.uint8)
        deadline = time.monotonic() + 90
        try:
            while (done < 5 or refused < 5 or done + refused < 20) and time.monotonic() < deadline:
                for step in (lambda: files.read(t), lambda: files.write(t, data)):
                    try:
                        step()
                        done += 1
                    except StaleRegion:
                        refused += 1
        finally:
            cutter.kill()
            cutter.wait()
        from shmserve.shm import truncation_guard
        print(done >= 5, refused >= 5, done + refused >= 20, truncation_guard.regrown() == 0)
        os.unlink("/dev/shm" + key)
    """)
    try:
        ran = subprocess.run([sys.executable, "-c", program, key], capture_output=True, text=True, timeout=120)
    finally:
        if os.path.exists("/dev/shm" + key):
            os.unlink("/dev/shm" + key)
    assert ran.returncode == 0, (ran.returncode, ran.stderr)
    assert ran.stdout.split() == ["True"] * 4, "copies done, copies refused, copies in all, none grown back"


def in_small_shm(program: str) -> list[str]:
    """What ``program`` printed, run in a child with a /dev/shm of its own of 8 MiB (fill() fills it)."""
    mount = 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"'
    ran = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", sys.executable, "-c",
                          program], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, (ran.returncode, ran.stderr)
    return ran.stdout.split()


# A 1 MiB region (``files``, ``t``, ``fd``, ``size``) an output was written into once: its pages taken.
REGION_WRITTEN_ONCE = textwrap.dedent("""
    import os
    import numpy as np
    from shmserve.shm.region_io import RegionFiles
    size = 1 << 20
    fd = os.open("/dev/shm/region", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    t = {"seg": "/region", "ino": os.fstat(fd).st_ino, "region": "r", "off": 0, "size": size}
    files = RegionFiles()
    files.write(t, np.full(size, 7, dtype=np.uint8))
""")
# With /dev/shm full, an output into the region whose pages it gave back (the program's ``files``,
# ``t``, ``fd`` and ``size``): refused, naming /dev/shm; then, with the room back, written.
OUTPUT_WITH_DEV_SHM_FULL = textwrap.dedent("""
    from shmserve.shm.space import NoRoom
    fill("/dev/shm/filler")
    try:
        files.write(t, np.full(size, 9, dtype=np.uint8))
        print("written", os.pread(fd, 4, 0) == bytes([9]) * 4)
    except NoRoom as e:
        print("refused", "/dev/shm is full" in str(e))
    os.unlink("/dev/shm/filler")
    files.write(t, np.full(size, 9, dtype=np.uint8))
    print(os.pread(fd, 4, size - 4) == bytes([9]) * 4)
""")


def test_a_region_dev_shm_has_no_room_for_refuses_an_output_and_keeps_its_size():
    """A client makes its region with ftruncate, which takes no page. With /dev/shm full, an output
    copied into the mapping would land on pages of this process's own (the guard's answer to a page
    with no room) and be lost: it is refused instead, naming /dev/shm; an input read there is
    zeros. Once the room is back the region's pages are the object's again, its size (no multiple
    of a page) unchanged, and an output lands in it. In a child with its own small /dev/shm."""
    program = FILL + textwrap.dedent("""
        import os
        import numpy as np
        from shmserve.shm import truncation_guard
        from shmserve.shm.region_io import RegionFiles
        from shmserve.shm.space import NoRoom
        size = (1 << 20) + 100
        fd = os.open("/dev/shm/region", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)
        t = {"seg": "/region", "ino": os.fstat(fd).st_ino, "region": "r", "off": 0, "size": size}
        files = RegionFiles()
        fill("/dev/shm/filler")
        try:
            files.write(t, np.full(size, 7, dtype=np.uint8))
            print("written")
        except NoRoom as e:
            print("refused", "/dev/shm is full" in str(e) and "'r'" in str(e))
        print(int(files.read(t).max()), truncation_guard.replaced() > 0)
        os.unlink("/dev/shm/filler")
        truncation_guard.restore()
        print(os.fstat(fd).st_size == size)
        files.write(t, np.full(size, 7, dtype=np.uint8))
        print(os.pread(fd, 4, size - 4) == bytes([7]) * 4, os.fstat(fd).st_size == size)
    """)
    assert in_small_shm(program) == ["refused", "True", "0", "True", "True", "True", "True"]


def test_a_region_larger_than_memory_is_zeroed_at_a_truncation_too():
    """A client makes its region a sparse object larger than this host's memory and swap (tmpfs
    takes no page for that, and the server maps the whole object) and truncates it under a copy.
    The guard's private zero pages were a writable anonymous mapping of that size, which the kernel
    refuses to commit: the guard then fell back to growing the object back page by page (the
    seconds-per-MiB stall the zeroing is for), and before Linux 6.12 a MAP_FIXED mapping the kernel
    refuses has unmapped the range already, so the access made again was a SIGSEGV. In a child:
    a failure there is a signal."""
    key = f"/shmserve_unit_region_huge_{os.getpid()}"
    program = textwrap.dedent("""
        import mmap, os, sys
        import numpy as np
        from shmserve.shm import truncation_guard
        from shmserve.shm.truncation_guard import guard_mapping
        with open("/proc/meminfo") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
        size = 2 * (kib["MemTotal"] + kib["SwapTotal"]) << 10  # (sparse: no page taken)
        fd = os.open("/dev/shm" + sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        guard = guard_mapping(mm, fd, size, restorable=True, always=True, zero=True)
        data = np.frombuffer(mm, dtype=np.uint8)
        data[:4096] = 7
        os.ftruncate(fd, 0)  # (as the client does under a copy)
        print(int(data[:8192].max()), guard.zeroed, truncation_guard.regrown(), os.fstat(fd).st_size)
        del data
        guard.closing()
        mm.close()
        guard.release()
        os.unlink("/dev/shm" + sys.argv[1])
    """)
    try:
        ran = subprocess.run([sys.executable, "-c", program, key], capture_output=True, text=True, timeout=60)
    finally:
        if os.path.exists("/dev/shm" + key):
            os.unlink("/dev/shm" + key)
    assert ran.returncode == 0, (ran.returncode, ran.stderr)
    assert ran.stdout.split() == ["0", "True", "0", "0"], "read zeros, zeroed, nothing grown back, still truncated"


def test_an_output_after_a_zeroing_truncation_takes_its_pages_again():
    """An output takes its pages once (posix_fallocate), and again after a truncation the guard
    undid, which gave them back. A truncation met by a copy is no longer grown back but zeroes the
    mapping, and so counted as no truncation undone: the pages a client gave back by truncating and
    extending its region were not taken again, and with /dev/shm full the next output landed on
    private zero pages of this process, lost without a word. It is refused, naming /dev/shm. In a
    child with its own small /dev/shm."""
    program = FILL + REGION_WRITTEN_ONCE + textwrap.dedent("""
        mapping = files.get("/region", t["ino"])._mapping
        os.ftruncate(fd, 0)  # (the client, under a copy: the copy's touch zeroes the mapping)
        print(int(mapping.bytes[0]), mapping.guard.zeroed)
        del mapping
        os.ftruncate(fd, size)  # (and extends it again: its pages are gone)
    """) + OUTPUT_WITH_DEV_SHM_FULL
    assert in_small_shm(program) == ["0", "True", "refused", "True", "True"]


def test_an_output_after_a_truncation_no_copy_met_takes_its_pages_again():
    """The same where the client truncates and extends its region between two outputs, so that no
    copy meets the truncation (nothing zeroed, nothing grown back): the object holds fewer blocks
    than after the first output took them, and the next output takes them again (with /dev/shm
    full it is refused, naming /dev/shm, instead of landing on private pages of this process)."""
    program = FILL + REGION_WRITTEN_ONCE + textwrap.dedent("""
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)  # (its pages are gone; no touch of ours met it)
    """) + OUTPUT_WITH_DEV_SHM_FULL
    assert in_small_shm(program) == ["refused", "True", "True"]


def test_an_output_after_a_truncation_and_writes_elsewhere_takes_its_pages_again():
    """The same where, after the truncation, the client writes as many pages elsewhere in the
    region as it gave back: the object's block count is what it was, yet the output's own range
    is a hole again, and its pages are taken again."""
    program = FILL + REGION_WRITTEN_ONCE + textwrap.dedent("""
        os.ftruncate(fd, 0)
        os.ftruncate(fd, 2 * size)  # (its pages are gone; the region is larger now)
        os.pwrite(fd, b"x" * size, size)  # (as many pages as it gave back, past the output's range)
    """) + OUTPUT_WITH_DEV_SHM_FULL
    assert in_small_shm(program) == ["refused", "True", "True"]
