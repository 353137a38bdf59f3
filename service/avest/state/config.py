"""What the state needs to know of the process: its store, its rules, its bounds.

The process settings (:mod:`avest.settings`) hold every flag; the state reads
only these, so it can be built (and tested) without flags, adapters or TLS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: The SQLite file's name in the data directory.
DATABASE_NAME = "avest.sqlite3"


@dataclass(frozen=True)
class StateConfig:
    #: Directory of the SQLite database and the state file (with the default store).
    data_dir: str
    #: Update rule of pairs that do not name one, and its interval and options.
    default_rule: str
    refit_interval: int
    forgetting: float
    prior: float
    #: Registrations beyond this many pairs are refused.
    max_pairs: int
    #: Applied batches are made durable (and acknowledged) this often.
    flush_interval_ms: int
    #: A raw step of at least this many draft cells is folded on a worker thread.
    fold_thread_cells: int
    #: Start although the state file says the store held pairs and it is gone.
    allow_empty_store: bool
    #: Idle workers' records and idle pairs are dropped after these (0: never).
    worker_ttl_s: float
    pair_ttl_s: float
    #: Refuse to start on a store with no pairs and no state file (a data directory
    #: emptied whole, or a first start).
    refuse_empty_store: bool = False
    #: Where pairs are stored: "" for the SQLite file in :attr:`data_dir`, or a
    #: PostgreSQL URL (``postgresql://USER@HOST:PORT/DB``).
    store: str = ""
    #: This process's name among the replicas on one PostgreSQL database (logs,
    #: metrics, the ``replicas`` table), unique among them; "" for the host name and
    #: the process id.
    replica_name: str = ""
    #: Messages a pair's queue holds before its senders wait (:mod:`avest.state.admission`).
    pair_queue: int = 64
    #: A full round refits at most this often per pair (seconds; 0: at once).
    min_refit_s: float = 0.0

    @property
    def database(self) -> Path:
        return Path(self.data_dir) / DATABASE_NAME
