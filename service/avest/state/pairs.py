"""Per-pair estimator state: the registry the gRPC and HTTP adapters share.

All mutation happens on the service's event loop thread, one call at a
time, so no locks are needed; persistence reads immutable snapshots taken
here and writes them on a thread of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from avest.core.costs import CostTable
from avest.core.estimator import Batch, OnlineEstimator
from avest.core.model import Coefficients
from avest.core.rule_factory import DEFAULT_RULE, RULE_NAMES, make_rule, rule_options
from avest.core.rules import Refit
from avest.core.strata import StratifiedEstimator
from avest.core.summary import summary_coefficients, summary_stats
from avest.state.costs import CostCurves, check_costs
from avest.state.errors import Conflict, Exhausted, NotFound
from avest.state.folds import Folded
from avest.state.workers import WorkerTable
from avest_wire import limits
from avest_wire.errors import InvalidInput
from avest_wire.pair import PairKey
from avest_wire.summary import RoundSummary

log = logging.getLogger(__name__)


def check_sequence(seq: int, last: int) -> None:
    """A new step's sequence number: at most :data:`limits.MAX_SEQUENCE_GAP` past the last."""
    if seq > limits.MAX_SEQUENCE:
        raise InvalidInput("sequence", f"must be at most {limits.MAX_SEQUENCE}")
    if last > 0 and seq - last > limits.MAX_SEQUENCE_GAP:
        raise InvalidInput(
            "sequence",
            f"{seq} is more than {limits.MAX_SEQUENCE_GAP} past this worker's last step {last}",
        )


@dataclass
class HistoryEntry:
    version: int
    round: int
    time: float
    slope: float
    intercepts: tuple[float, ...]
    outcome: str


@dataclass
class Pair:
    """One model pair: its estimator and everything the service tracks about it."""

    key: PairKey
    rule_name: str
    estimator: OnlineEstimator
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    #: Highest sequence number applied, per worker (for deduplication).
    applied: dict[str, int] = field(default_factory=dict)
    #: Highest sequence number made durable, per worker (what is acknowledged).
    durable: dict[str, int] = field(default_factory=dict)
    #: When each worker's last step was applied (for pruning idle workers).
    seen: dict[str, float] = field(default_factory=dict)
    #: Workers whose records changed, and workers pruned, since the last snapshot.
    changed_workers: set[str] = field(default_factory=set)
    pruned_workers: set[str] = field(default_factory=set)
    #: Set by a reset: stored history older than this is removed at the next write.
    history_cleared: float = 0.0
    costs: dict[str, CostCurves] = field(default_factory=dict)
    _tables: dict[str, CostTable] = field(default_factory=dict)
    history: list[HistoryEntry] = field(default_factory=list)
    #: Changed since the last snapshot was written.
    dirty: bool = False
    #: The last this many ``history`` entries, and these hardware labels' cost
    #: curves, are not in the store yet (a snapshot writes only those).
    unsaved_history: int = 0
    unsaved_costs: set[str] = field(default_factory=set)
    #: A round held open by the refit interval: the refits it stands for (the rounds
    #: that filled in it, had each refitted at once), and the steps since the last.
    held_refits: int = 0
    held_steps: int = 0
    watchers: list[Callable[[Pair], None]] = field(default_factory=list)
    #: The workers seen sending to this pair (bounded; not persisted).
    workers: WorkerTable = field(default_factory=WorkerTable)
    #: The stored revision this copy was read at (replicas on PostgreSQL).
    revision: int = 0
    #: Its strata (docs/strata.md): a coefficient set per kind of request beside
    #: the estimator's, which stays what traffic without strata gets. Built with
    #: the pair; its ``pooled`` is always :attr:`estimator`.
    strata: StratifiedEstimator | None = None
    #: Which stratum last found no place (the one log line per new one).
    logged_fallback: str | None = None

    def stratified(self) -> StratifiedEstimator:
        """The pair's strata, their pooled estimator made the pair's (a fold on a
        worker thread, a refresh or a restore replaces the estimator)."""
        if self.strata is None:
            self.strata = StratifiedEstimator(self.estimator)
        self.strata.pooled = self.estimator
        return self.strata

    @property
    def id(self) -> str:
        return self.key.pair_id

    @property
    def k(self) -> int:
        return self.key.k

    @property
    def coefficients(self) -> Coefficients:
        return self.estimator.coefficients

    @property
    def refitted(self) -> float:
        """When the refit or reset that produced the current version and round happened:
        its history entry (kept across restarts; the newest one when none matches), the
        pair's creation before any. Not :attr:`updated`, which moves with every
        observation."""
        now = (self.estimator.version, self.estimator.round)
        for entry in reversed(self.history):
            if (entry.version, entry.round) == now:
                return entry.time
        return max((h.time for h in self.history), default=self.created)

    def cost_table(self, hardware: str) -> CostTable:
        """The hardware's cost table. It only reads (the read port calls it from its
        threads): :meth:`set_costs` builds each table with its curves, and a refresh
        replaces both mappings whole."""
        table = self._tables.get(hardware)
        if table is None:
            known = ", ".join(sorted(self.costs)) or "none"
            raise NotFound(
                f"pair {self.id} has no cost curves for hardware {hardware!r} (known: {known})"
            )
        return table

    def set_costs(self, curves: CostCurves) -> None:
        check_costs(curves)
        if curves.hardware not in self.costs and len(self.costs) >= limits.MAX_HARDWARE_PER_PAIR:
            raise Exhausted(
                "hardware",
                f"pair {self.id} holds cost curves for {len(self.costs)} hardware labels, "
                f"the limit is {limits.MAX_HARDWARE_PER_PAIR}",
            )
        table = curves.table()  # validates before anything changes
        self._tables[curves.hardware] = table  # first: cost_table reads it alone
        self.costs[curves.hardware] = curves
        self.unsaved_costs.add(curves.hardware)
        self.dirty = True

    def observe(
        self,
        worker: str,
        seq: int,
        batch: Batch | RoundSummary,
        folded: Folded | None = None,
        may_refit: bool = True,
        strata: Sequence[str] | str | None = None,
    ) -> tuple[bool, Refit | None]:
        """Apply a validated batch or round summary unless ``(worker, seq)`` was applied already.

        ``folded``: the batch was already folded into a copy of this pair's
        estimator (on a worker thread), which takes the estimator's place, with
        the batch's round statistics it folded. ``may_refit``: a round this fills may
        refit now (else it stays open until :meth:`refit_held`). Returns
        ``(applied, refit)``.

        The worker's table judges the data first (:meth:`WorkerTable.judge`): a
        quarantined worker's data is counted and scored, never folded; a worker in
        good standing has its share of the round bounded.

        ``strata``: a step's stratum per row, or a summary's stratum (None: the
        pair's pooled traffic, applied exactly as without strata). What the pair's
        estimator keeps feeds the strata too, each stratum's rows (or summary) its
        own fit; they refit whenever the pair does.
        """
        if seq <= self.applied.get(worker, -1):
            return False, None
        est = self.estimator
        round_drafts = est.round_stats.labelled()
        stats = folded[2] if folded is not None else est.contribution(batch)
        if isinstance(batch, RoundSummary):
            steps, seen = batch.steps, summary_stats(batch)
        else:
            steps, seen = 1, stats
        kept = self.workers.judge(worker, stats, steps, (est.version, est.round), seen)
        refit: Refit | None = None
        if kept is not None and strata is not None:
            self._fold_strata(batch, strata)
        if isinstance(batch, RoundSummary):
            lag = est.version - batch.version
            if kept is not None:
                refit = est.apply_summary(batch, kept, may_refit)
            self.workers.summary(worker, batch, lag)
        else:
            if kept is stats and folded is not None:
                self.estimator, refit, _ = folded
            elif kept is not None:
                refit = est.apply(batch, kept, may_refit)
            self.workers.raw(worker, batch.labelled)
        if refit is not None:
            self._refit_strata(round_drafts + (kept.labelled() if kept is not None else 0))
            self._tick()
        elif kept is not None:
            self._age_held_round(steps)
        self.applied[worker] = seq
        self.updated = self.seen[worker] = time.time()
        self.changed_workers.add(worker)
        self.pruned_workers.discard(worker)
        self.dirty = True
        if refit is not None:
            self._record(refit.outcome)
        return True, refit

    def _fold_strata(self, batch: Batch | RoundSummary, strata: Sequence[str] | str) -> None:
        own = self.stratified()
        before = own.fallback_rows
        if isinstance(batch, RoundSummary):
            assert isinstance(strata, str)
            own.add_summary(
                strata,
                summary_stats(batch),
                summary_coefficients(batch),
                batch.drafts,
                batch.sketch,
            )
        else:
            own.fold_rows(batch, list(strata))
        if own.fallback_rows != before and own.last_fallback != self.logged_fallback:
            self.logged_fallback = own.last_fallback
            log.warning(
                "pair %s holds its limit of %d strata: stratum %s is predicted with the "
                "pair's coefficients (counted in avest_strata_fallback_rows_total)",
                self.id,
                own.config.max_strata,
                limits.echo(own.last_fallback or ""),
            )

    def _refit_strata(self, round_drafts: int) -> None:
        """The pair refitted a round of ``round_drafts`` labelled drafts: so do its strata."""
        if self.strata is not None and self.strata.strata:
            self.stratified().refit_strata(round_drafts)

    def stratum_coefficients(self) -> list[tuple[str, Coefficients, int, int]]:
        """Each stratum's name, served coefficients, rounds and drafts, in name order."""
        if self.strata is None:
            return []
        return [
            (name, own.coefficients, own.rounds, own.drafts)
            for name, own in sorted(self.strata.strata.items())
        ]

    def _tick(self) -> None:
        self.workers.tick()
        self.held_refits = self.held_steps = 0

    def _age_held_round(self, steps: int) -> None:
        """A round held open ages the workers' evidence as the refits it stands for
        would have (one per round that filled in it, after the first: that one is
        the refit to come), so workers are judged on the same stretch of recent data
        whatever the refit interval: a worker that joins late is not scored against
        evidence from a model since refitted (which quarantined honest workers while
        rounds were held), and a poisoner's evidence is not diluted either."""
        self.held_steps += steps
        if self.held_steps < self.estimator.round_length:
            return
        self.held_steps = 0
        self.held_refits += 1
        if self.held_refits > 1:
            self.workers.age()

    def refit_held(self) -> Refit | None:
        """Refit a round held open past its length (:meth:`observe` with
        ``may_refit`` false); ``None`` when none is."""
        if not self.estimator.round_full:
            return None
        round_drafts = self.estimator.round_stats.labelled()
        refit = self.estimator.refit()
        self._refit_strata(round_drafts)
        self._tick()
        self.dirty = True
        self._record(refit.outcome)
        return refit

    def saved(self, record: dict[str, Any]) -> list[tuple[str, str, int]]:
        """``record`` (from :meth:`Registry.snapshot`) is durable: its history and
        cost curves need no writing again (unless they changed meanwhile), and its
        workers' steps are acknowledged up to what it carried. Returns the
        ``(pair, worker, sequence)`` watermarks it raised."""
        self.unsaved_history = max(0, self.unsaved_history - len(record["history"]))
        for hardware, curves in record["cost_objects"].items():
            if self.costs.get(hardware) is curves:
                self.unsaved_costs.discard(hardware)
        raised = []
        for worker, (seq, _) in record["workers"].items():
            if seq > self.durable.get(worker, 0):
                self.durable[worker] = seq
                raised.append((self.id, worker, seq))
        return raised

    def reset(self) -> None:
        self.estimator.reset()
        if self.strata is not None:
            self.strata.reset()
        self._tick()
        self.history.clear()
        self.history_cleared = time.time()
        self.unsaved_history = 0
        self._record("reset")

    def prune_workers(self, idle_before: float) -> list[str]:
        """Forget workers idle since before ``idle_before`` whose steps are all durable.

        A pruned worker that comes back is a new worker: its steps are applied
        from any sequence number (the ones it had were all acknowledged).
        """
        gone = [
            w
            for w, t in self.seen.items()
            if t < idle_before and self.durable.get(w, 0) >= self.applied.get(w, 0)
        ]
        for w in gone:
            self.applied.pop(w, None)
            self.durable.pop(w, None)
            self.seen.pop(w, None)
            self.changed_workers.discard(w)
            self.pruned_workers.add(w)
        if gone:
            self.dirty = True
        return gone

    def _record(self, outcome: str) -> None:
        c = self.estimator.coefficients
        self.history.append(
            HistoryEntry(
                self.estimator.version,
                self.estimator.round,
                time.time(),
                c.slope,
                c.intercepts,
                outcome,
            )
        )
        del self.history[:-256]
        self.unsaved_history = min(self.unsaved_history + 1, len(self.history))
        self.dirty = True
        for notify in list(self.watchers):
            notify(self)


@dataclass(frozen=True)
class RuleConfig:
    default_rule: str = DEFAULT_RULE
    refit_interval: int = 100
    forgetting: float = 0.95
    prior: float = 1.0
    #: Give every pair the calibration layer (served only while it wins).
    calibrate: bool = True


class Registry:
    """All pairs by id, with registration limits."""

    def __init__(self, rules: RuleConfig | None = None, max_pairs: int = 1024) -> None:
        self.rules = rules or RuleConfig()
        self.max_pairs = max_pairs
        self.pairs: dict[str, Pair] = {}
        self.on_register: list[Callable[[Pair], None]] = []

    def get(self, pair_id: str) -> Pair:
        try:
            return self.pairs[pair_id]
        except KeyError:
            raise NotFound(f"unknown pair_id {limits.echo(pair_id)}") from None

    def register(self, key: PairKey, rule: str = "", refit_interval: int = 0) -> tuple[Pair, bool]:
        """Idempotent: an existing key returns its pair unchanged. ``(pair, created)``."""
        existing = self.pairs.get(key.pair_id)
        if existing is not None:
            if rule and rule != existing.rule_name:
                raise Conflict(
                    "update_rule", f"pair {existing.id} uses {existing.rule_name!r}, not {rule!r}"
                )
            if refit_interval and refit_interval != existing.estimator.refit_interval:
                raise Conflict(
                    "refit_interval",
                    f"pair {existing.id} refits every {existing.estimator.refit_interval} steps, not {refit_interval}",
                )
            return existing, False
        if rule and rule not in RULE_NAMES:
            raise InvalidInput("rule", f"must be one of {', '.join(RULE_NAMES)}, got {rule!r}")
        if refit_interval < 0 or refit_interval > 1_000_000:
            raise InvalidInput("refit_interval", "must lie in [0, 1000000] (0 = server default)")
        problem = limits.key_problem(key.target, key.draft, key.method, dict(key.labels))
        if problem is not None:
            raise InvalidInput(*problem)
        if len(self.pairs) >= self.max_pairs:
            raise Exhausted("pairs", f"the service holds its limit of {self.max_pairs} pairs")
        pair = self.build(
            key, rule or self.rules.default_rule, refit_interval or self.rules.refit_interval
        )
        self.pairs[pair.id] = pair
        pair._record("registered")
        for hook in self.on_register:
            hook(pair)
        return pair, True

    def build(self, key: PairKey, rule: str, refit_interval: int) -> Pair:
        estimator = OnlineEstimator(
            key.k,
            make_rule(rule, **rule_options(rule, self.rules.forgetting, self.rules.prior)),
            refit_interval=refit_interval,
            calibrate=self.rules.calibrate,
        )
        return Pair(key=key, rule_name=rule, estimator=estimator)

    def snapshot(self, pair: Pair) -> dict[str, Any]:
        """An immutable picture of a pair for the store (arrays copied): the
        estimator's state, the workers that changed since the last snapshot, and
        the history entries and cost curves not yet saved. :meth:`unsnapshot` puts
        the workers back when the write fails (the unsaved history and cost curves
        stay unsaved until :meth:`Pair.saved`).
        """
        workers = {w: (pair.applied[w], pair.seen.get(w, 0.0)) for w in pair.changed_workers}
        pruned = sorted(pair.pruned_workers)
        pair.changed_workers = set()
        pair.pruned_workers = set()
        unsaved = [c for c in pair.costs.values() if c.hardware in pair.unsaved_costs]
        history = pair.history[len(pair.history) - pair.unsaved_history :]
        return {
            "id": pair.id,
            "key": pair.key.as_dict(),
            "rule": pair.rule_name,
            "refit_interval": pair.estimator.refit_interval,
            # fresh copies already; the strata's under "strata." (none without strata)
            "arrays": {
                **pair.estimator.snapshot(),
                **(pair.strata.snapshot() if pair.strata is not None else {}),
            },
            "last_outcome": pair.estimator.last_outcome,
            "workers": workers,
            "pruned": pruned,
            "history_cleared": pair.history_cleared,
            "costs": [c.as_dict() for c in unsaved],
            "cost_objects": {c.hardware: c for c in unsaved},
            "history": [vars(h).copy() for h in history],
            "updated": pair.updated,
        }

    @staticmethod
    def unsnapshot(pair: Pair, record: dict[str, Any]) -> None:
        """A snapshot that was not written: mark what it carried as changed again."""
        pair.changed_workers |= {w for w in record["workers"] if w in pair.applied}
        pair.pruned_workers |= {w for w in record["pruned"] if w not in pair.applied}
        pair.dirty = True

    def remove(self, pair: Pair) -> None:
        """Forget a pair (deletion, retirement, quarantine); its id may be registered again."""
        if self.pairs.get(pair.id) is pair:
            del self.pairs[pair.id]

    def restore(self, record: dict[str, Any]) -> Pair:
        key_d = record["key"]
        key = PairKey.of(
            key_d["target"], key_d["draft"], key_d["method"], key_d["k"], key_d["labels"]
        )
        pair = self._stored(key, record)
        self.pairs[pair.id] = pair
        return pair

    def _stored(self, key: PairKey, record: dict[str, Any]) -> Pair:
        """A pair built from a stored record (not registered)."""
        pair = self.build(key, record["rule"], int(record["refit_interval"]))
        pair.estimator.restore(record["arrays"])
        pair.stratified().restore(record["arrays"])
        pair.estimator.last_outcome = str(record.get("last_outcome", ""))
        pair.applied = {w: int(seq) for w, (seq, _) in record["workers"].items()}
        pair.seen = {w: float(seen) for w, (_, seen) in record["workers"].items()}
        pair.durable = dict(pair.applied)
        for c in record["costs"]:
            pair.set_costs(CostCurves.from_dict(c))
        pair.history = [
            HistoryEntry(**{**h, "intercepts": tuple(h["intercepts"])}) for h in record["history"]
        ]
        pair.updated = float(record["updated"])
        pair.dirty = False
        pair.unsaved_history, pair.unsaved_costs = 0, set()
        return pair

    def refresh(self, pair: Pair, record: dict[str, Any]) -> None:
        """Take the stored state of a registered pair in place (another replica wrote
        it, or this one's memory went ahead of a write that failed); its streams and
        watchers hear of new coefficients. What this process acknowledged stays
        acknowledged."""
        stored = self._stored(pair.key, record)
        est = pair.estimator
        before = (est.version, est.round, est.coefficients)
        pair.rule_name = stored.rule_name
        pair.estimator = stored.estimator
        pair.strata = stored.strata
        pair.applied, pair.seen, pair.history = stored.applied, stored.seen, stored.history
        for worker, seq in stored.durable.items():
            pair.durable[worker] = max(seq, pair.durable.get(worker, 0))
        pair.costs, pair._tables = stored.costs, stored._tables
        pair.updated = stored.updated
        pair.changed_workers, pair.pruned_workers = set(), set()
        pair.dirty = False
        pair.unsaved_history, pair.unsaved_costs = 0, set()
        est = pair.estimator
        # Another version, or the same number with another round or other coefficients
        # (a refit rejected there; this replica's own refit lost with its write).
        if (est.version, est.round, est.coefficients) != before:
            for notify in list(pair.watchers):
                notify(pair)
