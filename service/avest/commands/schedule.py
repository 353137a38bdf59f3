"""``avest schedule``: a pair's draft length by batch size, from a running service.

Ask a running service for a pair's draft-length schedule on one hardware label (its cost
curves) and print vLLM's speculative_config entry
{"num_speculative_tokens_per_batch_size": [[start, end, length], ...]} (ends inclusive,
0 turns speculation off). The service needs about a thousand recent drafts of the pair
first.

Prints the ``speculative_config`` entry vLLM takes, as JSON: ``avest schedule PAIR
--hardware H100 > schedule.json`` and merge it into ``--speculative-config``. With
``--table`` it prints each range, its length, whether adaptive verification pays off
there and the goodput expected against the best fixed length.
"""

from __future__ import annotations

import argparse
import sys

from avest.commands.options import add_token_arguments, dumps, token
from avest.commands.pairs import add_address_argument, grpc_address, rpc_failure


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("pair_id", metavar="PAIR", help="the pair's id (avest pairs lists them)")
    p.add_argument(
        "--hardware",
        default="",
        help="cost-curve label (SetCostCurves); may be left out when the pair has one",
    )
    p.add_argument(
        "--table", action="store_true", help="print the ranges as a table instead of JSON"
    )
    add_address_argument(p)
    add_token_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from avest.offline.table import Column, format_columns
    from avest_client import AvestError, EstimatorClient

    address = grpc_address(args.address)
    try:
        with EstimatorClient(address, token=token(args), timeout=30.0) as client:
            s = client.schedule(args.pair_id, args.hardware)
    except AvestError as exc:
        print(rpc_failure("schedule", address, exc.code.name, exc.message), file=sys.stderr)
        return 1
    if not args.table:
        print(dumps({"num_speculative_tokens_per_batch_size": [list(e) for e in s.to_vllm()]}))
        return 0
    read = f", features of the {s.features} drafts" if s.features else ""
    print(f"pair {s.pair_id} on {s.hardware}, coefficients version {s.coefficients_version}{read}")
    columns = [
        Column("batch sizes", "<"),
        Column("length", ">"),
        Column("AV", "<"),
        Column("expected tok/s", ">"),
        Column("best fixed tok/s", ">"),
    ]
    rows = [
        [
            f"{r.start}-{r.end}",
            str(r.num_speculative_tokens),
            "on" if r.adaptive_verification else "off",
            f"{r.expected_goodput:,.0f}",
            f"{r.best_fixed_goodput:,.0f}",
        ]
        for r in s.ranges
    ]
    print("\n".join(format_columns(columns, rows)))
    return 0
