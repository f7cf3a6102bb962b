"""Framed messages between the router and one instance process over a Unix socket pair (docs/design.md §13.2).

One frame: a 12-byte prefix (header length u32, payload length u64, big-endian), the header (a pickled tuple
of our own processes' making: a command or an event), then the payload bytes untouched (a transfer's
checksummed encoding, wire.py). A socket pair never leaves the machine. A peer that dies part way through a
frame is seen as EOFError by the reader, which is how the router learns that a transfer was cut.
"""
from __future__ import annotations

import pickle
import select
import socket
import struct
import threading

PREFIX = struct.Struct("!IQ")
MAX_HEADER_BYTES = 1 << 24


class Channel:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()  # the router sends from request threads and from readers

    def send(self, header: tuple, payload: bytes = b"") -> None:
        data = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(PREFIX.pack(len(data), len(payload)) + data)
            if payload:
                self.sock.sendall(payload)

    def send_cut(self, header: tuple, payload: bytes) -> None:
        """Send the frame's first half only (the fault of a prefill instance killed mid-transfer; its caller
        exits next)."""
        data = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.sock.sendall(PREFIX.pack(len(data), len(payload)) + data + payload[:len(payload) // 2])

    def recv(self) -> tuple[tuple, bytes]:
        """The next frame (blocks); EOFError when the peer closed or died, also part way through a frame."""
        header_len, payload_len = PREFIX.unpack(self._read(PREFIX.size))
        if header_len > MAX_HEADER_BYTES:
            raise EOFError(f"frame header of {header_len} bytes: the stream is out of step")
        header = pickle.loads(self._read(header_len))
        return header, self._read(payload_len)

    def poll(self, timeout: float) -> bool:
        """Whether a frame has begun to arrive within timeout seconds."""
        return bool(select.select([self.sock], [], [], timeout)[0])

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _read(self, count: int) -> bytes:
        buffer = bytearray(count)
        view, got = memoryview(buffer), 0
        while got < count:
            n = self.sock.recv_into(view[got:], count - got)
            if n == 0:
                raise EOFError(f"the peer closed the channel ({got} of {count} bytes of a frame read)")
            got += n
        return bytes(buffer)
