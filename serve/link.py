"""The link between `kvplay serve`'s HTTP process and its engine-core process.

One stream socket from ``socket.socketpair()``: the server creates the pair and hands one end
to the core process it starts (an inherited descriptor, never a path or a port), so nothing
else on the machine can connect to either end. Messages are tuples, pickled, each framed by
its 4-byte length; a frame is bounded (`MAX_FRAME`) before it is read. Pickle is safe here only
because both ends are this program: the link is never bound to an address.

Sends take a lock (the engine thread, the core's reader and its heartbeat all send); a send
on a closed link raises `LinkClosed`, as does a receive at the end of the stream.
"""
from __future__ import annotations

import pickle
import socket
import struct
import threading

MAX_FRAME = 256 << 20  # the handshake carries the tokenizer (a few MB); a turn is far smaller
_LEN = struct.Struct(">I")


class LinkClosed(Exception):
    pass


class Link:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_FRAME:
            raise ValueError(f"a link message of {len(data)} bytes is over {MAX_FRAME}")
        try:
            with self._send_lock:
                self.sock.sendall(_LEN.pack(len(data)) + data)
        except OSError as exc:
            self.closed = True
            raise LinkClosed(str(exc)) from None

    def recv(self):
        head = self._exactly(_LEN.size)
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            self.close()
            raise LinkClosed(f"a link frame of {n} bytes is over {MAX_FRAME}")
        return pickle.loads(self._exactly(n))

    def _exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except OSError as exc:
                self.closed = True
                raise LinkClosed(str(exc)) from None
            if k == 0:
                self.closed = True
                raise LinkClosed("the other end closed the link")
            got += k
        return bytes(buf)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
