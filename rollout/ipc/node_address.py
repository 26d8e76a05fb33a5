"""NodeAddress: this node's address toward a peer (the rendezvous host) and the network interface
that holds it, so that sockets and gloo use the network the nodes reach each other on.

Nothing assumes loopback: for a one-node server the peer is 127.0.0.1 and the interface comes out
as `lo`; for many nodes it is the route toward --dist-init-addr's host. The local address is what
the kernel picks to reach the peer (a UDP connect sends no packet); the interface is the one that
holds that address (not the route's device: toward an address of this very node the route goes
over `lo`, while the peers reach it on the interface that holds it).
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


def _address_toward(host: str) -> str:
    """The local address the kernel uses to reach host (host name or address)."""
    try:
        infos = socket.getaddrinfo(host, 1, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc.strerror or exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _interface_by_ioctl(address: str) -> Optional[str]:
    """The interface whose primary IPv4 address is `address` (Linux ioctl, no subprocess)."""
    try:
        import fcntl  # noqa: PLC0415
        import struct  # noqa: PLC0415
    except ImportError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def _interface_by_ip_command(address: str) -> Optional[str]:
    """The interface that holds `address` as `ip -o addr` lists it (secondary and IPv6 addresses)."""
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and words[2] in ("inet", "inet6") and words[3].split("/")[0] == address:
            return words[1].split("@")[0]
    return None


@dataclass(frozen=True)
class NodeAddress:
    address: str               # this node's address toward the peer
    interface: Optional[str]   # the interface that holds it (None: not found)

    @classmethod
    def toward(cls, host: str) -> "NodeAddress":
        """This node's address (and interface) toward host; ValueError when host does not resolve."""
        address = _address_toward(host)
        if ipaddress.ip_address(address).version == 4:
            interface = _interface_by_ioctl(address) or _interface_by_ip_command(address)
        else:
            interface = _interface_by_ip_command(address)
        return cls(address, interface)

    def zmq_endpoint(self) -> str:
        """A tcp:// endpoint on this address whose port the OS picks when bound."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:*"

    def set_socket_interfaces(self, env: Optional[dict] = None) -> None:
        """Points gloo (and NCCL's bootstrap) at this interface, unless the user set them
        (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)."""
        env = os.environ if env is None else env
        if self.interface is None:
            logger.warning("no network interface holds %s: gloo picks its own (set GLOO_SOCKET_IFNAME)", self.address)
            return
        env.setdefault("GLOO_SOCKET_IFNAME", self.interface)
        env.setdefault("NCCL_SOCKET_IFNAME", self.interface)
