"""Which addresses a webhook may reach: public ones only (the server-side request forgery guard).

One policy for submit (checking a callback URL) and the notifier (sending to it): resolve the host once, refuse it
if ANY address is forbidden, and connect only to an address that was checked (closing the DNS-rebinding gap).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

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


class Refused(Exception):
    """A host a webhook must not reach; the message says why."""


async def resolve(host: str, port: int, *, within: float) -> list[IPAddress]:
    """Every address `host` resolves to, in resolver order (numeric forms such as 2130706433 or 0x7f.1 included)."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), within)
    found: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])  # drop an IPv6 scope id
        if address not in found:
            found.append(address)
    return found


async def checked_address(host: str, port: int, *, within: float, allow_hosts: Iterable[str] = ()) -> IPAddress:
    """The address to connect to for `host`: resolved once, refused if any of its addresses is forbidden.

    An allow-listed host (operators' own receivers) skips the address check but is still resolved once.
    """
    try:
        addresses = await resolve(host, port, within=within)
    except (OSError, TimeoutError, UnicodeError, ValueError):
        raise Refused("host does not resolve") from None
    if not addresses:
        raise Refused("host does not resolve")
    allowed = host.lower() in {h.lower() for h in allow_hosts}
    if not allowed and any(forbidden_address(a) for a in addresses):
        raise Refused("resolves to a loopback, private, link-local or metadata address")
    return addresses[0]


@dataclass(frozen=True, slots=True)
class Pinned:
    """A request target with its host replaced by the one address that was checked, and what keeps TLS and HTTP
    naming the original host (the Host header, the TLS server name that SNI sends and the certificate is checked
    against)."""

    url: httpx.URL
    headers: dict[str, str]
    extensions: dict[str, Any]


async def pin(url: httpx.URL, *, schemes: Iterable[str], within: float, allow_hosts: Iterable[str] = ()) -> Pinned:
    """`url` pinned to its checked address: Refused names why a scheme, a host or an address may not be reached."""
    if url.scheme not in set(schemes) or not url.host:
        raise Refused(f"scheme {url.scheme!r} is not allowed")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        address = await checked_address(url.host, port, within=within, allow_hosts=allow_hosts)
    except Refused as exc:
        raise Refused(f"{url.host}: {exc}") from None
    extensions: dict[str, Any] = {"sni_hostname": url.host} if url.scheme == "https" else {}
    return Pinned(url.copy_with(host=str(address)), {"host": url.netloc.decode("ascii")}, extensions)
