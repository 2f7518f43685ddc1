"""What every network frontend (HTTP and gRPC) says about the server the same way: its protocol
extensions, which peers may register shared memory, and that it serves its repositories as one."""
from __future__ import annotations

import ipaddress

EXTENSIONS = ["classification", "binary_tensor_data", "model_configuration", "system_shared_memory",
              "cuda_shared_memory", "generate", "sequence", "schedule_policy", "model_repository",
              "model_repository(unload_dependents)", "parameters", "statistics", "logging", "trace"]
# Triton's refusal of a repository call naming its repository (HTTP 501, gRPC UNIMPLEMENTED).
NAMED_REPOSITORY = "'repository_name' specification is not supported"


def is_loopback(host: str) -> bool:
    """Whether a peer address is this host. A server bound to ``::`` sees IPv4 clients as
    IPv4-mapped addresses (``::ffff:127.0.0.1``), which are loopback when the IPv4 one is."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone (``fe80::1%eth0``)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
