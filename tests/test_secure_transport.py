"""Cluster traffic over TCP is private (CURVE), authenticated (CURVE keys and the HMAC, both from
the deployment's secret), replay-proof and bounded: over real sockets on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import pickle
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import zmq
from wiretap import Proxy

from tandem.disagg.router import disagg_engine as router_module
from tandem.disagg.router.disagg_engine import DisaggEngine
from tandem.disagg.router.settings import RouterSettings
from tandem.disagg.worker import secure, wire
from tandem.disagg.worker.transport import TransferHandle, TransferResult
from tandem.disagg.worker.transports.zmq_tcp import REFUSED, ZmqReceiver, ZmqSender, max_kv_frame
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import AddRequests
from tandem.kv.pool import KVPool
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

SECRET = b"the deployment's secret"
SHAPE = (2, 2, 8, 4, 2, 8)  # layers, K/V, blocks, block size, kv heads, head dim (uint8: bytes are elements)
PATTERN = b"KV-PLAINTEXT-PATTERN!"
TOKEN_IDS = [1234567, 7654321, 2345678, 8765432, 3456789]
RID = "req-with-a-recognisable-id"


def wait_for(condition, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def pickled_token_ids() -> bytes:
    """How a pickled list of these ids looks on the wire (pickle writes each as BININT)."""
    return b"".join(b"J" + t.to_bytes(4, "little") for t in TOKEN_IDS)


def pattern_slice(num_blocks: int) -> torch.Tensor:
    shape = (2, num_blocks, *SHAPE[3:])
    n = torch.Size(shape).numel()
    raw = (PATTERN * (n // len(PATTERN) + 1))[:n]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(shape)


def transfer(sender: ZmqSender, handle: TransferHandle, kv: torch.Tensor, timeout: float = 10.0) -> TransferResult:
    for layer in range(SHAPE[0]):
        sender.write(handle, layer, handle.block_ids, kv)
    sender.finish(handle)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for result in sender.poll():
            return result
        time.sleep(0.01)
    return TransferResult(handle.request_id, False, "timed out")


@pytest.fixture
def receiver() -> Iterator[ZmqReceiver]:
    r = ZmqReceiver("127.0.0.1", 0, SECRET)
    r.attach(KVPool.whole(torch.zeros(SHAPE, dtype=torch.uint8)))
    yield r
    r.shutdown()


@pytest.fixture
def proxy(receiver: ZmqReceiver) -> Iterator[Proxy]:
    p = Proxy(receiver.port)
    yield p
    p.close()


def through(proxy: Proxy, receiver: ZmqReceiver, rid: str, blocks: list[int]) -> TransferHandle:
    receiver.open(rid, blocks)
    return TransferHandle(rid, blocks, 0, replace(receiver.endpoint, address=proxy.address))


@pytest.fixture
def kv_client(receiver: ZmqReceiver) -> Iterator[zmq.Socket]:
    """A DEALER holding the right keys, straight to the receiver: for frames a ZmqSender would never send."""
    address = f"tcp://127.0.0.1:{receiver.port}"
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    secure.client(s, SECRET, address, 1 << 16)
    s.connect(address)
    yield s
    s.close(linger=0)


def recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes] | None:
    return sock.recv_multipart() if sock.poll(timeout_ms) else None


# -- privacy ----------------------------------------------------------------------------------------
def test_a_wiretap_on_a_kv_transfer_sees_neither_the_kv_nor_the_ids(receiver: ZmqReceiver, proxy: Proxy) -> None:
    blocks = [5, 1, 6]
    handle = through(proxy, receiver, RID, blocks)
    sender = ZmqSender(SECRET)
    try:
        result = transfer(sender, handle, pattern_slice(len(blocks)))
    finally:
        sender.close()
    assert result.ok, result.error
    assert receiver.pool is not None
    got = receiver.pool.local[1][:, blocks].contiguous()
    assert bytes(got.view(-1).numpy()) == bytes(pattern_slice(3).view(-1).numpy())
    captured = proxy.captured()
    assert len(captured) > 2 * SHAPE[0] * pattern_slice(3).numel()  # the KV did go through the tap
    assert PATTERN[:12] not in captured and RID.encode() not in captured


def control_pair(secret: bytes | None) -> tuple[zmq.Context, zmq.Socket, int]:
    """A ROUTER as the router binds it (secret None: plain TCP, to show what a wiretap would see)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        secure.server(router, secret, "tcp://127.0.0.1", wire.MAX_CONTROL_FRAME)
    return ctx, router, router.bind_to_random_port("tcp://127.0.0.1")


def worker_socket(ctx: zmq.Context, address: str, secret: bytes | None, identity: bytes = b"w0") -> zmq.Socket:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, identity)
    if secret is not None:
        secure.client(dealer, secret, address, wire.MAX_CONTROL_FRAME)
    dealer.connect(address)
    return dealer


def close_pair(ctx: zmq.Context, router: zmq.Socket, *others: zmq.Socket) -> None:
    for s in others:
        s.close(linger=0)
    secure.release(router)
    router.close(linger=0)
    ctx.term()  # hangs if a ZAP thread were left behind


@pytest.mark.parametrize("encrypted", [True, False])
def test_a_wiretap_between_router_and_worker_sees_no_request(encrypted: bool) -> None:
    secret = SECRET if encrypted else None
    ctx, router, port = control_pair(secret)
    proxy = Proxy(port)
    dealer = worker_socket(ctx, proxy.address, secret)
    try:
        request = EngineCoreRequest(RID, tuple(TOKEN_IDS), SamplingParams(max_tokens=3))
        sent, got = wire.Channel(SECRET), wire.Channel(SECRET)
        dealer.send_multipart(sent.sign(AddRequests([request])))
        frames = recv(router)
        assert frames is not None and frames[0] == b"w0"
        msg, _ = got.verify(frames[1:])
        assert isinstance(msg, AddRequests)
        received = msg.requests[0]
        assert received.prompt_token_ids == tuple(TOKEN_IDS) and received.request_id == RID
        captured = proxy.captured()
        assert pickled_token_ids() in pickle.dumps(request)  # what the tap looks for is really there
        # In clear text the tap reads the prompt; under CURVE it reads neither it nor the request id.
        assert (pickled_token_ids() in captured) is not encrypted
        assert (RID.encode() in captured) is not encrypted
    finally:
        proxy.close()
        close_pair(ctx, router, dealer)


# -- replays ----------------------------------------------------------------------------------------
def test_a_replayed_or_older_message_is_refused() -> None:
    a, b = wire.Channel(SECRET), wire.Channel(SECRET)
    first, second = a.sign(("x", 1)), a.sign(("x", 2))
    assert b.verify(second)[0] == ("x", 2)
    with pytest.raises(wire.ReplayError):
        b.verify(second)  # the same frames again
    with pytest.raises(wire.ReplayError):
        b.verify(first)  # signed earlier than one already delivered
    assert wire.Channel(SECRET).verify(first)[0] == ("x", 1)  # another receiver keeps its own record
    tampered = [a.session + (10**6).to_bytes(8, "big"), *second[1:]]  # a later counter, but not signed
    with pytest.raises(wire.AuthError, match="signature"):
        b.verify(tampered)
    with pytest.raises(wire.AuthError):
        b.verify(wire.Channel(b"another secret").sign(("x", 3)))


def test_a_receiver_remembers_a_bounded_number_of_sessions() -> None:
    receiver = wire.Channel(SECRET, max_sessions=8)
    senders = [wire.Channel(SECRET) for _ in range(50)]
    for s in senders:
        receiver.verify(s.sign("hi"))
    assert len(receiver.guard) == 8
    again = senders[-1].sign("again")
    receiver.verify(again)
    with pytest.raises(wire.ReplayError):  # the most recent sessions are still guarded
        receiver.verify(again)


def test_the_kv_receiver_refuses_replayed_frames(receiver: ZmqReceiver, kv_client: zmq.Socket) -> None:
    receiver.open("r1", [2])
    channel = wire.Channel(SECRET)
    kv = pattern_slice(1)
    frames = channel.sign(("kv", "r1", 0, [2], tuple(kv.shape), "uint8"), kv.numpy().tobytes())
    kv_client.send_multipart(frames)
    kv_client.send_multipart(channel.sign(("fin", "r1")))
    ack = recv(kv_client)
    assert ack is not None and channel.verify(ack)[0] == ("ack", "r1", None)
    assert receiver.pool is not None
    receiver.pool.local.zero_()
    kv_client.send_multipart(frames)  # the same signed frames, on the same connection
    assert recv(kv_client) == [REFUSED]
    assert not receiver.pool.local.any()


def test_a_recorded_kv_transfer_replayed_on_a_fresh_connection_gets_nowhere(receiver: ZmqReceiver,
                                                                            proxy: Proxy) -> None:
    handle = through(proxy, receiver, "r1", [3, 4])
    sender = ZmqSender(SECRET)
    try:
        assert transfer(sender, handle, pattern_slice(2)).ok
    finally:
        sender.close()
    assert wait_for(lambda: proxy.closed_upstream)  # the sender's connection is over
    recorded = bytes(proxy.upstream)
    assert receiver.pool is not None
    receiver.pool.local.zero_()
    with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as tap:
        tap.sendall(recorded)
        time.sleep(0.5)
    assert not receiver.pool.local.any()  # the handshake does not survive a replay: nothing was applied
    # And it serves the next legitimate transfer.
    sender = ZmqSender(SECRET)
    try:
        assert transfer(sender, through(proxy, receiver, "r2", [3]), pattern_slice(1)).ok
    finally:
        sender.close()
    assert receiver.pool.local[:, :, 3].any()


# -- bounded input ----------------------------------------------------------------------------------
def test_an_oversize_frame_drops_the_connection_before_it_is_buffered(receiver: ZmqReceiver, proxy: Proxy) -> None:
    limit = max_kv_frame(SHAPE, 1)
    oversize = 128 << 20
    assert oversize > 100 * limit
    ctx = zmq.Context.instance()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    secure.client(client, SECRET, proxy.address, 1 << 16)
    client.connect(proxy.address)
    channel = wire.Channel(SECRET)
    receiver.open("big", [1])
    try:
        client.send_multipart(channel.sign(("kv", "big", 0, [1], (oversize,), "uint8"), bytearray(oversize)),
                              copy=False)
        assert wait_for(lambda: proxy.closed_upstream, timeout=30)
        # The receiver hung up after the frame's size, long before its body could have arrived.
        assert proxy.closed_upstream[0] < oversize // 4
        # The same client reconnects and is served; the oversize message was never delivered
        # (it would have failed its write and that error would come back on the fin).
        client.send_multipart(channel.sign(("fin", "big")))
        ack = recv(client, 10_000)
        assert ack is not None and channel.verify(ack)[0] == ("ack", "big", None)
        assert receiver.pool is not None and not receiver.pool.local.any()
    finally:
        client.close(linger=0)
    sender = ZmqSender(SECRET)
    try:
        assert transfer(sender, through(proxy, receiver, "r1", [1]), pattern_slice(1)).ok
    finally:
        sender.close()


def test_every_receiving_socket_has_a_frame_limit(receiver: ZmqReceiver) -> None:
    assert receiver._sock.getsockopt(zmq.MAXMSGSIZE) == max_kv_frame(SHAPE, 1) + secure.CURVE_OVERHEAD
    sender = ZmqSender(SECRET)
    try:
        sock = sender._sock(receiver.endpoint.address)
        assert 0 < sock.getsockopt(zmq.MAXMSGSIZE) <= 1 << 20  # acks only
    finally:
        sender.close()


# -- authentication ---------------------------------------------------------------------------------
def _knock(ctx: zmq.Context, router: zmq.Socket, address: str, configure) -> tuple[bool, bool]:  # noqa: ANN001
    """(whether a DEALER configured so completes its handshake, whether what it sends is delivered)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    configure(s)
    monitor = secure.watch_handshakes(s)
    s.connect(address)
    s.send_multipart([b"let me in"])
    outcomes: list[bool] = []
    wait_for(lambda: bool(outcomes.extend(secure.handshake_outcomes(monitor)) or outcomes), timeout=5)
    frames = recv(router, 300)
    secure.unwatch(s, monitor)
    s.close(linger=0)
    return bool(outcomes) and outcomes[0], frames is not None and frames[-1] == b"let me in"


def test_only_a_client_holding_the_secret_completes_the_handshake() -> None:
    ctx, router, port = control_pair(SECRET)
    address = f"tcp://127.0.0.1:{port}"
    keys = secure.derive_keys(SECRET)
    try:
        def wrong_secret(s: zmq.Socket) -> None:
            secure.client(s, b"a guess", address, 1 << 16)

        def knows_the_server_key(s: zmq.Socket) -> None:  # but not the client key: ZAP refuses it
            public, private = zmq.curve_keypair()
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys.server_public, public, private

        def plain(s: zmq.Socket) -> None:
            pass

        for configure in (wrong_secret, knows_the_server_key, plain):
            assert _knock(ctx, router, address, configure) == (False, False), configure.__name__
        assert _knock(ctx, router, address, lambda s: secure.client(s, SECRET, address, 1 << 16)) == (True, True)
    finally:
        close_pair(ctx, router)


def test_a_server_without_its_zap_handler_admits_nobody() -> None:
    ctx, router, port = control_pair(SECRET)
    address = f"tcp://127.0.0.1:{port}"
    try:
        secure.release(router)  # stops the context's ZAP thread, as if it had died
        assert _knock(ctx, router, address, lambda s: secure.client(s, SECRET, address, 1 << 16)) == (False, False)
    finally:
        close_pair(ctx, router)


def test_a_kv_sender_with_the_wrong_secret_fails_fast(receiver: ZmqReceiver) -> None:
    receiver.open("r1", [1])
    sender = ZmqSender(b"a guess")
    try:
        t0 = time.monotonic()
        result = transfer(sender, TransferHandle("r1", [1], 0, receiver.endpoint), pattern_slice(1))
        assert not result.ok and "secret" in (result.error or "") and time.monotonic() - t0 < 5
    finally:
        sender.close()
    assert receiver.pool is not None and not receiver.pool.local.any()


def test_derived_keys_are_deterministic_and_distinct() -> None:
    keys = secure.derive_keys(SECRET)
    assert keys == secure.derive_keys(bytes(SECRET))
    assert keys.server_public != keys.client_public
    assert secure.derive_keys(b"another").server_public != keys.server_public
    assert zmq.curve_public(keys.server_secret) == keys.server_public


# -- the router's refused peers ---------------------------------------------------------------------
def test_the_routers_refused_peers_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "REFUSED_PEERS", 16)

    async def main() -> None:
        engine = DisaggEngine(None, None, RouterSettings(secret=SECRET))  # type: ignore[arg-type]
        assert engine._sock.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_CONTROL_FRAME + secure.CURVE_OVERHEAD
        port = engine._sock.bind_to_random_port("tcp://127.0.0.1")
        engine._tasks = [asyncio.create_task(engine._read())]
        address = f"tcp://127.0.0.1:{port}"
        ctx = zmq.Context()

        def knock(i: int) -> None:  # the right CURVE keys, so it reaches the router, but unsigned junk
            s = worker_socket(ctx, address, SECRET, f"intruder-{i}".encode())
            s.send_multipart([b"junk", b"more junk", b"not a signature"])
            time.sleep(0.01)
            s.close(linger=100)

        try:
            for i in range(40):
                await asyncio.get_running_loop().run_in_executor(None, knock, i)
            deadline = time.monotonic() + 10
            while b"intruder-39" not in engine._refused and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert len(engine._refused) == 16
            assert list(engine._refused) == [f"intruder-{i}".encode() for i in range(24, 40)]
        finally:
            ctx.term()
            await engine.shutdown()

    asyncio.run(main())
