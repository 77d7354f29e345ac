"""The router's republication of its workers' prefix-cache events (--kv-events-endpoint): every batch a
worker sends, on one ZeroMQ PUB address, with the id of the worker whose pool it describes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import zmq
import zmq.asyncio

from tandem.engine.messages import KVEvents


@dataclass
class KVEventsPublisher:
    sock: zmq.asyncio.Socket

    @classmethod
    def bind(cls, ctx: zmq.asyncio.Context, endpoint: str | None) -> KVEventsPublisher | None:
        """A publisher bound to endpoint; None when there is none to publish on."""
        if not endpoint:
            return None
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        return cls(sock)

    async def publish(self, worker_id: str, msg: KVEvents) -> None:
        # PUB drops what nobody listens for: publishing never holds the router up.
        await self.sock.send_pyobj(replace(msg, worker_id=worker_id))

    def close(self) -> None:
        self.sock.close(linger=0)
