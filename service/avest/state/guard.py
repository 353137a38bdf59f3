"""The state file: what the data directory held, kept outside the database.

``avest.state.json`` beside the SQLite file records how many pairs the store
held after its last write. A store that held pairs and is now missing, empty
(0 bytes, or no pairs) is refused at start, unless the operator says it is
meant (``--allow-empty-store``): a lost or truncated volume must not start
READY with every pair gone.

The state file lives in the data directory, so a directory emptied whole (a
volume not mounted, a new empty volume) loses it too: a store with no pairs and
no state file is a first start or such a directory, and nothing in it tells
which. That start logs one INFO line; with ``--refuse-empty-store`` it is
refused. A store that the state file says held pairs and that is now empty is
refused, or with ``--allow-empty-store`` started with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from avest import __version__
from avest.state.store_format import STORE_FORMAT

STATE_FILE = "avest.state.json"

log = logging.getLogger("avest")


class StoreEmptied(RuntimeError):
    """The store held pairs and is now missing or empty."""


class StateFile:
    def __init__(self, data_dir: Path | str, database: Path | str) -> None:
        self.path = Path(data_dir) / STATE_FILE
        self.database = Path(database)
        self._pairs: int | None = None

    def recorded_pairs(self) -> int:
        """Pairs the store held after its last recorded write (0 if never recorded)."""
        try:
            data = json.loads(self.path.read_text())
            return int(data.get("pairs", 0))
        except FileNotFoundError:
            return 0
        except (ValueError, OSError, AttributeError):
            # An unreadable state file is no evidence either way; it is rewritten.
            return 0

    def check_present(self, allow_empty: bool, refuse_unrecorded: bool = False) -> None:
        """Before opening: refuse a missing or 0-byte database that held pairs, and
        with ``refuse_unrecorded`` one that no state file is beside (nothing written)."""
        new = not self.database.exists() or self.database.stat().st_size == 0
        if refuse_unrecorded and new and not allow_empty:
            self.check_unrecorded(0, refuse=True, allow_empty=allow_empty)
        held = self.recorded_pairs()
        if held == 0 or allow_empty:
            return
        if not self.database.exists():
            raise StoreEmptied(self._message(held, "is missing"))
        if self.database.stat().st_size == 0:
            raise StoreEmptied(self._message(held, "is empty (0 bytes)"))

    def check_loaded(self, loaded_pairs: int, allow_empty: bool) -> None:
        """After loading: refuse a store with no pairs where pairs were recorded."""
        held = self.recorded_pairs()
        if not held or loaded_pairs:
            return
        if not allow_empty:
            raise StoreEmptied(self._message(held, "holds no pairs"))
        log.warning(
            "%s holds no pairs, but %s records %d pair(s) stored: beginning afresh "
            "(--allow-empty-store).",
            self.database,
            self.path,
            held,
        )

    def check_unrecorded(self, loaded_pairs: int, refuse: bool, allow_empty: bool) -> None:
        """After loading, before the first :meth:`record`: an empty store with no
        state file is a first start or a data directory emptied whole (nothing tells
        which). One INFO line, or refused when ``refuse`` (``--refuse-empty-store``)
        and not ``allow_empty``."""
        if loaded_pairs or self.path.exists():
            return
        if refuse and not allow_empty:
            raise StoreEmptied(
                f"{self.database} holds no pairs and {self.path.name} is not beside it: "
                "either this is the first start on this data directory, or the directory "
                "was emptied or its volume is not mounted (the state file that would say it "
                "held pairs is gone with it). Refusing to start with no pairs "
                "(--refuse-empty-store, AVEST_REFUSE_EMPTY_STORE). Mount or restore the data "
                "volume; to begin afresh on purpose, start once with --allow-empty-store."
            )
        log.info(
            "starting with no pairs in %s, no %s beside it: a first start, or a data "
            "directory emptied whole (--refuse-empty-store refuses such a start)",
            self.database,
            self.path.name,
        )

    def record(self, pairs: int) -> None:
        """Write the count (atomically) when it changed."""
        if pairs == self._pairs:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "pairs": pairs,
                    "store_format": STORE_FORMAT,
                    "written_by": __version__,
                    "time": time.time(),
                    "database": self.database.name,
                }
            )
        )
        os.replace(tmp, self.path)
        self._pairs = pairs

    def _message(self, held: int, what: str) -> str:
        return (
            f"{self.database} {what}, but {self.path} records {held} pair(s) stored: the "
            "data volume may be lost or not mounted. Refusing to start with every pair "
            "gone. Restore the volume, or start with --allow-empty-store "
            "(AVEST_ALLOW_EMPTY_STORE=true) to begin afresh."
        )
