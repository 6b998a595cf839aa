"""Two network namespaces joined by a veth pair whose ends are shaped with ``tc``: the emulated link of the
slow-link benchmarks (:mod:`benchmarks.slow_links`, :mod:`benchmarks.two_level_links`,
:mod:`benchmarks.time_to_accuracy`). Needs root and iproute2 (:func:`missing_requirements` says why not)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

NAMESPACE_PREFIX = "dgcbench"
INTERFACES = ("veth-dgc0", "veth-dgc1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX_LEN = 24
LINK_TEST_PORT = 29518


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
        self.created: list[str] = []
        self.rate_mbit: float | None = None
        self.delay_ms: float | None = None

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
        _sh(
            "ip",
            "link",
            "add",
            INTERFACES[0],
            "netns",
            a,
            "type",
            "veth",
            "peer",
            "name",
            INTERFACES[1],
            "netns",
            b,
        )
        for ns, dev, addr in zip(self.namespaces, INTERFACES, ADDRESSES, strict=True):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def set_rate(self, mbit: float | None, delay_ms: float | None = None) -> None:
        """Shape both directions to ``mbit`` Mbit/s (``None``: no rate limit) and delay every packet by ``delay_ms``
        each way (``None``: none; a ``netem`` qdisc with the ``tbf`` under it)."""
        for ns, dev in zip(self.namespaces, INTERFACES, strict=True):
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            parent = ["root"]
            if delay_ms:
                proc = _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                           "delay", f"{delay_ms:g}ms", "limit", "100000", check=False)  # fmt: skip
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"cannot delay the link ({proc.stderr.strip()}): a delay needs tc's netem qdisc, the"
                        " sch_netem kernel module (`modprobe sch_netem`; on some distributions the package"
                        " linux-modules-extra-$(uname -r)). Run without --delay."
                    )
                parent = ["parent", "1:1", "handle", "10:"]
            if mbit is None:
                continue
            # The bucket holds 2 ms at the rate (at least 64 KiB: a GSO super-packet), so the rate holds
            # on average without bursts that a real link would not allow.
            burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf",
                "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms")  # fmt: skip
        self.rate_mbit = mbit
        self.delay_ms = delay_ms

    def exec_prefix(self, side: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[side]]

    def close(self) -> None:
        while self.created:
            ns = self.created.pop()
            _sh("ip", "netns", "del", ns, check=False)

    def measure_mbit(self, seconds: float = 1.0, timeout_s: float = 30) -> float:
        """Achieved TCP goodput from side 0 to side 1, in Mbit/s (one transfer of about ``seconds``)."""
        nbytes = int((self.rate_mbit or 10_000) * 1e6 / 8 * seconds)
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
            f"c.sendall(b'x'*{nbytes});c.close()\n"
        )
        srv = subprocess.Popen(
            [*self.exec_prefix(1), sys.executable, "-c", server],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            subprocess.run([*self.exec_prefix(0), sys.executable, "-c", client], check=True, timeout=timeout_s,
                           capture_output=True)  # fmt: skip
            out, err = srv.communicate(timeout=timeout_s)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait(timeout=5)
        if srv.returncode != 0:
            raise RuntimeError(f"link test failed: {err.strip()}")
        return float(out.strip())
