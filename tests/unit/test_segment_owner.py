"""A client's segment as the broker and workers attach it (``Segment.attach(owner_only=True)``):
its owner says who the client is only where no one else could have written it, and it is never
mapped without its truncation guard where another user could truncate it. Real objects in
/dev/shm, another user's made by root and given to nobody; each child process is one whose
descriptors are known."""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
import textwrap

import pytest

from shmserve.shm.access import acl
from shmserve.shm.segment import Segment

NOBODY = pwd.getpwnam("nobody")


@pytest.fixture
def key():
    name = f"/shmserve_unit_owner_{os.getpid()}"
    fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 16)
    os.close(fd)
    yield name
    for path in ("/dev/shm" + name, "/dev/shm" + name + ".link"):
        if os.path.lexists(path):
            os.unlink(path)


def _refused(name: str) -> str:
    with pytest.raises(PermissionError) as e:
        Segment.attach(name, owner_only=True)
    return str(e.value)


def test_an_object_only_its_owner_could_write_is_its_owners(key):
    os.chown("/dev/shm" + key, NOBODY.pw_uid, NOBODY.pw_gid)
    seg = Segment.attach(key, owner_only=True)
    assert seg.uid == NOBODY.pw_uid
    seg.close()


def test_an_object_someone_else_could_have_written_says_nothing_of_who_made_it(key):
    path = "/dev/shm" + key
    os.link(path, path + ".link")
    assert "it has 2 names (a hard link)" in _refused(key)
    os.unlink(path + ".link")
    os.chmod(path, 0o620)
    assert "lets its group write it" in _refused(key)
    os.chmod(path, 0o602)
    assert "lets any user write it" in _refused(key)
    os.chmod(path, 0o600)
    os.setxattr(path, "system.posix_acl_access", acl((NOBODY.pw_uid,)))  # as the server's extents carry
    assert f"its ACL lets user {NOBODY.pw_uid} write it" in _refused(key)
    os.setxattr(path, "system.posix_acl_access", acl((os.geteuid(),)))  # the server's user: as a client names it
    Segment.attach(key, owner_only=True).close()


def test_a_segment_whose_guard_cannot_be_had_is_not_mapped(key):
    """With no descriptor left for the guard's own, the attach fails (OSError) rather than map
    a segment its owner could truncate under the process."""
    os.chown("/dev/shm" + key, NOBODY.pw_uid, NOBODY.pw_gid)
    program = textwrap.dedent("""
        import os, resource, sys
        from shmserve.shm import truncation_guard
        from shmserve.shm.segment import Segment
        assert truncation_guard.available()
        Segment.attach(sys.argv[1], owner_only=True).close()  # (installs the handler: no descriptor later)
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))  # (the listing's own included)
        for fd in range(top + 1):
            try:
                os.fstat(fd)
            except OSError:
                os.dup2(0, fd)  # no hole below the limit: the next descriptor is the limit's
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            Segment.attach(sys.argv[1], owner_only=True)  # the object's descriptor, mmap's, none for the guard
            print("mapped")
        except OSError as e:
            print("refused:", e)
    """)
    ran = subprocess.run([sys.executable, "-c", program, key], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert "its truncation guard cannot be had" in ran.stdout, ran.stdout + ran.stderr
