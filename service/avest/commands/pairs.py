"""``avest pairs``: list the pairs a running service holds."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from avest.commands.options import add_token_arguments, dumps, token
from avest_wire.rules import UPDATE_RULE_NAMES

#: The service's gRPC address: what ``avest serve`` listens on, and the default
#: the client commands (``pairs``, ``replay``) connect to.
GRPC_ADDRESS_ENV = "AVEST_GRPC_ADDRESS"
DEFAULT_GRPC_ADDRESS = "127.0.0.1:50051"


def add_address_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help=f"service gRPC address HOST:PORT [env {GRPC_ADDRESS_ENV}, default "
        f"{DEFAULT_GRPC_ADDRESS}]",
    )


def grpc_address(flag: str | None) -> str:
    """The flag, else ``AVEST_GRPC_ADDRESS``, else the default; a wildcard host
    (a service's bind address such as ``0.0.0.0:50051``) on loopback, as ``avest health``."""
    address = (flag or os.environ.get(GRPC_ADDRESS_ENV, "")).strip() or DEFAULT_GRPC_ADDRESS
    host, sep, port = address.rpartition(":")
    if sep and host.strip("[]") in ("", "0.0.0.0"):
        return f"127.0.0.1:{port}"
    if sep and host.strip("[]") == "::":
        return f"[::1]:{port}"
    return address


def rpc_failure(command: str, address: str, code: str, details: str) -> str:
    """The line a failed call prints: the status, and what to do about it."""
    hint = ""
    if code == "UNAVAILABLE":
        hint = (
            "; is a service running there? Start one with `avest serve`, or give its "
            f"address (--address or {GRPC_ADDRESS_ENV})"
        )
    return f"avest {command}: {address}: {code}: {details}{hint}"


def register(p: argparse.ArgumentParser) -> None:
    add_address_argument(p)
    add_token_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON list (NaN as null)")
    p.set_defaults(func=run)


def pair_json(pair: Any) -> dict[str, Any]:
    """A ``avest.v1.Pair`` as the JSON the CLI prints."""
    c, cal = pair.coefficients, pair.calibration
    return {
        "pair_id": pair.pair_id,
        "key": {
            "target": pair.key.target_model,
            "draft": pair.key.draft_model,
            "method": pair.key.method,
            "k": pair.key.num_speculative_tokens,
            "labels": dict(pair.key.labels),
        },
        "rule": UPDATE_RULE_NAMES.get(pair.update_rule, ""),
        "refit_interval": pair.refit_interval,
        "version": c.version,
        "round": c.round,
        "slope": c.slope,
        "intercepts": list(c.intercepts),
        "drafts_observed": pair.drafts_observed,
        "steps_observed": pair.steps_observed,
        "calibration": {
            "count": cal.count,
            "auc": cal.auc,
            "logloss": cal.logloss,
            "ece": cal.ece,
            "mean_predicted": cal.mean_predicted,
            "observed": cal.observed,
        },
    }


def print_pair(pair: Any) -> None:
    d = pair_json(pair)
    cal = d["calibration"]
    print(
        f"pair {d['pair_id']}  {d['key']['target']} <- {d['key']['draft']}  K={d['key']['k']}  rule={d['rule']}"
    )
    print(
        f"  version {d['version']}  round {d['round']}  drafts {d['drafts_observed']}  steps {d['steps_observed']}"
    )
    print(f"  slope {d['slope']:.4f}  intercepts " + " ".join(f"{b:+.3f}" for b in d["intercepts"]))
    print(
        f"  AUC {cal['auc']:.4f}  log loss {cal['logloss']:.4f}  ECE {cal['ece']:.4f}  "
        f"predicted {cal['mean_predicted']:.3f}  observed {cal['observed']:.3f}"
    )


def run(args: argparse.Namespace) -> int:
    import grpc

    from avest_client.credentials import Credentials, sync_channel
    from avest_wire.v1 import estimator_pb2 as pb
    from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

    address = grpc_address(args.address)
    credentials = Credentials.resolve(token=token(args))
    pairs: list[Any] = []
    try:
        with sync_channel(address, (), credentials) as channel:
            stub = pb_grpc.EstimatorServiceStub(channel)
            page_token = ""
            while True:  # every page, each as large as the service allows
                page = stub.ListPairs(pb.ListPairsRequest(page_token=page_token), timeout=10)
                pairs.extend(page.pairs)
                if not page.next_page_token or page.next_page_token == page_token:
                    break
                page_token = page.next_page_token
    except grpc.RpcError as exc:
        print(rpc_failure("pairs", address, exc.code().name, exc.details()), file=sys.stderr)
        return 1
    if args.json:
        print(dumps([pair_json(p) for p in pairs]))
    elif not pairs:
        print("no pairs")
    for p in [] if args.json else pairs:
        print_pair(p)
    return 0
