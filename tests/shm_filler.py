"""The source of ``fill(path)``, for programs a test runs in another process (as another user, or
in a mount namespace of its own with a small /dev/shm): it writes ``path`` until the filesystem
that holds it has no page left, and fails on any other error."""

FILL = '''
def fill(path):
    import errno
    with open(path, "ab", buffering=0) as f:
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    f.write(bytes(chunk))
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
'''
