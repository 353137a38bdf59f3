"""gRPC's wake-ups drained whole (:mod:`avest.grpc.wakeups`): the wrapped reader on a
socket pair of its own, and on a real grpcio asyncio server, where the reader it wraps
is grpcio's and calls go on being answered."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from avest.grpc.wakeups import drain_wakeups, drained


def _pending(sock: socket.socket) -> int:
    try:
        return len(sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return 0


def test_each_pass_runs_the_original_once_per_pending_byte() -> None:
    read_end, write_end = socket.socketpair()
    read_end.setblocking(False)  # as grpcio's
    with read_end, write_end:
        calls: list[int] = []

        def original() -> None:  # grpcio's reader: one byte, then every queued completion
            read_end.recv(1)
            calls.append(_pending(read_end))

        handle = drained(read_end, original)
        write_end.send(b"1" * 500)
        handle()
        assert calls == list(range(499, -1, -1))
        assert _pending(read_end) == 0
        write_end.send(b"1")
        handle()
        assert calls[-1] == 0 and len(calls) == 501
        # Another loop of the process took the byte first: grpcio's reader fails on
        # the empty socket, and that loop's reader hands the completions over.
        handle()
        assert len(calls) == 501


def test_a_reader_that_fails_leaves_the_bytes_after_it_to_wake_the_loops_again() -> None:
    """grpcio's reader raises for a completion of a loop already closed, before it
    hands the rest over: their wake-ups stay on the socket."""
    read_end, write_end = socket.socketpair()
    read_end.setblocking(False)
    with read_end, write_end:
        runs = [0]

        def original() -> None:
            read_end.recv(1)
            runs[0] += 1
            if runs[0] == 3:
                raise RuntimeError("Event loop is closed")

        handle = drained(read_end, original)
        write_end.send(b"1" * 10)
        with pytest.raises(RuntimeError):
            handle()
        assert _pending(read_end) == 7
        handle()
        assert _pending(read_end) == 0 and runs[0] == 10


def _reader(loop: asyncio.AbstractEventLoop) -> object:
    """The reader grpcio registered on the loop (its wake-up socket's)."""
    for key in loop._selector.get_map().values():  # type: ignore[attr-defined]
        if isinstance(key.fileobj, socket.socket) and key.fileobj.family == socket.AF_UNIX:
            return key.data[0]._callback
    raise AssertionError("no wake-up socket on the loop")


def test_a_real_grpc_server_keeps_answering_with_its_reader_wrapped() -> None:
    async def main() -> tuple[bool, bool, object, list[int]]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        loop = asyncio.get_running_loop()
        try:
            first = drain_wakeups(loop)
            again = drain_wakeups(loop)  # a second server in the process: wrapped once
            reader = _reader(loop)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                replies = await asyncio.gather(
                    *(stub.Check(health_pb2.HealthCheckRequest()) for _ in range(300))
                )
            return first, again, reader, [r.status for r in replies]
        finally:
            await server.stop(None)

    first, again, reader, statuses = asyncio.run(main())
    assert first and again
    assert getattr(reader, "drained", False)
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 300


def test_a_loop_without_grpc_is_left_as_it_is(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> bool:
        return drain_wakeups(asyncio.get_running_loop())

    with caplog.at_level("INFO", logger="avest.grpc"):
        assert asyncio.run(main()) is False
    assert "left as it is" in caplog.text
