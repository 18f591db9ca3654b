"""Is an address loopback only? The one check behind "nothing leaves loopback without keys",
for HTTP hosts and ZMQ endpoints alike.

Only what surely stays on this machine passes: a loopback IP literal (127.0.0.0/8, ::1), a
host name that resolves to loopback addresses only (``localhost``), ``ipc://`` and
``inproc://``. Everything else is treated as reachable from the network: wildcards (``*``,
``0``, ``0.0.0.0``, ``::``), interface names (``tcp://eth0:5557``: ZMQ binds the interface's
address), other addresses, names that do not resolve.
"""
from __future__ import annotations

import ipaddress
import socket


def is_loopback_host(host: str) -> bool:
    h = host.strip().strip("[]")
    if not h or h in ("*", "0"):
        return False
    try:
        return ipaddress.ip_address(h.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addrs = {info[4][0].split("%")[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (a ``SRC;DST`` connect uses DST); None for
    ipc/inproc."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    rest = endpoint.split("://", 1)[-1]
    rest = rest.rsplit(";", 1)[-1]
    host, sep, _ = rest.rpartition(":")
    return host if sep else rest


def endpoint_is_loopback(endpoint: str) -> bool:
    host = endpoint_host(endpoint)
    return host is None or is_loopback_host(host)
