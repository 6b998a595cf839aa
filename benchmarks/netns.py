"""Two network namespaces joined by a veth pair whose ends are shaped with ``tc``: the emulated link of the
slow-link benchmarks (:mod:`benchmarks.slow_links`, :mod:`benchmarks.two_level_links`,
:mod:`benchmarks.time_to_accuracy`). Needs root and iproute2 (:func:`missing_requirements` says why not).

A delay (:meth:`SlowLink.set_rate`'s ``delay_ms``) is a ``netem`` qdisc on both ends where the kernel has one;
where it has not (``sch_netem`` not built), the two namespaces are joined through a third instead, in which
:mod:`benchmarks.link_delay` holds every frame for the delay, each way. :meth:`SlowLink.measure_rtt_ms` measures
the round trip either way gives.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

NAMESPACE_PREFIX = "dgcbench"
INTERFACES = ("veth-dgc0", "veth-dgc1")
#: The peers of :data:`INTERFACES` in the middle namespace, when a delay line joins them (no ``netem``).
MIDDLE_INTERFACES = ("veth-dgcm0", "veth-dgcm1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX_LEN = 24
LINK_TEST_PORT = 29518
RTT_TEST_PORT = 29519


# -- the emulated link -------------------------------------------------------------------------------
def missing_requirements() -> str | None:
    """Why this benchmark cannot run here (``None`` when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces and tc qdiscs needs root (run with sudo)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (apt-get install -y iproute2)"
    return None


def _sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


class SlowLink:
    """Two namespaces joined by a veth pair whose ends are shaped with ``tbf``; use as a context manager.

    Only the addresses :data:`ADDRESSES` are configured, inside the namespaces: nothing on the host's
    own interfaces or routes changes. ``close()`` deletes both namespaces (which deletes the veth
    pair); it is safe to call twice and runs on ``__exit__`` whatever happened.
    """

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.namespaces = (f"{NAMESPACE_PREFIX}{tag}a", f"{NAMESPACE_PREFIX}{tag}b")
        self.middle = f"{NAMESPACE_PREFIX}{tag}m"
        self.created: list[str] = []
        self.rate_mbit: float | None = None
        self.delay_ms: float | None = None
        #: How the delay is made: ``"netem"``, ``"relay"`` (:mod:`benchmarks.link_delay`) or ``None`` (no delay).
        self.delay_by: str | None = None
        self._relay: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SlowLink:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        for ns in self.namespaces:
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
        a, b = self.namespaces
        _sh("ip", "link", "add", INTERFACES[0], "netns", a, "type", "veth", "peer", "name", INTERFACES[1], "netns", b)
        self._address_ends()

    def _address_ends(self) -> None:
        for ns, dev, addr in zip(self.namespaces, INTERFACES, ADDRESSES, strict=True):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _join(self, through_middle: bool) -> None:
        """Join the two ends directly (one veth pair) or through the middle namespace (two pairs and the relay)."""
        if through_middle == (self.middle in self.created):
            return
        self._stop_relay()
        _sh("ip", "-n", self.namespaces[0], "link", "del", INTERFACES[0], check=False)  # deletes its peer too
        if through_middle:
            _sh("ip", "netns", "add", self.middle)
            self.created.insert(0, self.middle)
            for ns, dev, peer in zip(self.namespaces, INTERFACES, MIDDLE_INTERFACES, strict=True):
                _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.middle)
                _sh("ip", "-n", self.middle, "link", "set", peer, "up")
            _sh("ip", "netns", "exec", self.middle, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", check=False)
        else:
            _sh("ip", "netns", "del", self.middle, check=False)
            self.created.remove(self.middle)
            a, b = self.namespaces
            _sh("ip", "link", "add", INTERFACES[0], "netns", a, "type", "veth", "peer", "name", INTERFACES[1], "netns", b)
        self._address_ends()

    def _start_relay(self, delay_ms: float) -> None:
        import tempfile
        import time

        self._stop_relay()
        ready = os.path.join(tempfile.mkdtemp(prefix="dgc_link_delay_"), "ready")
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", self.middle, sys.executable, "-m", "benchmarks.link_delay", "--interfaces",
             ",".join(MIDDLE_INTERFACES), "--delay-ms", f"{delay_ms:g}", "--ready", ready],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if self._relay.poll() is not None or time.monotonic() > deadline:
                err = self._relay.stderr.read().decode() if self._relay.stderr else ""
                self._stop_relay()
                raise RuntimeError(f"the delay line did not start: {err.strip()}")
            time.sleep(0.05)

    def _stop_relay(self) -> None:
        if self._relay is not None:
            if self._relay.poll() is None:
                self._relay.terminate()
                try:
                    self._relay.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._relay.kill()
                    self._relay.wait(timeout=5)
            self._relay = None

    def set_rate(self, mbit: float | None, delay_ms: float | None = None) -> None:
        """Shape both directions to ``mbit`` Mbit/s (``None``: no rate limit) and delay every packet by ``delay_ms``
        each way (``None`` or 0: none; a ``netem`` qdisc with the ``tbf`` under it, or, where the kernel has no
        ``netem``, the delay line of :mod:`benchmarks.link_delay` between the two ends)."""
        delay_by = None
        if delay_ms:
            delay_by = "netem" if self._netem_works() else "relay"
        self._join(through_middle=delay_by == "relay")
        if delay_by == "relay":
            self._start_relay(float(delay_ms or 0))
        for ns, dev in zip(self.namespaces, INTERFACES, strict=True):
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            parent = ["root"]
            if delay_by == "netem":
                _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                    "delay", f"{delay_ms:g}ms", "limit", "100000")  # fmt: skip
                parent = ["parent", "1:1", "handle", "10:"]
            if mbit is None:
                continue
            # The bucket holds 2 ms at the rate (at least 64 KiB: a GSO super-packet), so the rate holds
            # on average without bursts that a real link would not allow.
            burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf",
                "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms")  # fmt: skip
        self.rate_mbit = mbit
        self.delay_ms = delay_ms or None
        self.delay_by = delay_by

    def _netem_works(self) -> bool:
        """Whether ``tc`` can add a ``netem`` qdisc here (tried on the loopback of one end, then removed)."""
        ns = self.namespaces[0]
        proc = _sh("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms", check=False)
        _sh("tc", "-n", ns, "qdisc", "del", "dev", "lo", "root", check=False)
        return proc.returncode == 0

    def exec_prefix(self, side: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[side]]

    def close(self) -> None:
        self._stop_relay()
        while self.created:
            ns = self.created.pop()
            _sh("ip", "netns", "del", ns, check=False)

    def measure_mbit(self, seconds: float = 1.0, timeout_s: float = 30) -> float:
        """Achieved TCP goodput from side 0 to side 1, in Mbit/s (one transfer of about ``seconds``)."""
        nbytes = int((self.rate_mbit or 2_000) * 1e6 / 8 * seconds)  # unshaped: a 2 Gbit/s second
        server = (
            "import socket,time,sys\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{ADDRESSES[1]}',{LINK_TEST_PORT}));s.listen(1);s.settimeout({timeout_s})\n"
            "c,_=s.accept();c.settimeout(" + str(timeout_s) + ");n=0;t0=None\n"
            f"while n<{nbytes}:\n"
            "  b=c.recv(1<<20)\n"
            "  if not b: break\n"
            "  t0=t0 or time.perf_counter();n+=len(b)\n"
            "print(n*8/(time.perf_counter()-t0)/1e6)\n"
        )
        client = (
            "import socket,time\n"
            f"deadline=time.monotonic()+{timeout_s}\n"
            "while True:\n"
            "  try:\n"
            f"    c=socket.create_connection(('{ADDRESSES[1]}',{LINK_TEST_PORT}),timeout=2);break\n"
            "  except OSError:\n"
            "    if time.monotonic()>deadline: raise\n"
            "    time.sleep(0.1)\n"
            f"c.settimeout({timeout_s});c.sendall(b'x'*{nbytes});c.close()\n"
        )
        return float(self._client_server(server, client, timeout_s, side_of_output=1))

    def measure_rtt_ms(self, rounds: int = 21, timeout_s: float = 30) -> float:
        """Median round trip of one byte from side 0 to side 1 and back over TCP (``TCP_NODELAY``), in ms."""
        server = (
            "import socket\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{ADDRESSES[1]}',{RTT_TEST_PORT}));s.listen(1);s.settimeout({timeout_s})\n"
            "c,_=s.accept();c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
            f"for _ in range({rounds}): c.sendall(c.recv(1))\n"
        )
        client = (
            "import socket,statistics,time\n"
            f"deadline=time.monotonic()+{timeout_s}\n"
            "while True:\n"
            "  try:\n"
            f"    c=socket.create_connection(('{ADDRESSES[1]}',{RTT_TEST_PORT}),timeout=2);break\n"
            "  except OSError:\n"
            "    if time.monotonic()>deadline: raise\n"
            "    time.sleep(0.1)\n"
            "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1);t=[]\n"
            f"for _ in range({rounds}):\n"
            "  t0=time.perf_counter();c.sendall(b'x');c.recv(1);t.append(time.perf_counter()-t0)\n"
            "print(1e3*statistics.median(t[1:]))\n"
        )
        return float(self._client_server(server, client, timeout_s, side_of_output=0))

    def _client_server(self, server: str, client: str, timeout_s: float, side_of_output: int) -> str:
        """Run ``server`` on side 1 and ``client`` on side 0 (Python sources); the stdout of the side asked for."""
        srv = subprocess.Popen([*self.exec_prefix(1), sys.executable, "-c", server], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            cli = subprocess.run([*self.exec_prefix(0), sys.executable, "-c", client], check=True, timeout=timeout_s,
                                 capture_output=True, text=True)  # fmt: skip
            out, err = srv.communicate(timeout=timeout_s)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait(timeout=5)
        if srv.returncode != 0:
            raise RuntimeError(f"link test failed: {err.strip()}")
        return out.strip() if side_of_output == 1 else cli.stdout.strip()
