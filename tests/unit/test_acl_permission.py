"""``access.may_open`` decides as the kernel does whether a user may open an object for reading
and writing (a region's registrant must pass it: server/broker/region_access.py). Each case is
a real object in /dev/shm with its owner, mode and POSIX ACL, and the kernel's own verdict is
taken from a child process that runs as ``nobody`` and opens it."""
from __future__ import annotations

import json
import os
import pwd
import struct
import subprocess
import sys
import textwrap

import pytest

from shmserve.shm.access import may_open

NOBODY = pwd.getpwnam("nobody")
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
ANY = 0xFFFFFFFF  # the id of an entry that names no one

# name -> (owner uid, owning gid, mode without an ACL, ACL entries (tag, permissions, id) or None)
CASES = {
    "others may": (0, 0, 0o666, None),
    "only the owner": (0, 0, 0o600, None),
    "its group": (0, NOBODY.pw_gid, 0o660, None),
    "the owner, who may not": (NOBODY.pw_uid, 0, 0o066, None),
    "named user": (0, 0, 0, [(USER_OBJ, 6, ANY), (USER, 6, NOBODY.pw_uid), (GROUP_OBJ, 0, ANY), (MASK, 6, ANY),
                             (OTHER, 0, ANY)]),
    "named user under a read mask": (0, 0, 0, [(USER_OBJ, 6, ANY), (USER, 6, NOBODY.pw_uid), (GROUP_OBJ, 0, ANY),
                                               (MASK, 4, ANY), (OTHER, 6, ANY)]),
    "named user denied": (0, 0, 0, [(USER_OBJ, 6, ANY), (USER, 0, NOBODY.pw_uid), (GROUP_OBJ, 6, ANY),
                                    (MASK, 6, ANY), (OTHER, 6, ANY)]),
    "owning group denied": (0, NOBODY.pw_gid, 0, [(USER_OBJ, 6, ANY), (GROUP_OBJ, 0, ANY), (GROUP, 4, 0),
                                                  (MASK, 6, ANY), (OTHER, 6, ANY)]),
    "named group": (0, 0, 0, [(USER_OBJ, 6, ANY), (GROUP_OBJ, 0, ANY), (GROUP, 6, NOBODY.pw_gid), (MASK, 6, ANY),
                              (OTHER, 0, ANY)]),
    "named group reads only": (0, 0, 0, [(USER_OBJ, 6, ANY), (GROUP_OBJ, 0, ANY), (GROUP, 4, NOBODY.pw_gid),
                                         (MASK, 6, ANY), (OTHER, 6, ANY)]),
    # A mask of nothing leaves the mode's group bits 0: the kernel then skips the ACL, and the
    # others' bits decide, whatever a named entry says.
    "a mask of nothing, others may": (0, 0, 0, [(USER_OBJ, 6, ANY), (USER, 0, NOBODY.pw_uid), (GROUP_OBJ, 0, ANY),
                                                (MASK, 0, ANY), (OTHER, 6, ANY)]),
    "a mask of nothing, others may not": (0, 0, 0, [(USER_OBJ, 6, ANY), (USER, 6, NOBODY.pw_uid),
                                                    (GROUP_OBJ, 0, ANY), (MASK, 0, ANY), (OTHER, 0, ANY)]),
}

OPENS = textwrap.dedent("""
    import json, os, sys
    os.setgroups([])
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[3]))
    verdicts = {}
    for path in json.loads(sys.argv[1]):
        try:
            os.close(os.open(path, os.O_RDWR))
            verdicts[path] = True
        except PermissionError:
            verdicts[path] = False
    print(json.dumps(verdicts))
""")


@pytest.fixture
def objects():
    """Each case's object, made as its case says; removed at the end."""
    paths = {}
    try:
        for n, (name, (uid, gid, mode, entries)) in enumerate(CASES.items()):
            path = paths[name] = f"/dev/shm/shmserve_unit_acl_{os.getpid()}_{n}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.chown(path, uid, gid)
            os.chmod(path, mode)
            if entries is not None:
                os.setxattr(path, "system.posix_acl_access",
                            struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))
        yield paths
    finally:
        for path in paths.values():
            os.unlink(path)


def test_may_open_agrees_with_the_kernel_for_each_owner_mode_and_acl(objects):
    kernel = json.loads(subprocess.run([sys.executable, "-c", OPENS, json.dumps(list(objects.values())),
                                        str(NOBODY.pw_gid), str(NOBODY.pw_uid)],
                                       capture_output=True, text=True, check=True).stdout)
    ours = {name: may_open(path, os.stat(path), NOBODY.pw_uid, {NOBODY.pw_gid}) for name, path in objects.items()}
    assert ours == {name: kernel[path] for name, path in objects.items()}
    assert sorted(ours.values()) == [False] * 7 + [True] * 5, ours  # (both verdicts are met)
