"""``avest demo``: a service on embedded defaults, fed a bundled trace by simulated workers.

Starts the service on embedded defaults (SQLite in a temporary directory unless
--data-dir is given), replays the bundled sample trace as several concurrent workers,
prints each refit's coefficients and calibration as they arrive, then keeps serving so
the metrics and the reliability diagram can be looked at (Ctrl-C stops).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import tempfile
import uuid
from typing import Any

from avest.commands.options import integer
from avest.commands.serve import FREE_ADDRESSES, busy
from avest.commands.traces import add_trace_argument, load_trace


def register(p: argparse.ArgumentParser) -> None:
    add_trace_argument(p)
    p.add_argument("--grpc-address", default="127.0.0.1:50051")
    p.add_argument("--http-address", default="127.0.0.1:8000")
    p.add_argument("--data-dir", default="", help="default: a fresh temporary directory")
    p.add_argument("--workers", type=integer(1), default=4, help="simulated workers (default 4)")
    p.add_argument(
        "--refit-interval", type=integer(1), default=20, help="refit every N steps (pooled)"
    )
    p.add_argument(
        "--exit", action="store_true", help="stop after the replay instead of serving on"
    )
    p.set_defaults(func=run)


async def _demo(args: argparse.Namespace) -> int:
    from avest import settings
    from avest.server import Server

    loaded = load_trace("demo", args.trace)
    if loaded is None:
        return 2
    trace = loaded[1]
    flags = argparse.Namespace(grpc_address=args.grpc_address, http_address=args.http_address)
    try:
        settings.from_sources(flags)  # the addresses, checked before anything is made
    except ValueError as exc:
        print(f"avest demo: {exc}", file=sys.stderr)
        return 2
    why = busy(args.grpc_address, args.http_address)
    if why:
        print(f"avest demo: {why}; {FREE_ADDRESSES}", file=sys.stderr)
        return 1
    # SIGINT (Ctrl-C) and SIGTERM (docker stop, kill) end the demo alike: the server
    # stops and the temporary data directory goes. Both are handled here, as `avest
    # serve` handles them, also when the demo was started with SIGINT ignored (a
    # background job of a shell, nohup), where asyncio would leave Ctrl-C unhandled.
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.ExitStack() as cleanup:
        data_dir = args.data_dir
        if not data_dir:
            data_dir = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="avest-demo-"))
        flags.data_dir = data_dir
        server = Server(settings.from_sources(flags))
        return await _serve(args, trace, server, data_dir)


async def _serve(args: argparse.Namespace, trace: Any, server: Any, data_dir: str) -> int:
    import grpc

    from avest.offline.replay import pair_key, replay
    from avest.server import BindError
    from avest_wire.v1 import estimator_pb2 as pb
    from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

    try:
        await server.start()
    except asyncio.CancelledError:
        await server.stop()
        return 0
    except BindError as exc:
        print(f"avest demo: {exc}; {FREE_ADDRESSES}", file=sys.stderr)
        return 1
    print(
        f"avest serving grpc={server.grpc_address} http=http://{server.http_address} data={data_dir}"
    )
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            stub = pb_grpc.EstimatorServiceStub(channel)
            reg = await stub.RegisterPair(
                pb.RegisterPairRequest(key=pair_key(trace), refit_interval=args.refit_interval)
            )
            pair_id = reg.pair_id

            async def watch() -> None:
                print(
                    f"{'version':>7} {'round':>5} {'slope':>7}  intercepts{'':<30} {'AUC':>6} {'ECE':>6}"
                )
                async for update in stub.WatchCoefficients(
                    pb.WatchCoefficientsRequest(pair_id=pair_id)
                ):
                    c = update.coefficients
                    cal = (await stub.GetPair(pb.GetPairRequest(pair_id=pair_id))).pair.calibration
                    bs = " ".join(f"{b:+.2f}" for b in c.intercepts)
                    print(
                        f"{c.version:>7} {c.round:>5} {c.slope:>7.4f}  {bs:<40} {cal.auc:>6.3f} {cal.ece:>6.3f}"
                    )

            watcher = asyncio.create_task(watch())
            result = await replay(
                server.grpc_address,
                trace,
                workers=args.workers,
                refit_interval=args.refit_interval,
                run_id=uuid.uuid4().hex[:12],  # new workers each demo, also on a kept data dir
            )
            await asyncio.sleep(0.2)
            watcher.cancel()
        cal = result.pair.calibration
        base = f"http://{server.http_address}"
        print(
            f"\nreplayed {result.messages} messages as {args.workers} workers: "
            f"{result.pair.drafts_observed} labelled drafts, AUC {cal.auc:.4f}, ECE {cal.ece:.4f}"
        )
        print(f"metrics:              {base}/metrics")
        print(f"pair:                 {base}/v1/pairs/{pair_id}")
        print(f"reliability diagram:  {base}/v1/pairs/{pair_id}/reliability.svg")
        print(f"API docs:             {base}/docs")
        if not args.exit:
            print("serving; Ctrl-C to stop")
            await asyncio.Event().wait()
    except asyncio.CancelledError:
        pass
    finally:
        await server.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_demo(args))
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 0
