"""A recording TCP proxy for tests: what a wiretap between two peers on 127.0.0.1 would see."""

from __future__ import annotations

import contextlib
import socket
import threading


class Proxy:
    """A TCP forwarder on 127.0.0.1 that records every byte each way: what a wiretap would see."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.upstream = bytearray()  # client -> server
        self.downstream = bytearray()
        self.closed_upstream: list[int] = []  # bytes forwarded client -> server, per finished connection
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, self.upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.downstream, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray, up: bool) -> None:
        forwarded = 0
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    record += data
                dst.sendall(data)
                forwarded += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            if up:
                self.closed_upstream.append(forwarded)

    def captured(self) -> bytes:
        with self._lock:
            return bytes(self.upstream + self.downstream)

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            s.close()
