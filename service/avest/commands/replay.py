"""``avest replay TRACE``: stream a trace into a running service as W workers.

Register the trace's pair and stream its steps into the service as W concurrent workers
(each step's rows split among them), then print the pair's coefficients and calibration.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from avest.commands.options import add_token_arguments, dumps, integer, number, token
from avest.commands.pairs import (
    add_address_argument,
    grpc_address,
    pair_json,
    print_pair,
    rpc_failure,
)
from avest.commands.traces import add_trace_argument, load_trace
from avest_wire.rules import UPDATE_RULES

#: Seconds ``avest replay`` waits for the service to answer before giving up.
CONNECT_TIMEOUT_S = 5.0


def register(p: argparse.ArgumentParser) -> None:
    add_trace_argument(p)
    add_address_argument(p)
    add_token_arguments(p)
    p.add_argument(
        "--workers", type=integer(1), default=1, metavar="W", help="concurrent simulated workers"
    )
    p.add_argument(
        "--rule",
        choices=[name for name in UPDATE_RULES if name],
        default="",
        help="update rule for the pair",
    )
    p.add_argument(
        "--refit-interval",
        type=integer(0),
        default=0,
        metavar="N",
        help="refit every N steps (0: service default)",
    )
    p.add_argument("--repeat", type=integer(1), default=1, help="replay the trace this many times")
    p.add_argument(
        "--rate",
        type=number(0),
        default=0.0,
        help="messages per second per worker (0: as fast as possible)",
    )
    p.add_argument(
        "--run-id",
        default="",
        help="worker ids are replay:RUN_ID:W; default: derived from the trace, so a rerun "
        "(after a crash, say) resumes and counts nothing twice; give a new one to replay "
        "the same trace again as new workers",
    )
    p.add_argument(
        "--retry-s",
        type=number(0, low_open=True),
        default=60.0,
        help="keep reconnecting (and resending what is unacknowledged) this long when the "
        "service goes away",
    )
    p.add_argument(
        "--connect-timeout",
        type=number(0, low_open=True),
        default=CONNECT_TIMEOUT_S,
        metavar="S",
        help=f"give up when no service answers within S seconds at the start (default "
        f"{CONNECT_TIMEOUT_S:g})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


async def reachable(address: str, timeout: float) -> bool:
    """Whether a service answers at ``address`` within ``timeout`` seconds."""
    from avest_client.credentials import Credentials, aio_channel

    async with aio_channel(address, (), Credentials.resolve(token="")) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            return False
    return True


class _NoBar:
    """Without tqdm (a client-only install): no progress bar."""

    def update(self) -> None:
        pass

    def close(self) -> None:
        pass


def run(args: argparse.Namespace) -> int:
    import grpc

    from avest.offline.replay import ReplayError, replay, step_bounds

    loaded = load_trace("replay", args.trace)
    if loaded is None:
        return 2
    path, trace = loaded
    bearer = token(args)
    address = grpc_address(args.address)
    if not asyncio.run(reachable(address, args.connect_timeout)):
        print(
            f"avest replay: no service answers at {address} (waited {args.connect_timeout:g} s); "
            "start one with `avest serve`, or give its address (--address or AVEST_GRPC_ADDRESS)",
            file=sys.stderr,
        )
        return 1
    total = len(step_bounds(trace)) * args.repeat * args.workers
    try:
        from tqdm import tqdm

        bar: Any = tqdm(
            total=total, desc="replay", unit="msg", disable=None, file=sys.stderr, leave=False
        )
    except ModuleNotFoundError:
        bar = _NoBar()
    try:
        result = asyncio.run(
            replay(
                address,
                trace,
                args.workers,
                args.rule,
                args.refit_interval,
                args.repeat,
                lambda: bar.update(),
                rate=args.rate,
                run_id=args.run_id,
                retry_s=args.retry_s,
                token=bearer,
            )
        )
    except grpc.aio.AioRpcError as exc:
        print(rpc_failure("replay", address, exc.code().name, exc.details()), file=sys.stderr)
        return 1
    except TimeoutError as exc:
        print(f"avest replay: {exc}; rerun the same command to resume", file=sys.stderr)
        return 1
    except ReplayError as exc:
        print(f"avest replay: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    duplicates = max(0, result.messages - result.applied)
    if args.json:
        counts = {"messages": result.messages, "new": result.applied, "duplicates": duplicates}
        print(dumps({**counts, **pair_json(result.pair)}))
    else:
        print(
            f"replayed {result.messages} messages from {path} as {args.workers} worker(s): "
            f"{result.applied} new, {duplicates} duplicates"
        )
        if duplicates and not result.applied:
            print(
                "  the service already held every step (the same replay ran before) and "
                "ignored them; --run-id NEW replays them again as new workers",
            )
        elif duplicates:
            print("  the service already held some steps (an earlier, interrupted run?)")
        print_pair(result.pair)
    return 0
