"""``avest record PAIR OUT``: record a pair's incoming raw stream into a trace file.

Ask a running service (admin HTTP) to record the raw steps its workers send for a pair,
wait until it holds --steps of them (or --timeout passes), and write them as an
avest-trace/1 file. Workers in summary mode send raw steps only at their sampling rate
(AVEST_RAW_SAMPLE); round summaries carry no drafts.
"""

from __future__ import annotations

import argparse
import sys
import time

from avest.commands.options import add_token_arguments, integer, number, token


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("pair", help="pair id (see `avest pairs`)")
    p.add_argument("out", help="trace file to write (.npz)")
    p.add_argument("--http", default="http://127.0.0.1:8000", help="the service's admin HTTP URL")
    p.add_argument(
        "--fraction",
        type=number(0, 1, low_open=True),
        default=1.0,
        help="share of raw steps to keep, in (0, 1]",
    )
    p.add_argument("--steps", type=integer(1), default=1000, help="steps to record")
    p.add_argument(
        "--timeout", type=number(0, low_open=True), default=600.0, help="seconds to wait at most"
    )
    add_token_arguments(p, admin=True)
    p.set_defaults(func=run)


def _call(method: str, url: str, token: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - the operator's URL
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def run(args: argparse.Namespace) -> int:
    import json
    import urllib.parse

    from avest.offline.trace import TraceError, read_trace

    base = f"{args.http.rstrip('/')}/v1/pairs/{urllib.parse.quote(args.pair)}/recording"
    query = urllib.parse.urlencode({"fraction": args.fraction, "steps": args.steps})
    bearer = token(args, admin=True)
    try:
        code, body = _call("POST", f"{base}?{query}", bearer)
        if code != 200:
            print(f"avest record: {code}: {body.decode(errors='replace')}", file=sys.stderr)
            return 1
        status = json.loads(body)
        deadline = time.monotonic() + args.timeout
        while not status["done"] and time.monotonic() < deadline:
            time.sleep(0.2)
            status = json.loads(_call("GET", base, bearer)[1])
        code, data = _call("GET", f"{base}.npz", bearer)
        if code != 200:
            print(f"avest record: {code}: {data.decode(errors='replace')}", file=sys.stderr)
            return 1
        _call("DELETE", base, bearer)
    except (OSError, ValueError) as exc:  # ValueError: not a URL
        print(f"avest record: cannot reach {args.http}: {exc}", file=sys.stderr)
        return 1
    with open(args.out, "wb") as f:
        f.write(data)
    try:
        trace = read_trace(args.out)
    except TraceError as exc:
        print(f"avest record: the service sent an invalid trace: {exc}", file=sys.stderr)
        return 1
    done = "" if status["done"] else f" (timed out after {args.timeout:g} s)"
    print(
        f"recorded {trace.num_steps} steps ({trace.rows} rows, {trace.labelled_count()} labelled "
        f"drafts) of pair {args.pair} out of {status['offered']} offered to {args.out}{done}"
    )
    return 0
