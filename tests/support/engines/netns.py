"""Two 'hosts' on one machine: two network namespaces joined by a veth pair.

Each engine of the cross-node tests runs in its own namespace (``ip netns exec``), so the
only network path between them is the veth link, with an address from 192.0.2.0/24
(TEST-NET-1, never routed) at each end that exists only inside its namespace. Faults are
made on that link: ``cut`` (the link down), ``restore``, and ``shape`` (random packet loss
and a bandwidth limit, the latter to make a load long enough to cut in the middle).

Making namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); where that fails,
:class:`NetnsUnavailable` says why, and the tests fail with it under
``KVSTATE_REQUIRE_NETNS=1`` (``make test-crossnode``) or skip loudly without.
:meth:`TwoHosts.down` removes both namespaces (their veth ends go with them) and runs on
every exit path of the fixture that made them; :func:`leftover` lists any of this run's
namespaces still present.
"""

from __future__ import annotations

import os
import subprocess
import uuid

NET = "192.0.2"
PREFIX = "kvsx-"


class NetnsUnavailable(RuntimeError):
    """The namespaces could not be made here; the message says which command failed and why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsUnavailable(f"{' '.join(args)}: {exc}") from None
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[:300]}")
    return done


def namespaces() -> list[str]:
    out = _ip("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftover(tag: str) -> list[str]:
    """This run's namespaces that still exist."""
    return [n for n in namespaces() if n.startswith(PREFIX + tag)]


class TwoHosts:
    """Hosts ``a`` (192.0.2.1) and ``b`` (192.0.2.2); use as a context manager."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.ns = {"a": f"{PREFIX}{self.tag}-a", "b": f"{PREFIX}{self.tag}-b"}
        self.dev = {"a": f"kvx{self.tag}a", "b": f"kvx{self.tag}b"}  # at most 15 characters
        self.addr = {"a": f"{NET}.1", "b": f"{NET}.2"}

    def __enter__(self) -> TwoHosts:
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"network namespaces need root; this is uid {os.geteuid()}")
        try:
            for h in ("a", "b"):
                _ip("ip", "netns", "add", self.ns[h])
            _ip("ip", "link", "add", self.dev["a"], "netns", self.ns["a"], "type", "veth",
                "peer", "name", self.dev["b"], "netns", self.ns["b"])
            for h in ("a", "b"):
                _ip("ip", "-n", self.ns[h], "link", "set", "lo", "up")
                _ip("ip", "-n", self.ns[h], "addr", "add", f"{self.addr[h]}/24", "dev", self.dev[h])
                _ip("ip", "-n", self.ns[h], "link", "set", self.dev[h], "up")
            for h in ("a", "b"):  # each address exists in its namespace only
                if self.addr[h] not in _ip("ip", "-n", self.ns[h], "-br", "addr", "show", self.dev[h]).stdout:
                    raise NetnsUnavailable(f"{self.addr[h]} is not on {self.dev[h]} in {self.ns[h]}")
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def down(self) -> None:
        """Remove both namespaces (the veth pair and any qdisc go with them)."""
        for name in self.ns.values():
            _ip("ip", "netns", "del", name, check=False)
        _ip("ip", "link", "del", self.dev["a"], check=False)  # only if a failed move left it here

    # -- what engines and tests use ------------------------------------------------------

    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a process on ``host``."""
        return ["ip", "netns", "exec", self.ns[host]]

    def env(self, host: str) -> dict[str, str]:
        """UCX over TCP on the veth only: no shared memory or loopback path between the
        namespaces' processes (they share one kernel)."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev[host]}

    def cut(self) -> None:
        """Take the link down at both ends: packets are dropped, no FIN or RST is sent."""
        for h in ("a", "b"):
            _ip("ip", "-n", self.ns[h], "link", "set", self.dev[h], "down")

    def restore(self) -> None:
        for h in ("a", "b"):
            _ip("ip", "-n", self.ns[h], "link", "set", self.dev[h], "up")
        self.unshape()

    def shape(self, *, loss: float = 0.0, rate: str = "10gbit") -> None:
        """Packet loss (a fraction) and a bandwidth on both ends, replacing any before.

        Built from what this kernel has (no netem, no tc actions): an htb root whose
        default class has ``rate``, and a classic-BPF filter that sends a random ``loss``
        of the packets to a class whose queue holds none (pfifo limit 0), so they drop."""
        self.unshape()
        threshold = int(loss * (1 << 32))
        # A = random u32 (SKF_AD_OFF + SKF_AD_RANDOM); A > threshold: no match (default
        # class 1:1); else class 1:2, whose queue drops every packet
        bpf = f"4,32 0 0 {(1 << 32) - 0x1000 + 56},37 0 1 {threshold},6 0 0 0,6 0 0 {0x10002}"
        for h in ("a", "b"):
            tc = ["tc", "-n", self.ns[h]]
            dev = ["dev", self.dev[h]]
            _ip(*tc, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000")
            _ip(*tc, "class", "add", *dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate)
            if loss > 0:
                _ip(*tc, "class", "add", *dev, "parent", "1:", "classid", "1:2", "htb", "rate", "10gbit")
                _ip(*tc, "qdisc", "add", *dev, "parent", "1:2", "handle", "2:", "pfifo", "limit", "0")
                _ip(*tc, "filter", "add", *dev, "parent", "1:", "bpf", "bytecode", bpf)

    def unshape(self) -> None:
        for h in ("a", "b"):
            _ip("tc", "-n", self.ns[h], "qdisc", "del", "dev", self.dev[h], "root", check=False)
