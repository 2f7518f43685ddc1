"""Which local user is on the other end of a TCP connection: the owner of the peer's socket.

A peer on this host has its own socket in the kernel's tables (``/proc/net/tcp`` and ``tcp6``)
with our address as its remote end; the table's ``uid`` column is the user that made it, as
identd-style lookups read it. Both network frontends use this to know who registers shared
memory (``shm_callers.py``). A peer on another host has no socket here: ``None``.
"""
from __future__ import annotations

import ipaddress
import os
import sys
from typing import NamedTuple

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")  # this process's network namespace
_LITTLE = sys.byteorder == "little"  # the kernel writes each 32-bit word of an address in host order
_TIME_WAIT = 0x06  # a closed connection's remains: no owner (uid 0), never a live peer

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


class SocketRow(NamedTuple):
    local: Address
    remote: Address
    state: int
    uid: int
    inode: int


def normal_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an address, an IPv4-mapped IPv6 one as its IPv4 address (the same peer shows
    as either, depending on which side is dual-stack). Raises ValueError."""
    address = ipaddress.ip_address(host.split("%", 1)[0].strip("[]"))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _kernel_hex(packed: bytes) -> str:
    """An address as the tables write it: each 32-bit word in host byte order, in hex."""
    words = (packed[i:i + 4][::-1] if _LITTLE else packed[i:i + 4] for i in range(0, len(packed), 4))
    return b"".join(words).hex().upper()


def _kernel_address(text: str) -> Address:
    """``0100007F:8F63`` (tcp) or 32 hex digits and a port (tcp6), back to an address."""
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    ip = ipaddress.ip_address(bytes.fromhex(_kernel_hex(raw)))  # the same word swap undoes itself
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(hex_port, 16)


def _needles(address: Address) -> list[str]:
    """How ``address`` appears in the tables: in tcp, or in tcp6 (an IPv4 one as IPv4-mapped)."""
    ip, port = address
    forms = [ip.packed]
    if isinstance(ip, ipaddress.IPv4Address):
        forms.append(ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed).packed)
    return [f"{_kernel_hex(packed)}:{port:04X}" for packed in forms]


def socket_rows(address: Address) -> list[SocketRow]:
    """The rows of the kernel's TCP tables with ``address`` at either end (the tables hold
    every socket of the host: only the lines that name it are parsed)."""
    needles = _needles(address)
    rows: list[SocketRow] = []
    for table in TABLES:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]  # after the header
        except OSError:  # no IPv6 in this kernel, or no /proc
            continue
        for line in lines:
            if not any(n in line for n in needles):
                continue
            fields = line.split()
            try:
                rows.append(SocketRow(_kernel_address(fields[1]), _kernel_address(fields[2]),
                                      int(fields[3], 16), int(fields[7]), int(fields[9])))
            except (ValueError, IndexError):
                continue
    return rows


def _own_socket_inodes() -> set[int]:
    inodes: set[int] = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def peer_uid(peer_host: str, peer_port: int, server: tuple[str, int] | None = None) -> int | None:
    """The uid that owns the peer's end of our connection with ``peer_host:peer_port``, or None
    if no socket here is that end (a peer on another host) or the answer is not certain.

    ``server``: our end of the connection (HTTP knows it). Without it (gRPC does not say), our
    end is found as the local address of this process's own socket whose remote end is the peer.
    Only a socket a process still holds counts (an orphaned one shows uid 0), and two owners
    for one end is no answer.
    """
    try:
        peer: Address = (normal_ip(peer_host), int(peer_port))
        ours = {(normal_ip(server[0]), int(server[1]))} if server is not None else None
    except (ValueError, TypeError):
        return None
    rows = socket_rows(peer)
    if ours is None:
        mine = _own_socket_inodes()
        ours = {r.local for r in rows if r.remote == peer and r.inode in mine}
    uids = {r.uid for r in rows
            if r.local == peer and r.remote in ours and r.inode != 0 and r.state != _TIME_WAIT}
    return uids.pop() if len(uids) == 1 else None
