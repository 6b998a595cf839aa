"""A delay line for the emulated link where the kernel has no ``netem`` qdisc: every frame held for a fixed time.

    ip netns exec <middle> python -m benchmarks.link_delay --interfaces veth-dgcm0,veth-dgcm1 --delay-ms 40

:class:`benchmarks.netns.SlowLink` starts it when a delay is asked for and ``tc qdisc add ... netem`` fails (a kernel
built without ``sch_netem``): the two namespaces are then joined through a third one, and this process, in the
third, forwards every Ethernet frame that arrives on one of its two interfaces out of the other ``--delay-ms``
later (each way: a round trip gains twice that), in order, as a bridge with a delay would. The rate stays with
``tc tbf`` on the two ends. Frames are read and written with their offload header (``PACKET_VNET_HDR``), so a TCP
super-packet of up to 64 KiB crosses as one frame: a few hundred frames a second at 100 Mbit/s. It runs at
real-time priority (``SCHED_FIFO``) when allowed, so that a loaded CPU does not lengthen the delay.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
#: The largest frame read: a 64 KiB GSO super-packet, its Ethernet and offload headers.
MAX_FRAME = 65536 + 64
BUFFER_BYTES = 32 << 20


def _open(interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    for option in (getattr(socket, "SO_RCVBUFFORCE", 33), getattr(socket, "SO_SNDBUFFORCE", 32)):
        sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)
    sock.bind((interface, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def relay(interfaces: tuple[str, str], delay_s: float, ready: str | None = None) -> None:
    """Forward frames between ``interfaces`` with ``delay_s`` added each way, until killed."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except (AttributeError, PermissionError, OSError):
        pass
    socks = [_open(name) for name in interfaces]
    queues: list[collections.deque[tuple[float, bytes]]] = [collections.deque(), collections.deque()]
    if ready:
        with open(ready, "w") as handle:
            handle.write(str(os.getpid()))
    while True:
        now = time.monotonic()
        for out, queue in enumerate(queues):
            while queue and queue[0][0] <= now:
                frame = queue.popleft()[1]
                try:
                    socks[out].send(frame)
                except OSError:  # a frame the far end refuses (its interface down): drop it, as a wire would
                    pass
        due = [queue[0][0] for queue in queues if queue]
        timeout = max(0.0, min(due) - time.monotonic()) if due else 1.0
        readable, _, _ = select.select(socks, [], [], timeout)
        for sock in readable:
            side = socks.index(sock)
            while True:
                try:
                    frame, address = sock.recvfrom(MAX_FRAME)
                except BlockingIOError:
                    break
                if address[2] == PACKET_OUTGOING:  # what this process sent out of this interface
                    continue
                queues[1 - side].append((time.monotonic() + delay_s, frame))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.link_delay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--interfaces", required=True, help="the two interfaces to join, comma-separated")
    parser.add_argument("--delay-ms", type=float, required=True, help="added each way, in milliseconds")
    parser.add_argument("--ready", default=None, help="a file written once the sockets are open")
    args = parser.parse_args(argv)
    first, second = args.interfaces.split(",")
    relay((first, second), args.delay_ms / 1e3, args.ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
