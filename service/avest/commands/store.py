"""``avest store copy``: move every pair from one store to another.

A store is a PostgreSQL URL (``postgresql://USER@HOST:PORT/DB``) or a path (a
SQLite file, or a data directory holding ``avest.sqlite3``). Every pair's
snapshot, workers, cost curves and whole coefficient history are copied, then
both stores are read back and compared checksum by checksum. A target that
already holds pairs is refused unless ``--force`` (which deletes them first).
Stop the services on both stores first: a pair written meanwhile is not copied.
"""

from __future__ import annotations

import argparse
import sys


def register(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    copy = actions.add_parser(
        "copy",
        help="copy every pair from one store to another, verifying checksums",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    copy.add_argument(
        "--from", dest="source", required=True, metavar="PATH_OR_URL", help="the store to read"
    )
    copy.add_argument(
        "--to", dest="target", required=True, metavar="PATH_OR_URL", help="the store to write"
    )
    copy.add_argument(
        "--force", action="store_true", help="delete the pairs the target holds first"
    )
    copy.set_defaults(func=run_copy)


def run_copy(args: argparse.Namespace) -> int:
    from avest.state.guard import StoreEmptied
    from avest.state.store import PairStore, StoreTooNew, StoreUnreadable
    from avest.state.stores import CopyRefused, StoreNotFound, copy_pairs, open_location

    opened: list[PairStore] = []
    try:
        source = open_location(args.source, create=False)
        opened.append(source)
        target = open_location(args.target, create=True)
        opened.append(target)
        ids = copy_pairs(source, target, force=args.force)
    except (StoreNotFound, StoreTooNew, StoreUnreadable, StoreEmptied) as exc:
        print(f"avest store copy: {exc}", file=sys.stderr)
        return 2
    except (CopyRefused, RuntimeError) as exc:
        print(f"avest store copy: {exc}", file=sys.stderr)
        return 1
    finally:
        for store in opened:
            store.close()
    print(f"copied {len(ids)} pair(s) from {source.location} to {target.location}; checksums match")
    return 0
