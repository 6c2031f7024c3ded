"""A TCP ring of a torch plane's members for its small fixed-size exchanges,
on the calling thread (gloo takes 0.3 ms for 8 bytes; docs/design.md,
"Control planes"): each rank connects to its successor, an all-gather of k
bytes is n - 1 steps of send-k / receive-k; all members use it or none.
``DYNAMIQ_SOCKET_RING=0`` turns it and shm_slots.py off.
"""
from __future__ import annotations

import contextlib
import socket
import struct
import time

from ..settings import env_switch

# All-gathers up to this many bytes in all go over the ring (larger: gloo).
MAX_BYTES = 64 << 10


def enabled() -> bool:
    return env_switch("DYNAMIQ_SOCKET_RING")


def _address(same_host: bool) -> str:
    """The address peers reach this rank at: loopback when every member is
    on this host, else the host name's address (as gloo's default device)."""
    if same_host:
        return "127.0.0.1"
    address = socket.gethostbyname(socket.gethostname())
    if address.startswith("127."):      # /etc/hosts' loopback alias: unreachable from peers
        raise OSError(f"the host name resolves to {address}, which peers cannot reach")
    return address


# A receive polls this long (s) before it sleeps: a wake-up costs more (tens of us).
SPIN_S = 200e-6


def _received(k: int) -> int:
    if k == 0:
        raise ConnectionError("dynamiq_mpi: a peer of the control ring closed its socket")
    return k


def _recv_exact(sock, n: int, spin_s: float = 0.0) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    if spin_s > 0:
        deadline = time.perf_counter() + spin_s
        while got < n and time.perf_counter() < deadline:
            try:
                got += _received(sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT))
            except BlockingIOError:
                continue
    while got < n:
        got += _received(sock.recv_into(view[got:]))
    return bytes(buf)


class SocketRing:
    """The ring of one plane (collective; ``ok``: connected, agreed on before any use)."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, same_host: bool):
        self.rank, self.size = rank, size
        self.inbound = self.outbound = None
        self.ok = False
        self.why = ""
        server = None
        try:
            server = socket.create_server((_address(same_host), 0))
            server.settimeout(timeout_s)
            host, port = server.getsockname()[:2]
            store.set(f"ring/{rank}", f"{host}:{port}")
            nxt = (rank + 1) % size
            peer_host, peer_port = store.get(f"ring/{nxt}").decode().rsplit(":", 1)
            self.outbound = socket.create_connection((peer_host, int(peer_port)), timeout_s)
            self.outbound.sendall(struct.pack("<i", rank))
            self.inbound, _ = server.accept()
            if struct.unpack("<i", _recv_exact(self.inbound, 4))[0] != (rank - 1) % size:
                raise ConnectionError("an unexpected peer connected")
            for s in (self.inbound, self.outbound):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(timeout_s)
            self.ok = True
        except Exception as exc:     # no ring on this rank: gloo for the whole plane
            self.why = f"{type(exc).__name__}: {exc}"
            self.close()
        finally:
            if server is not None:
                server.close()

    def allgather(self, mine: bytes) -> list:
        """Every rank's ``mine`` (equal lengths), by rank."""
        k = len(mine)
        out = [b""] * self.size
        out[self.rank] = mine
        current, source = mine, self.rank
        for _ in range(self.size - 1):
            self.outbound.sendall(current)
            current = _recv_exact(self.inbound, k, SPIN_S)
            source = (source - 1) % self.size
            out[source] = current
        return out

    def close(self):
        for s in (self.inbound, self.outbound):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self.inbound = self.outbound = None
        self.ok = False
