"""The address a rank advertises to its replica peers: one they can reach.

[Note: rendezvous address] The replica's TCPStore, its gloo sockets and its heartbeat
([Note: a replica leaves as a unit] in groups/replica_group.py) must be reachable from every
rank of the replica. ``gethostbyname(gethostname())`` is not: Debian/Ubuntu map the host name to
127.0.1.1, and on the namespace nodes of the tests it does not resolve at all (the old code then
fell back to 127.0.0.1). The rule, applied by every rank at bootstrap with the replica's host
names and interface addresses exchanged over MPI (which already reaches every host):

1. every rank of the replica on this host (same host name): 127.0.0.1, as before;
2. otherwise the local IPv4 address the kernel routes to a peer on another host (a UDP
   ``connect()`` + ``getsockname()``: a route lookup, no packet sent), taken among the
   interfaces the job's MPI uses (``OMPI_MCA_btl_tcp_if_include`` / ``_if_exclude``, which
   mpirun exports to every rank) and never a loopback one; the peer's addresses that are also
   this host's (a docker0 on every host) are skipped;
3. ``RECOVER_HSDP_STORE_HOST`` overrides the store's address (the documented override); refused
   if it is a loopback address while a peer is on another host;
4. no such address: refused in one line (a ``ConfigError``) on every rank of the replica.

gloo binds to the address its host name resolves to and falls back to loopback (which a remote
peer cannot reach); so when a replica spans hosts and the user did not set it,
``GLOO_SOCKET_IFNAME`` is set to the interface of the address of rule 2. NCCL's default
interface choice already excludes ``lo`` and ``docker*``: ``NCCL_SOCKET_IFNAME`` is left alone.

Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass

STORE_HOST_ENV = "RECOVER_HSDP_STORE_HOST"
LOCAL = "127.0.0.1"
_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


@dataclass(frozen=True)
class HostAddresses:
    """One rank's host name and the (interface, IPv4 address) pairs the job's MPI may use."""

    host: str
    interfaces: tuple[tuple[str, str], ...]

    @property
    def addresses(self) -> list[str]:
        return [address for _, address in self.interfaces]


def this_host(env=None) -> HostAddresses:
    """This host: its name and its non-loopback IPv4 interfaces, filtered like MPI's btl/tcp."""
    env = os.environ if env is None else env
    pairs = [(name, addr) for name, addr in interface_addresses()
             if not ipaddress.ip_address(addr).is_loopback and mpi_uses(name, addr, env)]
    return HostAddresses(socket.gethostname(), tuple(pairs))


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, primary IPv4 address) of every interface that has one (Linux ioctl; elsewhere
    the host name's addresses)."""
    if not sys.platform.startswith("linux"):
        try:
            return [("", a) for a in socket.gethostbyname_ex(socket.gethostname())[2]]
        except OSError:
            return []
    import fcntl

    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            found.append((name, socket.inet_ntoa(raw[20:24])))
    return found


def mpi_uses(interface: str, address: str, env) -> bool:
    """Whether Open MPI's btl/tcp may use this interface (its include/exclude lists: interface
    names or CIDRs, comma separated)."""
    include = env.get("OMPI_MCA_btl_tcp_if_include", "").strip()
    exclude = env.get("OMPI_MCA_btl_tcp_if_exclude", "").strip()
    if include:
        return _matches(include, interface, address)
    return not (exclude and _matches(exclude, interface, address))


def _matches(spec: str, interface: str, address: str) -> bool:
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "/" in item:
            try:
                if ipaddress.ip_address(address) in ipaddress.ip_network(item, strict=False):
                    return True
            except ValueError:
                continue
        elif item == interface:
            return True
    return False


def route_source(address: str) -> str | None:
    """The local address the kernel would send from to ``address`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            return sock.getsockname()[0]
    except OSError:
        return None


def route_network(address: str) -> tuple[str, str] | None:
    """(interface, its IPv4 network as a CIDR) this host sends from to ``address``: the
    interface the launcher gives MPI ([Note: MPI interfaces] in cli/launch.py). None: no route,
    or not Linux."""
    source = route_source(address)
    if source is None or ipaddress.ip_address(source).is_loopback \
            or not sys.platform.startswith("linux"):
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name, addr in interface_addresses():
            if addr != source:
                continue
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK,
                                  struct.pack("256s", name[:15].encode()))
            except OSError:
                return None
            mask = socket.inet_ntoa(raw[20:24])
            return name, str(ipaddress.ip_network(f"{source}/{mask}", strict=False))
    return None


def spans_hosts(hosts: list[HostAddresses]) -> bool:
    return len({h.host for h in hosts}) > 1


def route(peer: HostAddresses, own: set[str] | dict[str, str]) -> tuple[str, str] | None:
    """The route choice (rule 2 of [Note: rendezvous address]): (an address of ``peer``'s
    host, the local address the kernel sends to it from) for the first of ``peer``'s addresses
    that is not also this host's (a docker0 on every host is no route between them) and whose
    route source is one of ``own`` (this host's addresses the job's MPI uses); None: none."""
    for address in peer.addresses:
        if address in own:
            continue
        source = route_source(address)
        if source in own:
            return address, source
    return None


def local_address(hosts: list[HostAddresses], me: int) -> tuple[str, str | None]:
    """Rules 1, 2 and 4 of [Note: rendezvous address] for rank ``me`` of the replica ``hosts``:
    (the address its peers reach it at, its interface or None). Raises ``ValueError`` (one line)."""
    mine = hosts[me]
    remote = [h for h in hosts if h.host != mine.host]
    if not remote:
        return LOCAL, None
    own = dict((addr, name) for name, addr in mine.interfaces)
    for peer in remote:
        found = route(peer, own)
        if found is not None:
            return found[1], own[found[1]] or None
    raise ValueError(
        f"no address of host {mine.host} (usable by MPI: {sorted(own) or 'none'}) routes to its "
        f"replica peers on {sorted({h.host for h in remote})} ({[h.addresses for h in remote]}): "
        f"a replica spanning hosts needs a routable interface (check the network, or set "
        f"{STORE_HOST_ENV} and GLOO_SOCKET_IFNAME)")


def leader_address(leader: HostAddresses, mine: HostAddresses) -> str:
    """The address this host reaches ``leader``'s host at (a per-epoch group's store):
    loopback on the same host, else :func:`route`. Raises ``ValueError`` (one line)."""
    if leader.host == mine.host:
        return LOCAL
    found = route(leader, set(mine.addresses))
    if found is None:
        raise ValueError(f"no address of host {leader.host} ({leader.addresses}) is routable "
                         f"from {mine.host} over the job's interfaces "
                         f"({sorted(mine.addresses) or 'none'})")
    return found[0]


def store_address(hosts: list[HostAddresses], me: int, env=None) -> str:
    """Rule 3 over :func:`local_address`: the address the store is advertised at."""
    env = os.environ if env is None else env
    override = env.get(STORE_HOST_ENV, "").strip()
    if not override:
        return local_address(hosts, me)[0]
    if spans_hosts(hosts) and _is_loopback(override):
        raise ValueError(f"{STORE_HOST_ENV}={override} is a loopback address but the replica spans "
                         f"hosts {sorted({h.host for h in hosts})}: its peers cannot reach it")
    return override


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
