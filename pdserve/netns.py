"""Separate hosts on one Linux machine, for multi-host tests and benchmarks (root only).

Each host is a network namespace with one veth link to a bridge and one address in a private
/24 of 10.213.0.0/16; the root namespace gets the bridge's address, so a test or bench process
reaches every host. The hosts have no route anywhere else: their traffic stays on these links.
A process runs on a host under `ip netns exec` (Host.command), or moves itself there
(Host.enter). Links can be cut, made lossy (nftables) or rate-limited (tc tbf).

Every name carries the creating process's id (and a count of its networks), so parallel runs
never collide, and a run removes what a crashed earlier one left (its pid no longer alive)
before it starts:

    with Network() as network:
        redis, worker = network.host("redis"), network.host("prefill")
        subprocess.Popen(worker.command(["pdserve", "prefill", "--host", worker.address, ...]))
        with network.cut(worker, redis):
            ...
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

NAMESPACE_PREFIX = "pdnet"
_NAMESPACE = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)n\d+-\S+")
_LINK = re.compile(r"^pd(\d+)n\d+(?:br|v\d+)$")
_CLONE_NEWNET = 0x40000000
_FIRST_HOST = 10  # .1 is the root namespace's address on the bridge
_NFT_TABLE = "pdserve_faults"
_networks = itertools.count()  # this process's, for their names


class NamespacesUnavailableError(RuntimeError):
    """This machine (or user) cannot create network namespaces: the reason says why."""


def _run(*argv: str, namespace: str | None = None, stdin: str | None = None) -> str:
    command = ["ip", "netns", "exec", namespace, *argv] if namespace else list(argv)
    done = subprocess.run(command, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why Network() cannot work here (not root, no `ip`), else None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` or `tc` is missing (install iproute2)"
    return None


def faults_unavailable_reason() -> str | None:
    """Why cut() and lossy() cannot work here (no `nft`), else None."""
    return None if shutil.which("nft") else "`nft` is missing (install nftables)"


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    namespace: str
    address: str
    link: str  # the root-side end of its veth pair; "eth0" is the end inside

    @property
    def environment(self) -> dict[str, str]:
        """What a process on this host runs with. Hosts share no memory: UCX must not reach a
        peer by shared memory or cross-memory attach, which it would on this one machine (and
        so bypass the link under test)."""
        return {"UCX_TLS": "^sm"}

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv run on this host (ip netns exec and env exec it: the pid stays the process's)."""
        settings = [f"{name}={value}" for name, value in self.environment.items()]
        return ["ip", "netns", "exec", self.namespace, "env", *settings, *argv]

    def enter(self) -> None:
        """Moves the calling process onto this host's network (before it opens any socket;
        it should then take on self.environment too)."""
        fd = os.open(f"/var/run/netns/{self.namespace}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.namespace}")
        finally:
            os.close(fd)


class Network:
    """A bridge and the hosts on it; close() (or leaving the with block) removes them all,
    ending any process still running on a host."""

    def __init__(self) -> None:
        if (reason := unavailable_reason()) is not None:
            raise NamespacesUnavailableError(reason)
        remove_stale()
        self.tag = f"{os.getpid()}n{next(_networks)}"  # interface names: at most 15 characters
        self.subnet = _free_subnet()
        self.bridge = f"pd{self.tag}br"
        self.hosts: list[Host] = []
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except RuntimeError as e:
            self.close()
            raise NamespacesUnavailableError(str(e)) from e

    def host(self, name: str) -> Host:
        index = len(self.hosts)
        host = Host(
            name, f"{NAMESPACE_PREFIX}{self.tag}-{name}", f"{self.subnet}.{_FIRST_HOST + index}",
            f"pd{self.tag}v{index}",
        )  # fmt: skip
        self.hosts.append(host)
        _run("ip", "netns", "add", host.namespace)
        _run("ip", "link", "add", host.link, "type", "veth", "peer", "name", "eth0",
             "netns", host.namespace)  # fmt: skip
        _run("ip", "link", "set", host.link, "master", self.bridge, "up")
        for command in (("ip", "link", "set", "lo", "up"),
                        ("ip", "addr", "add", f"{host.address}/24", "dev", "eth0"),
                        ("ip", "link", "set", "eth0", "up")):  # fmt: skip
            _run(*command, namespace=host.namespace)
        return host

    # ---- faults: each lasts until its with block ends -----------------------------------
    @contextlib.contextmanager
    def cut(self, host: Host, *peers: Host) -> Iterator[None]:
        """A partition: every packet between host and the peers is dropped, both ways."""
        with self._dropping(host, peers, ""):
            yield

    @contextlib.contextmanager
    def lossy(self, host: Host, *peers: Host, percent: int) -> Iterator[None]:
        """Drops percent % of the packets between host and the peers, at random, both ways."""
        with self._dropping(host, peers, f"numgen random mod 100 < {percent}"):
            yield

    @contextlib.contextmanager
    def rate_limited(self, host: Host, rate: str) -> Iterator[None]:
        """Host's link carries at most rate (tc's units: 10gbit, 1gbit) in each direction."""
        # A token bucket of 10 ms at the rate (and at least two 64 KiB GSO packets), so that a
        # fast link is not held back by a bucket smaller than what one timer tick releases.
        bytes_per_s = _rate_bytes_per_s(rate)
        burst = str(max(bytes_per_s // 100, 128 * 1024))
        ends = ((host.link, None), ("eth0", host.namespace))
        for device, namespace in ends:
            _run("tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", "50ms", namespace=namespace)  # fmt: skip
        try:
            yield
        finally:
            for device, namespace in ends:
                _run("tc", "qdisc", "del", "dev", device, "root", namespace=namespace)

    @contextlib.contextmanager
    def _dropping(self, host: Host, peers: Sequence[Host], match: str) -> Iterator[None]:
        if (reason := faults_unavailable_reason()) is not None:
            raise NamespacesUnavailableError(reason)
        # On the host itself, input and output: the peers see nothing either way.
        rule = f"add rule inet {_NFT_TABLE}"
        rules = []
        for peer in peers:
            rules += [f"{rule} input ip saddr {peer.address} {match} drop",
                      f"{rule} output ip daddr {peer.address} {match} drop"]  # fmt: skip
        _run("nft", "-f", "-", namespace=host.namespace, stdin="\n".join([
            f"add table inet {_NFT_TABLE}",
            f"add chain inet {_NFT_TABLE} input {{ type filter hook input priority 0; }}",
            f"add chain inet {_NFT_TABLE} output {{ type filter hook output priority 0; }}",
            *rules, ""]))  # fmt: skip
        try:
            yield
        finally:
            _run("nft", "delete", "table", "inet", _NFT_TABLE, namespace=host.namespace)

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        for host in self.hosts:
            _remove_namespace(host.namespace)
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts = []

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rate_bytes_per_s(rate: str) -> int:
    match = re.fullmatch(r"(\d+)([kmg]?)bit", rate)
    if match is None:
        raise ValueError(f"rate {rate!r}: expected e.g. 10gbit, 1gbit, 500mbit")
    number, unit = match.groups()
    return int(number) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[unit] // 8


def _free_subnet() -> str:
    """A 10.213.N subnet no interface here uses (each run has its own: parallel runs too)."""
    used = set(re.findall(r"inet 10\.213\.(\d+)\.", _run("ip", "-4", "-o", "addr", "show")))
    for n in [(os.getpid() + i) % 254 + 1 for i in range(254)]:
        if str(n) not in used:
            return f"10.213.{n}"
    raise NamespacesUnavailableError("every 10.213.N.0/24 subnet is in use")


def _remove_namespace(namespace: str) -> None:
    """Ends the processes still on it, then deletes it (and with it its veth pair)."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Removes the namespaces and links of runs whose process is gone (a crash, a SIGKILL)."""
    for line in _run("ip", "netns", "list").splitlines():
        if (match := _NAMESPACE.match(line)) and not _alive(int(match.group(1))):
            _remove_namespace(line.split()[0])
    for line in _run("ip", "-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if (match := _LINK.match(name)) and not _alive(int(match.group(1))):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
