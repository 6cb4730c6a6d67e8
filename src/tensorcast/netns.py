"""Real hosts on one machine: each in its own network namespace, with its own address on a bridge, so that
processes on different hosts talk only over a network that tests can slow down, make lossy or cut.

Owns: creating the namespaces, the bridge (in the caller's namespace, which gets the address ``.254``
so that a test process reaches every host) and a veth pair per host; running commands in a host
(``exec_args``); faults (``partition``/``heal``: each side's neighbor entry for the other is pinned to a
MAC address nobody has, so packets between the two vanish silently, as in a real partition, while both
still reach everyone else; ``netem`` for delay and loss on a host's link; ``rate`` for its bandwidth
(``tbf``); ``loss`` for random loss by packet filter, which needs nftables but not the kernel's
``sch_netem``); and removing all of it, also
for namespaces and filter tables a crashed run left behind. Needs root (CAP_NET_ADMIN) and iproute2
(and nftables for ``loss``). Processes in different hosts still share the filesystem; distinct host ids
keep them off each other's shared memory. Does not own: what runs on the hosts
(``cluster.LocalCluster(netns=...)``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import subprocess

from tensorcast.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

__all__ = ["Hosts", "ROOT", "netns_available"]

ROOT = -1  # the namespace the test runs in, as a partition endpoint
_PREFIX = "tcn"
_NOWHERE = "02:00:00:00:00:01"  # a locally administered MAC address no interface here has


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def _nft(*args: str, ns: str | None = None, stdin: str | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    if shutil.which("nft") is None:
        raise Unavailable("nft not found (Debian: apt-get install nftables): packet loss cannot be injected")
    cmd = [*(["ip", "netns", "exec", ns] if ns else []), "nft", *args]
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise Unavailable(f"nft {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def netns_available() -> bool:
    """Whether this process may create network namespaces (root, iproute2)."""
    if os.geteuid() != 0:
        return False
    name = f"{_PREFIX}probe{os.getpid()}"
    try:
        ok = _ip("netns", "add", name, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    if ok:
        _ip("netns", "del", name, check=False)
    return ok


def _remove_stale() -> None:
    """Namespaces and bridges of runs whose process is gone (a crashed test run)."""
    names = _ip("netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", _ip("-o", "link", check=False).stdout, re.M)
    tables: list[str] = []
    if shutil.which("nft"):  # the loss filters' halves in this namespace (the others went with their hosts)
        tables = re.findall(r"^table netdev (\S+)$", _nft("list", "tables", "netdev", check=False).stdout, re.M)
    for name in [*names, *links, *tables]:
        m = re.fullmatch(rf"{_PREFIX}([0-9a-z]+)x\w*", name)
        if m and not os.path.exists(f"/proc/{int(m.group(1), 36)}"):
            if name in names:
                _ip("netns", "del", name, check=False)
            elif name in tables:
                _nft("delete", "table", "netdev", name, check=False)
            else:
                _ip("link", "del", name, check=False)


class Hosts:
    def __init__(self, count: int) -> None:
        if not 1 <= count <= 200:
            raise InvalidArgument("1..200 hosts")
        self.count = count
        # Interface names have 15 characters at most: tcn + pid (base 36, at most 5) + x + 2 random + suffix.
        self.tag = f"{_PREFIX}{_base36(os.getpid())}x{random.randrange(256):02x}"
        self.bridge = f"{self.tag}br"
        self.net = self._free_subnet()
        self.names = [f"{self.tag}h{i}" for i in range(count)]
        self._cuts: set[tuple[int, int]] = set()
        self._lossy: set[int] = set()
        self._up = False

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        used = _ip("-o", "-4", "addr", check=False).stdout
        for _ in range(100):
            net = ipaddress.IPv4Network(f"10.{random.randrange(200, 250)}.{random.randrange(256)}.0/24")
            if str(net.network_address)[:-1] not in used:
                return net
        raise Unavailable("no free 10.x.y.0/24 subnet for test hosts")

    def address(self, host: int) -> str:
        """A host's address (``ROOT``: the test process's side of the bridge)."""
        return str(self.net.network_address + (254 if host == ROOT else host + 1))

    def exec_args(self, host: int) -> list[str]:
        """Prefix of a command that runs in ``host``."""
        return ["ip", "netns", "exec", self.names[host]]

    def _veth(self, host: int) -> tuple[str, str]:
        return f"{self.tag}v{host}", f"{self.tag}p{host}"  # (inside the host, on the bridge)

    def start(self) -> Hosts:
        _remove_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address(ROOT)}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                inner, outer = self._veth(i)
                _ip("netns", "add", ns)
                _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("addr", "add", f"{self.address(i)}/24", "dev", inner, ns=ns)
                _ip("link", "set", inner, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
            self._up = True
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- faults
    def _cut(self, op: str, src: int, dst: int) -> None:
        """Pin (or unpin) ``src``'s neighbor entry for ``dst`` to a MAC address that no interface has: the
        bridge floods those frames and nobody takes them."""
        ns = None if src == ROOT else self.names[src]
        dev = self.bridge if src == ROOT else self._veth(src)[0]
        if op == "add":
            _ip("neigh", "replace", self.address(dst), "dev", dev, "lladdr", _NOWHERE, "nud", "permanent", ns=ns)
        else:
            _ip("neigh", "del", self.address(dst), "dev", dev, ns=ns, check=False)

    def partition(self, a: int, b: int) -> None:
        """Cut ``a`` from ``b`` (``ROOT`` for the test process): packets between them vanish, both ways."""
        if a == b:
            raise InvalidArgument("a host cannot be cut from itself")
        for src, dst in ((a, b), (b, a)):
            if (src, dst) not in self._cuts:
                self._cut("add", src, dst)
                self._cuts.add((src, dst))

    def heal(self, a: int | None = None, b: int | None = None) -> None:
        """Undo ``partition(a, b)``, or every partition."""
        for src, dst in sorted(self._cuts):
            if a is None or {src, dst} == {a, b}:
                self._cut("del", src, dst)
                self._cuts.discard((src, dst))

    def netem(self, host: int, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay and drop packets leaving ``host`` (``tc netem``); zeros remove it."""
        inner, _ = self._veth(host)
        cmd = ["ip", "netns", "exec", self.names[host], "tc", "qdisc"]
        if delay_ms <= 0 and loss_pct <= 0:
            subprocess.run([*cmd, "del", "dev", inner, "root"], capture_output=True, timeout=30)
            return
        done = subprocess.run([*cmd, "replace", "dev", inner, "root", "netem", "delay", f"{delay_ms}ms", "loss",
                               f"{loss_pct}%"], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise Unavailable(f"tc netem failed ({done.stderr.strip()}): this kernel may lack sch_netem")

    def rate(self, host: int, mbps: float) -> None:
        """Cap what ``host`` sends at ``mbps`` MB/s (``tc tbf``, in kernels without ``sch_netem`` too: a
        remote link's bandwidth); 0 removes the cap."""
        inner, _ = self._veth(host)
        cmd = ["ip", "netns", "exec", self.names[host], "tc", "qdisc"]
        if mbps <= 0:
            subprocess.run([*cmd, "del", "dev", inner, "root"], capture_output=True, timeout=30)
            return
        burst = max(64 * 1024, int(mbps * 1e6 / 100))  # >= a timer tick's worth at this rate
        done = subprocess.run([*cmd, "replace", "dev", inner, "root", "tbf", "rate", f"{int(mbps * 8e6)}bit",
                               "burst", str(burst), "latency", "100ms"], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise Unavailable(f"tc tbf failed ({done.stderr.strip()})")

    def netem_available(self) -> bool:
        """Whether this kernel has ``tc netem`` (a module some container hosts do not load)."""
        try:
            self.netem(0, delay_ms=1)
        except Unavailable:
            return False
        self.netem(0)
        return True

    def loss_available(self) -> bool:
        """Whether this kernel takes the packet filter ``loss`` uses (nf_tables with netdev ingress hooks);
        ``nft`` itself missing is an error, not an answer (it is a package to install)."""
        try:
            self.loss(0, 1)
        except Unavailable as exc:
            if shutil.which("nft") is None:
                raise
            self.loss(0, 0)
            log.info("no packet loss by filter on this kernel: %s", exc)
            return False
        self.loss(0, 0)
        return True

    def _loss_filters(self, host: int) -> list[tuple[str | None, str, str]]:
        """(namespace, table, device) of the two halves of ``host``'s loss filter: packets arriving at the
        host (ingress of its end of the veth pair) and packets it sent (ingress of the bridge's end, in the
        caller's namespace). Both drop on receipt, as a lossy link does: the sender's stack believes the
        packet sent, whereas a drop in its own output path is reported to the sending socket as an error
        (EPERM), which no real link does."""
        inner, outer = self._veth(host)
        table = f"{self.tag}l{host}"
        return [(self.names[host], table, inner), (None, table, outer)]

    def loss(self, host: int, percent: float) -> None:
        """Drop ``percent`` % of the IPv4 packets into and out of ``host``, at random (nftables ``numgen``),
        with counters (``lost``); 0 removes it. Works without ``sch_netem``; ARP is spared, so that a lossy
        link does not turn into a partition when a neighbor entry expires."""
        if not 0 <= percent <= 100:
            raise InvalidArgument("loss percent must be in 0..100")
        if percent == 0 and host not in self._lossy:
            return
        for ns, table, _ in self._loss_filters(host):
            _nft("delete", "table", "netdev", table, ns=ns, check=False)
        self._lossy.discard(host)
        if percent == 0:
            return
        self._lossy.add(host)
        for ns, table, dev in self._loss_filters(host):
            _nft("-f", "-", ns=ns, stdin=(
                f"table netdev {table} {{\n chain lossy {{\n"
                f"  type filter hook ingress device \"{dev}\" priority 0;\n"
                f"  meta protocol ip numgen random mod 10000 < {round(percent * 100)} counter drop\n }}\n}}\n"))

    def lost(self, host: int) -> int:
        """Packets ``host``'s loss filter has dropped so far, both directions (0 without one)."""
        if host not in self._lossy:
            return 0
        dropped = 0
        for ns, table, _ in self._loss_filters(host):
            listing = json.loads(_nft("-j", "list", "table", "netdev", table, ns=ns).stdout)
            dropped += sum(e["counter"]["packets"] for item in listing["nftables"]
                           for e in item.get("rule", {}).get("expr", []) if "counter" in e)
        return dropped

    def close(self) -> None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.heal()
        for host in sorted(self._lossy):  # the halves in the caller's namespace outlive the hosts
            with contextlib.suppress(OSError, subprocess.TimeoutExpired, Unavailable):
                self.loss(host, 0)
        for ns in self.names:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _ip("netns", "del", ns, check=False)  # its veth ends go with it
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _ip("link", "del", self.bridge, check=False)
        self._cuts.clear()
        self._up = False


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out
