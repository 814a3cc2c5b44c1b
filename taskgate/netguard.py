"""Which addresses a webhook may reach: public ones only (the server-side request forgery guard)."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
# Ranges the stdlib calls global on Python 3.11 but that are not reachable public hosts.
_DENIED_NETWORKS = tuple(
    ipaddress.ip_network(n) for n in ("192.0.0.0/24", "fec0::/10", "64:ff9b:1::/48", "2001:db8::/32")
)


def forbidden_address(addr: IPAddress) -> bool:
    """True for loopback, private, link-local, multicast, reserved, metadata and other non-public addresses."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if isinstance(addr, ipaddress.IPv6Address) and addr.sixtofour is not None:
        addr = addr.sixtofour
    return (
        addr in METADATA_ADDRESSES
        or any(addr in net for net in _DENIED_NETWORKS if net.version == addr.version)
        or addr.is_loopback
        or addr.is_private
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_unspecified
        or not addr.is_global
    )
