"""Who may register and unregister shared memory, against a real server over HTTP and gRPC.

Loopback is not a user boundary: a client running as ``nobody`` may register only objects it
could open itself (its own, or one whose mode lets it), never root's mode-0600 objects; a local
client's own objects (``/shmclient.<ticket>.*``, its process's liveness ticket) are its alone; a region is unregistered only by
whoever registered it, or by a caller with the shared-memory restricted-API key;
``--allow-client-shm=false`` refuses client regions with Triton's text; and gRPC peers that
grpcio names in any of its forms (``localhost`` is ``ipv6:%5B::1%5D:port``) are recognised.
"""
from __future__ import annotations

import itertools
import os
import signal
import struct

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from as_nobody import NOBODY, run_as_nobody
from conftest import processes_mapping, raw_request, start_shm_server, wait_until
from shmserve.server.grpc.service import peer_address
from shmserve.shm.client import Client, InferenceServerError
from shmserve.shm.control_messages import RegisterSystemRegion

N = 16  # add_sub takes and gives INT32 [16]
NB = N * 4
ADMIN = ("admin-key", "s3cret")
DISABLED = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
_keys = itertools.count()


@pytest.fixture(scope="module")
def server(module_factory):
    """Both protocols on every IPv4 and IPv6 address, so 127.0.0.1, ::1 and localhost all reach it."""
    return start_shm_server(module_factory, ["--http-address", "::", "--grpc-address", "::"])


def url(server, proto: str, host: str = "127.0.0.1") -> str:
    return f"{host}:{server.port if proto == 'http' else server.grpc_port}"


def client_of(proto: str, address: str):
    return (httpclient if proto == "http" else grpcclient).InferenceServerClient(address)


def status_names(server) -> list[str]:
    raw = raw_request(server.port, "GET", "/v2/systemsharedmemory/status")
    assert raw.status == 200, raw
    return sorted(r["name"] for r in raw.json())


@pytest.fixture
def root_object(server):
    """A root-owned object of mode 0600 holding two INT32 [16] inputs (1..16, 100..115) and room
    for an output; unlinked at the end."""
    key = f"/tshm_{server.id}_root_{next(_keys)}"
    handle = shm.create_shared_memory_region("root", key, 3 * NB, create_only=True)
    a = np.arange(1, N + 1, dtype=np.int32)
    shm.set_shared_memory_region(handle, [a, a + 99])
    assert os.stat("/dev/shm" + key).st_mode & 0o777 == 0o600
    yield key
    shm.destroy_shared_memory_region(handle)


# What nobody runs: register a key and, if that works, read it through add_sub (the attack).
STEAL = """
proto, url, name, key = args["proto"], args["url"], args["name"], args["key"]
mod = httpclient if proto == "http" else grpcclient
c = mod.InferenceServerClient(url)
try:
    c.register_system_shared_memory(name, key, 2 * 64)
except InferenceServerException as e:
    result = {"status": str(e.status()), "message": e.message()}
else:
    inputs = []
    for k, input_name in enumerate(("INPUT0", "INPUT1")):
        t = mod.InferInput(input_name, [16], "INT32")
        t.set_shared_memory(name, 64, offset=k * 64)
        inputs.append(t)
    result = {"stolen": c.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist()}
    c.unregister_system_shared_memory(name)
"""

_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_UNDEFINED = 0xFFFFFFFF


def set_acl(path: str, *entries: tuple[int, int, int]) -> None:
    """Give ``path`` the POSIX ACL of ``entries`` ((tag, permissions, id), in the kernel's order),
    as setfacl would."""
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))


def _acl_denying_nobody_by_name(path: str) -> None:  # mode 0666, but not for nobody
    set_acl(path, (_USER_OBJ, 6, _UNDEFINED), (_USER, 0, NOBODY.pw_uid), (_GROUP_OBJ, 6, _UNDEFINED),
            (_MASK, 6, _UNDEFINED), (_OTHER, 6, _UNDEFINED))


def _acl_denying_nobodys_group(path: str) -> None:  # the owning group, nobody's, gets nothing
    os.chown(path, 0, NOBODY.pw_gid)
    set_acl(path, (_USER_OBJ, 6, _UNDEFINED), (_GROUP_OBJ, 0, _UNDEFINED), (_GROUP, 4, 0),
            (_MASK, 6, _UNDEFINED), (_OTHER, 6, _UNDEFINED))


def _acl_masking_nobody(path: str) -> None:  # nobody's entry reads and writes, its mask only reads
    set_acl(path, (_USER_OBJ, 6, _UNDEFINED), (_USER, 6, NOBODY.pw_uid), (_GROUP_OBJ, 0, _UNDEFINED),
            (_MASK, 4, _UNDEFINED), (_OTHER, 6, _UNDEFINED))


@pytest.mark.parametrize("deny", [_acl_denying_nobody_by_name, _acl_denying_nobodys_group, _acl_masking_nobody])
def test_nobody_cannot_register_an_object_its_acl_keeps_from_it(server, root_object, deny):
    """The kernel refuses nobody these objects by their ACL, though their mode bits would let it
    in: so does the server (before, it read the mode alone and served their bytes to nobody)."""
    deny("/dev/shm" + root_object)
    got = run_as_nobody(STEAL, {"proto": "http", "url": url(server, "http"), "name": "acl", "key": root_object})
    assert "stolen" not in got, f"nobody read an object its ACL keeps from it: {got}"
    assert got["status"] == "403" and f"uid {NOBODY.pw_uid} may not read and write it" in got["message"], got
    assert status_names(server) == []


def test_nobody_registers_a_private_object_whose_acl_names_it(server, root_object):
    set_acl("/dev/shm" + root_object, (_USER_OBJ, 6, _UNDEFINED), (_USER, 6, NOBODY.pw_uid),
            (_GROUP_OBJ, 0, _UNDEFINED), (_MASK, 6, _UNDEFINED), (_OTHER, 0, _UNDEFINED))
    got = run_as_nobody(STEAL, {"proto": "grpc", "url": url(server, "grpc"), "name": "named", "key": root_object})
    assert got == {"stolen": [2 * k + 99 for k in range(1, N + 1)]}
    assert status_names(server) == []


@pytest.mark.parametrize("key, why", [("link", "it is a symbolic link"), ("..", "not the name of a shared-memory object")])
def test_a_key_that_names_no_object_is_refused_saying_why(server, root_object, key, why):
    link = f"/dev/shm/tshm_{server.id}_link"
    os.symlink("/dev/shm" + root_object, link)
    key = "/" + os.path.basename(link) if key == "link" else "/" + key
    try:
        got = run_as_nobody(STEAL, {"proto": "http", "url": url(server, "http"), "name": "odd", "key": key})
    finally:
        os.unlink(link)
    assert got == {"status": "500", "message": f"Unable to open shared memory region: '{key}': {why}"}
    assert status_names(server) == []


def holding(pids: list[int], key: str) -> list[int]:
    """Those of ``pids`` with a descriptor or a mapping of /dev/shm<key> (deleted or not)."""
    path = "/dev/shm" + key
    out = []
    for pid in pids:
        try:
            fds = {os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if path in fds or processes_mapping([pid], key):
            out.append(pid)
    return out


def test_an_unregistered_region_is_let_go_by_every_server_process(server):
    """Once unregistered (and unlinked by its client), no process of the server keeps the object
    open: before, each worker kept the last 256 regions it had used, and their memory, from
    /dev/shm, until it exited."""
    key = f"/tshm_{server.id}_gone_{next(_keys)}"
    handle = shm.create_shared_memory_region("gone", key, 3 * NB, create_only=True)
    a = np.arange(N, dtype=np.int32)
    shm.set_shared_memory_region(handle, [a, a])
    c = client_of("http", url(server, "http"))
    try:
        c.register_system_shared_memory("gone", key, 3 * NB)
        inputs = []
        for k, input_name in enumerate(("INPUT0", "INPUT1")):
            t = httpclient.InferInput(input_name, [N], "INT32")
            t.set_shared_memory("gone", NB, offset=k * NB)
            inputs.append(t)
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("gone", NB, offset=2 * NB)
        c.infer("add_sub", inputs, outputs=[out])
        assert shm.get_contents_as_numpy(handle, np.int32, [N], offset=2 * NB).tolist() == (2 * a).tolist()
        assert holding(server.tree(), key), "no server process opened the region"
        c.unregister_system_shared_memory("gone")
    finally:
        shm.destroy_shared_memory_region(handle)
        c.close()
    wait_until(lambda: holding(server.tree(), key) == [], "every server process let go of the unregistered region", 30)


# What nobody runs: its own object, registered, used for inputs and output, unregistered.
OWN = """
proto, url, name, key = args["proto"], args["url"], args["name"], args["key"]
mod = httpclient if proto == "http" else grpcclient
c = mod.InferenceServerClient(url)
handle = shm.create_shared_memory_region(name, key, 3 * 64, create_only=True)
try:
    a = np.arange(16, dtype=np.int32)
    shm.set_shared_memory_region(handle, [a, a * 3])
    c.register_system_shared_memory(name, key, 3 * 64)
    inputs = []
    for k, input_name in enumerate(("INPUT0", "INPUT1")):
        t = mod.InferInput(input_name, [16], "INT32")
        t.set_shared_memory(name, 64, offset=k * 64)
        inputs.append(t)
    out = mod.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory(name, 64, offset=128)
    c.infer("add_sub", inputs, outputs=[out])
    result = {"owner": os.stat("/dev/shm" + key).st_uid,
              "sum": shm.get_contents_as_numpy(handle, np.int32, [16], offset=128).tolist()}
    c.unregister_system_shared_memory(name)
    status = c.get_system_shared_memory_status()
    result["after"] = len(status if proto == "http" else status.regions)
finally:
    shm.destroy_shared_memory_region(handle)
"""


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_nobody_cannot_register_roots_private_object(server, root_object, proto):
    got = run_as_nobody(STEAL, {"proto": proto, "url": url(server, proto), "name": "stolen", "key": root_object})
    assert "stolen" not in got, f"nobody read root's 0600 object: {got}"
    assert got["status"] == ("403" if proto == "http" else "StatusCode.PERMISSION_DENIED"), got
    assert got["message"].startswith(f"Unable to open shared memory region: '{root_object}': permission denied")
    assert status_names(server) == []


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_nobody_registers_a_root_object_whose_mode_lets_it(server, root_object, proto):
    os.chmod("/dev/shm" + root_object, 0o666)
    got = run_as_nobody(STEAL, {"proto": proto, "url": url(server, proto), "name": "shared", "key": root_object})
    assert got == {"stolen": [2 * k + 99 for k in range(1, N + 1)]}
    assert status_names(server) == []


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_nobody_registers_and_uses_its_own_object(server, proto):
    key = f"/tshm_{server.id}_nobody_{next(_keys)}"
    try:
        got = run_as_nobody(OWN, {"proto": proto, "url": url(server, proto), "name": "own", "key": key})
    finally:
        if os.path.exists("/dev/shm" + key):
            os.unlink("/dev/shm" + key)
    assert got == {"owner": 65534, "sum": [4 * k for k in range(N)], "after": 0}


def test_nobody_cannot_unregister_roots_region(server, root_object):
    """Another uid's region stays, by name or by unregister-all, on either protocol."""
    c = httpclient.InferenceServerClient(url(server, "http"))
    try:
        c.register_system_shared_memory("roots", root_object, 2 * NB)
        got = run_as_nobody("""
out = []
for proto in ("http", "grpc"):
    c = (httpclient if proto == "http" else grpcclient).InferenceServerClient(args[proto])
    try:
        c.unregister_system_shared_memory("roots")
        out.append("unregistered")
    except InferenceServerException as e:
        out.append(str(e.status()))
    c.unregister_system_shared_memory()  # all: only its own, none
result = out
""", {"http": url(server, "http"), "grpc": url(server, "grpc")})
        assert got == ["403", "StatusCode.PERMISSION_DENIED"]
        assert status_names(server) == ["roots"]
        c.unregister_system_shared_memory("roots")  # its owner may
        assert status_names(server) == []
    finally:
        c.close()


@pytest.mark.parametrize("proto", ["http", "grpc"])
@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
def test_loopback_peers_of_every_form_register(server, root_object, proto, host):
    """grpcio names a peer of ``localhost`` (IPv6 first) ``ipv6:%5B::1%5D:port``."""
    c = client_of(proto, url(server, proto, host))
    try:
        c.register_system_shared_memory("loop", root_object, 2 * NB)
        assert status_names(server) == ["loop"]
        c.unregister_system_shared_memory("loop")
        assert status_names(server) == []
    finally:
        c.close()


@pytest.fixture
def local(server):
    c = Client(server.id)
    yield c
    c.close()


def test_a_local_clients_objects_are_its_own(server, local, root_object):
    """Its key cannot be registered by a network client; its region cannot be unregistered, or
    replaced under its name, by one; and its next request reads its own data."""
    region = local.create_region("lc_own", 2 * NB)
    a = region.array(np.int32, (N,))
    b = region.array(np.int32, (N,), offset=NB)
    a[:] = np.arange(N)
    b[:] = 1000
    assert region.key.startswith(f"/shmclient.{local._conn.ticket}.")  # noqa: SLF001
    http = httpclient.InferenceServerClient(url(server, "http"))
    try:
        with pytest.raises(InferenceServerException) as e:
            http.register_system_shared_memory("lc_stolen", region.key, 2 * NB)
        assert e.value.status() == "400" and "reserved prefix 'shmclient.'" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            http.unregister_system_shared_memory("lc_own")
        assert e.value.status() == "403" and "registered by another client" in e.value.message()
        http.unregister_system_shared_memory()  # all of its own: none
        with pytest.raises(InferenceServerException) as e:  # the name is still taken
            http.register_system_shared_memory("lc_own", root_object, 2 * NB)
        assert "already in manager" in e.value.message()
        assert status_names(server) == ["lc_own"]
        got = local.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        assert got["OUTPUT0"].tolist() == [1000 + k for k in range(N)]
    finally:
        http.close()
    local.unregister_region("lc_own")
    assert status_names(server) == []


def test_another_local_clients_key_is_refused(server, local):
    """A local client may name only its own process's ``/shmclient.<ticket>.`` objects."""
    key = f"/shmclient.{local._conn.ticket + 1}.not_mine_{next(_keys)}"  # noqa: SLF001
    handle = shm.create_shared_memory_region("nm", key, NB, create_only=True)
    try:
        with pytest.raises(InferenceServerError) as e:
            local._control(RegisterSystemRegion("nm", key, NB))  # noqa: SLF001
        assert e.value.status == 400 and "reserved prefix 'shmclient.'" in e.value.message
    finally:
        shm.destroy_shared_memory_region(handle)
    assert status_names(server) == []


def test_an_admin_with_the_key_unregisters_any_region(module_factory):
    header = {ADMIN[0]: ADMIN[1]}
    metadata = {"triton-grpc-protocol-" + ADMIN[0]: ADMIN[1]}
    srv = start_shm_server(module_factory, [f"--http-restricted-api=shared-memory:{ADMIN[0]}={ADMIN[1]}",
                                            f"--grpc-restricted-protocol=shared-memory:{ADMIN[0]}={ADMIN[1]}"])
    http = httpclient.InferenceServerClient(srv.url)
    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    with Client(srv.id) as lc:
        lc.create_region("lc_a", NB)
        lc.create_region("lc_b", NB)
        lc.create_region("lc_c", NB)
        try:
            with pytest.raises(InferenceServerException) as e:  # no key: the restricted group's 403
                http.unregister_system_shared_memory("lc_a")
            assert e.value.status() == "403"
            http.unregister_system_shared_memory("lc_a", headers=header)
            grpc_client.unregister_system_shared_memory("lc_b", headers=metadata)
            assert [r["name"] for r in http.get_system_shared_memory_status(headers=header)] == ["lc_c"]
            http.unregister_system_shared_memory(headers=header)  # all, as an admin: every region
            assert http.get_system_shared_memory_status(headers=header) == []
            with pytest.raises(InferenceServerError) as e2:  # the local client sees it gone
                lc.infer("add_sub", {"INPUT0": lc._regions["lc_c"].array(np.int32, (N,)),  # noqa: SLF001
                                     "INPUT1": np.zeros(N, np.int32)})
            assert e2.value.status == 404  # no such region now (Triton: NOT_FOUND)
        finally:
            http.close()
            grpc_client.close()


def test_admin_key_does_not_open_what_the_caller_could_not(module_factory):
    srv = start_shm_server(module_factory, [f"--http-restricted-api=shared-memory:{ADMIN[0]}={ADMIN[1]}"])
    key = f"/tshm_{srv.id}_root_admin"
    handle = shm.create_shared_memory_region("root", key, 2 * NB, create_only=True)
    try:
        got = run_as_nobody("""
c = httpclient.InferenceServerClient(args["url"])
try:
    c.register_system_shared_memory("r", args["key"], 128, headers={"admin-key": "s3cret"})
    result = "registered"
except InferenceServerException as e:
    result = str(e.status())
""", {"url": srv.url, "key": key})
    finally:
        shm.destroy_shared_memory_region(handle)
    assert got == "403"


def test_allow_client_shm_false_refuses_client_regions_with_tritons_text(module_factory):
    srv = start_shm_server(module_factory, ["--allow-client-shm=false"])
    key = f"/tshm_{srv.id}_off"
    handle = shm.create_shared_memory_region("off", key, NB, create_only=True)
    http = httpclient.InferenceServerClient(srv.url)
    grpc_client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        for call in (lambda: http.register_system_shared_memory("off", key, NB),
                     lambda: http.unregister_system_shared_memory("off"),
                     lambda: http.register_cuda_shared_memory("off", b"\0" * 64, 0, NB)):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert (e.value.status(), e.value.message()) == ("501", DISABLED)
        # Refused before the body is read, as Triton: a body that says nothing is refused the same.
        for kind in ("systemsharedmemory", "cudasharedmemory"):
            answer = raw_request(srv.port, "POST", f"/v2/{kind}/region/off/register", b"{}")
            assert (answer.status, answer.json()["error"]) == (501, DISABLED), kind
        for call in (lambda: grpc_client.register_system_shared_memory("off", key, NB),
                     lambda: grpc_client.unregister_system_shared_memory()):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert (e.value.status(), e.value.message()) == ("StatusCode.UNIMPLEMENTED", DISABLED)
        with Client(srv.id) as lc:
            with pytest.raises(InferenceServerError) as e2:
                lc.create_region("lc_off", NB)
            assert (e2.value.status, e2.value.message) == (501, DISABLED)
            assert not os.path.exists(f"/dev/shm/shmclient.{lc._conn.ticket}.lc_off")  # noqa: SLF001  # its object went too
            # inference without regions is served as ever
            assert lc.infer("add_sub", {"INPUT0": np.ones(N, np.int32),
                                        "INPUT1": np.ones(N, np.int32)})["OUTPUT0"].tolist() == [2] * N
        assert http.get_system_shared_memory_status() == []
        assert grpc_client.get_system_shared_memory_status().regions == {}
    finally:
        http.close()
        grpc_client.close()
        shm.destroy_shared_memory_region(handle)


def test_a_peer_on_this_host_is_checked_under_allow_remote_shm_too(module_factory, local_non_loopback_address):
    """--allow-remote-shm lets other hosts in; a peer of this host that comes through a
    non-loopback address is still known by its socket, and still may not open root's objects."""
    srv = start_shm_server(module_factory, ["--http-address", "0.0.0.0", "--grpc-address", "0.0.0.0",
                                            "--allow-remote-shm"])
    key = f"/tshm_{srv.id}_root_remote"
    handle = shm.create_shared_memory_region("root", key, 2 * NB, create_only=True)
    try:
        for proto in ("http", "grpc"):
            got = run_as_nobody(STEAL, {"proto": proto, "url": url(srv, proto, local_non_loopback_address),
                                        "name": "stolen", "key": key})
            assert got.get("status") == ("403" if proto == "http" else "StatusCode.PERMISSION_DENIED"), got
    finally:
        shm.destroy_shared_memory_region(handle)
    assert status_names(srv) == []


@pytest.mark.parametrize("peer, address", [
    ("ipv4:127.0.0.1:5000", ("127.0.0.1", 5000)),
    ("ipv6:[::1]:5000", ("::1", 5000)),
    ("ipv6:%5B::1%5D:5000", ("::1", 5000)),  # grpcio's form for a client of localhost
    ("ipv6:%5B::ffff:127.0.0.1%5D:5000", ("::ffff:127.0.0.1", 5000)),
    ("ipv6:%5Bfe80::1%25eth0%5D:5000", ("fe80::1%eth0", 5000)),
    ("unix:/tmp/socket", ("localhost", None)),
    ("unix-abstract:name", ("localhost", None)),
    ("vsock:3:5000", ("", None)),
])
def test_every_grpc_peer_form_is_read(peer, address):
    assert peer_address(peer) == address


def test_a_restarted_broker_checks_a_restored_region_against_its_owner_again(server_factory):
    """nobody registers its own object; root then takes the object over (chown to root, 0600).
    The broker restarted after that does not register it again for nobody, and serves on."""
    srv = start_shm_server(server_factory)
    key = f"/tshm_{srv.id}_taken_over"
    try:
        got = run_as_nobody("""
posix_ipc.SharedMemory(args["key"], posix_ipc.O_CREX, mode=0o600, size=128).close_fd()  # no tracker to unlink it
httpclient.InferenceServerClient(args["url"]).register_system_shared_memory("mine", args["key"], 128)
result = os.stat("/dev/shm" + args["key"]).st_uid
""", {"url": srv.url, "key": key})
        assert got == 65534 and status_names(srv) == ["mine"]
        os.chown("/dev/shm" + key, 0, 0)
        broker = next(pid for pid, t in srv.titles().items() if t.startswith("shmserve broker "))
        os.kill(broker, signal.SIGKILL)
        srv.wait_until(lambda: next((p for p, t in srv.titles().items() if t.startswith("shmserve broker ")),
                                    broker) != broker and srv.http_status("/v2/health/ready") == 200,
                       "a new broker serving")
        assert status_names(srv) == []
        assert "'mine' not restored after a broker restart: Unable to open shared memory region" in srv.log()
    finally:
        if os.path.exists("/dev/shm" + key):
            os.unlink("/dev/shm" + key)
