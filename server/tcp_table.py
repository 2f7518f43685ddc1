"""The kernel's tables of TCP sockets (``/proc/net/tcp`` and ``tcp6``), read as typed rows: who
owns a peer's socket (``frontend/peer_uid.py``) and who listens on a port (``port_holder.py``).

Each row gives a socket's two ends, its state, the uid that made it and its inode; a process that
holds the socket has a descriptor linking to ``socket:[inode]`` (``socket_inodes``).
"""
from __future__ import annotations

import ipaddress
import os
import sys
from typing import NamedTuple

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")  # this process's network namespace
_LITTLE = sys.byteorder == "little"  # the kernel writes each 32-bit word of an address in host order
TIME_WAIT = 0x06  # a closed connection's remains: no owner (uid 0), never a live peer
LISTEN = 0x0A  # a listening socket

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


def socket_rows(address: Address | None = None) -> list[SocketRow]:
    """The rows of the kernel's TCP tables with ``address`` at either end, or all of them (the
    tables hold every socket of the host: with an address only the lines that name it are parsed)."""
    needles = _needles(address) if address is not None else [""]
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


def socket_inodes(pid: int | str = "self") -> set[int]:
    """The inodes of the sockets process ``pid`` holds (empty if it is gone or not ours to read)."""
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes
