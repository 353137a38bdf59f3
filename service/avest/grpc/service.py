"""The gRPC adapter: ``avest.v1.EstimatorService`` over :class:`~avest.state.app.Avest`.

Each RPC validates its request completely (through the core's checks)
before touching any state, and maps refusals to status codes:
``InvalidInput`` -> INVALID_ARGUMENT, unknown pair -> NOT_FOUND, limits ->
RESOURCE_EXHAUSTED, all with a message that names the field.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np

from avest.core.estimator import make_batch
from avest.grpc import budgets
from avest.grpc.convert import (
    RULE_FROM_PB,
    RULE_TO_PB,
    coefficients_pb,
    pair_pb,
    schedule_pb,
)
from avest.grpc.limits import StreamLimits
from avest.grpc.observe import ObserveStream
from avest.grpc.pages import page_cap
from avest.grpc.refusals import Refused, over_pair_rate, refusals
from avest.grpc.summaries import summary_from_pb
from avest.policy.access import Access, may_replace_costs
from avest.policy.throttle import KeyedRates, LogLimiter
from avest.state import listing
from avest.state.app import Avest
from avest.state.costs import CostCurves
from avest.state.errors import NotFound
from avest.state.pairs import Pair, check_sequence
from avest_wire import limits
from avest_wire import matrix as wire
from avest_wire.errors import InvalidInput
from avest_wire.messages import step_strata, summary_stratum
from avest_wire.pair import PairKey
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

log = logging.getLogger("avest.grpc")


class EstimatorService(pb_grpc.EstimatorServiceServicer):
    def __init__(
        self,
        app: Avest,
        limits: StreamLimits,
        on_refused: Callable[[str, str], None] | None = None,
        access: Access | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        #: Who may replace cost curves (``None``: anyone, as in-process tests build it).
        self.access = access
        self.on_refused = on_refused or (lambda method, reason: None)
        #: Open Observe streams: each a callback taking pushed responses.
        self.streams: set[ObserveStream] = set()
        #: Per pair, its latest coefficients for WatchCoefficients (latest value only).
        self.latest: dict[str, Latest] = {}
        self.open_streams = 0
        self.owners: dict[tuple[str, str], ObserveStream] = {}
        #: Per pair, how many of its workers open streams send as (``owners`` counted).
        self.streaming: collections.Counter[str] = collections.Counter()
        #: Per pair, its latest push as made for every stream (see ObserveStream).
        self.updates: dict[str, tuple[pb.Coefficients, int, pb.ObserveResponse]] = {}
        #: Unary calls per pair, whoever sends them (``pair_rate``).
        self.pair_rates = KeyedRates(limits.pair_rate)
        self._logs = LogLimiter("avest.grpc")
        #: Set when the server drains: streams stop applying steps, so the
        #: final snapshot covers (and acknowledges) everything applied.
        self.draining = False
        app.hooks.coefficients.append(self._coefficients_changed)
        app.hooks.durable.append(self._durable)
        app.hooks.removed.append(self._removed)
        app.usage.append(lambda pair: any(pair.id in s.pairs for s in self.streams))

    # -- helpers --------------------------------------------------------------

    def malformed(self, method: str) -> None:
        self.on_refused(method, "malformed")
        self._logs.warning("malformed", "malformed %s message(s) refused", method)

    def _pair(self, pair_id: str, rated: bool = True) -> Pair:
        """The pair named, counted against its rate (``pair_rate``) unless not ``rated``
        (deleting an abused pair is never refused for its rate, and Observe messages
        wait for room in the pair's queue instead)."""
        if not pair_id:
            raise InvalidInput("pair_id", "must not be empty")
        if len(pair_id) > limits.MAX_PAIR_ID_BYTES:
            raise NotFound(f"unknown pair_id {limits.echo(pair_id)}")
        pair = self.app.registry.get(pair_id)
        if rated and not self.pair_rates.take(pair.id):
            self._logs.warning("pair_rate", "pair %s over its call rate", pair.id)
            raise over_pair_rate(self.pair_rates.rate, pair.id)
        return pair

    async def _unary(
        self, method: str, context: grpc.aio.ServicerContext, fn: Callable[[], Any]
    ) -> Any:
        try:
            with refusals():
                return fn()
        except Refused as r:
            self.on_refused(method, r.reason)
            await context.abort(r.code, r.message)

    def _coefficients_changed(self, pair: Pair) -> None:
        msg = coefficients_pb(pair)
        for stream in list(self.streams):
            stream.coefficients(pair.id, msg)
        latest = self.latest.get(pair.id)
        if latest is not None:
            latest.publish(msg)

    def _removed(self, pair: Pair, why: str) -> None:
        for stream in list(self.streams):
            stream.pairs.discard(pair.id)
        self.updates.pop(pair.id, None)
        latest = self.latest.pop(pair.id, None)
        if latest is not None:
            latest.publish(None)

    def _durable(self, raised: list[tuple[str, str, int]]) -> None:
        # Each worker's watermark goes to the stream that sends as it (O(workers
        # made durable), not O(streams x their workers) per flush).
        owners, pairs = self.owners, self.app.registry.pairs
        for pair_id, worker, level in raised:
            stream = owners.get((pair_id, worker))
            if stream is not None and pair_id in pairs:
                stream.durable(pair_id, worker, level)

    # -- RPCs -------------------------------------------------------------------

    async def RegisterPair(
        self, request: pb.RegisterPairRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterPairResponse:
        def run() -> pb.RegisterPairResponse:
            k = request.key
            if request.update_rule not in RULE_FROM_PB:
                raise InvalidInput("update_rule", f"unknown value {request.update_rule}")
            key = PairKey.of(
                k.target_model, k.draft_model, k.method, k.num_speculative_tokens, dict(k.labels)
            )
            pair, created = self.app.register(
                key, RULE_FROM_PB[request.update_rule], request.refit_interval
            )
            return pb.RegisterPairResponse(
                pair_id=pair.id,
                update_rule=RULE_TO_PB[pair.rule_name],
                refit_interval=pair.estimator.refit_interval,
                coefficients=coefficients_pb(pair),
                created=created,
                accepts_round_summaries=True,
            )

        return await self._unary("RegisterPair", context, run)

    async def GetCoefficients(
        self, request: pb.GetCoefficientsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetCoefficientsResponse:
        return await self._unary(
            "GetCoefficients",
            context,
            lambda: pb.GetCoefficientsResponse(
                coefficients=coefficients_pb(self._pair(request.pair_id))
            ),
        )

    async def GetPair(
        self, request: pb.GetPairRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPairResponse:
        return await self._unary(
            "GetPair",
            context,
            lambda: pb.GetPairResponse(pair=pair_pb(self._pair(request.pair_id))),
        )

    async def GetSchedule(
        self, request: pb.GetScheduleRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetScheduleResponse:
        try:
            with refusals():
                if len(request.hardware.encode()) > limits.MAX_HARDWARE_BYTES:
                    raise InvalidInput(
                        "hardware", f"is longer than {limits.MAX_HARDWARE_BYTES} bytes"
                    )
                served = await self.app.schedules.get(
                    self._pair(request.pair_id), request.hardware or None
                )
        except Refused as r:
            self.on_refused("GetSchedule", r.reason)
            await context.abort(r.code, r.message)
        return schedule_pb(served)

    async def ListPairs(
        self, request: pb.ListPairsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPairsResponse:
        def run() -> pb.ListPairsResponse:
            cap = page_cap(self.limits.max_message_bytes)
            if request.page_size < 0:
                raise InvalidInput("page_size", f"is {request.page_size}, must be >= 0")
            pairs, token = listing.page(
                self.app.registry.pairs, min(request.page_size or cap, cap), request.page_token
            )
            return pb.ListPairsResponse(
                pairs=[pair_pb(p, strata=False) for p in pairs], next_page_token=token
            )

        return await self._unary("ListPairs", context, run)

    async def Score(
        self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScoreResponse:
        def run() -> pb.ScoreResponse:
            pair = self._pair(request.pair_id)
            return budgets.score(pair.estimator.served(), request, self.limits.max_rows)

        return await self._unary("Score", context, run)

    async def Budget(
        self, request: pb.BudgetRequest, context: grpc.aio.ServicerContext
    ) -> pb.BudgetResponse:
        def run() -> pb.BudgetResponse:
            pair = self._pair(request.pair_id)
            return budgets.budget(
                pair.k, pair.estimator.served, pair.cost_table, request, self.limits.max_rows
            )

        return await self._unary("Budget", context, run)

    async def SetCostCurves(
        self, request: pb.SetCostCurvesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetCostCurvesResponse:
        def run() -> pb.SetCostCurvesResponse:
            pair = self._pair(request.pair_id)
            for name, curve in (
                ("draft_curve", request.draft_curve),
                ("verify_curve", request.verify_curve),
            ):
                if len(curve) > limits.MAX_COST_POINTS:
                    raise InvalidInput(
                        name, f"has {len(curve)} points, at most {limits.MAX_COST_POINTS}"
                    )
            curves = CostCurves(
                request.hardware,
                tuple(sorted((int(p.size), float(p.ms)) for p in request.draft_curve)),
                tuple(sorted((int(p.size), float(p.ms)) for p in request.verify_curve)),
                int(request.cudagraph_capture_limit),
            )
            held = pair.costs.get(curves.hardware)
            if held is not None and held != curves and self.access is not None:
                auth = dict(context.invocation_metadata() or ()).get("authorization")
                if not may_replace_costs(self.access, auth):
                    raise Refused(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"pair {pair.id[:40]} already has different cost curves for hardware "
                        f"{curves.hardware[:40]!r}; replacing them needs the admin token",
                    )
            self.app.set_costs(pair, curves)
            return pb.SetCostCurvesResponse()

        return await self._unary("SetCostCurves", context, run)

    async def DeletePair(
        self, request: pb.DeletePairRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeletePairResponse:
        if request.pair_id in self.app.quarantined:  # set aside at start: the admin decides
            try:
                await self.app.discard(request.pair_id)
            except Exception as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"pair {request.pair_id}: {exc}")
            return pb.DeletePairResponse(pair=pb.Pair(pair_id=request.pair_id))
        pair = await self._unary(
            "DeletePair", context, lambda: self._pair(request.pair_id, rated=False)
        )
        last = pair_pb(pair)
        try:
            await self.app.remove(pair)
        except Exception as exc:  # the store refused: the pair is gone from memory only
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"pair {pair.id}: {exc}")
        return pb.DeletePairResponse(pair=last)

    async def WatchCoefficients(
        self, request: pb.WatchCoefficientsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchCoefficientsResponse]:
        try:
            with refusals():
                pair = self._pair(request.pair_id)
        except Refused as r:
            self.on_refused("WatchCoefficients", r.reason)
            await context.abort(r.code, r.message)
        latest = self.latest.get(pair.id)
        if latest is None:
            latest = self.latest[pair.id] = Latest(coefficients_pb(pair))
        self.open_streams += 1
        try:
            msg, seen = latest.value, latest.changes
            while msg is not None:
                yield pb.WatchCoefficientsResponse(coefficients=msg)
                msg, seen = await latest.next(seen)
        finally:
            self.open_streams -= 1

    async def Observe(
        self, request_iterator: AsyncIterator[pb.ObserveRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ObserveResponse]:
        async for response in ObserveStream(self, request_iterator, context).run():
            yield response

    def _check_shape(self, pair: Pair, rows: int, k: int) -> None:
        budgets.check_shape(pair.k, rows, k, self.limits.max_rows)

    def validate_observe(self, req: pb.ObserveRequest) -> tuple[Pair, Any, Any]:
        """The pair, validated batch and strata of one Observe message (a step's
        stratum per row, a summary's stratum; None without strata), or a refusal."""
        with refusals():
            pair = self._pair(req.pair_id, rated=False)
            problem = limits.worker_id_problem(req.worker_id)
            if problem is not None:
                raise InvalidInput("worker_id", problem)
            if req.sequence < 1:
                raise InvalidInput("sequence", "must be >= 1")
            last = pair.applied.get(req.worker_id, -1)
            if req.sequence > last:
                check_sequence(req.sequence, last)
            if req.HasField("summary"):
                if len(req.strata) or len(req.stratum_index):
                    raise InvalidInput(
                        "strata", "must be empty in a summary message (summary.stratum names it)"
                    )
                return pair, summary_from_pb(req, pair), summary_stratum(req.summary)
            self._check_shape(pair, req.rows, req.k)
            x = wire.decode(req.features, req.rows, req.k)
            if len(req.num_verified) != req.rows:
                raise InvalidInput(
                    "num_verified", f"has {len(req.num_verified)} entries, rows={req.rows}"
                )
            if len(req.num_accepted) != req.rows:
                raise InvalidInput(
                    "num_accepted", f"has {len(req.num_accepted)} entries, rows={req.rows}"
                )
            batch = make_batch(
                x,
                np.asarray(req.num_verified, dtype=np.int64),
                np.asarray(req.num_accepted, dtype=np.int64),
                pair.k,
                np.asarray(req.exclude, dtype=bool) if len(req.exclude) else None,
            )
            strata = step_strata(req)
        return pair, batch, strata

    def stop_applying(self) -> None:
        """First step of a drain: no stream applies another step."""
        self.draining = True

    async def drain(self) -> None:
        """Close every stream (after the final snapshot told it what is durable)."""
        for stream in list(self.streams):
            stream.close()
        for latest in self.latest.values():
            latest.publish(None)


class Latest:
    """A pair's latest coefficients for its watchers: one value and a change count,
    no queue per watcher (a watcher that reads slowly skips to the newest)."""

    def __init__(self, value: pb.Coefficients) -> None:
        self.value: pb.Coefficients | None = value
        self.changes = 0
        self._changed = asyncio.Event()

    def publish(self, value: pb.Coefficients | None) -> None:
        """A new value (``None``: the pair is gone or the service drains)."""
        self.value = value
        self.changes += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def next(self, seen: int) -> tuple[pb.Coefficients | None, int]:
        """The value after change ``seen``: at once if it moved since, else at the next."""
        if self.changes == seen:
            await self._changed.wait()
        return self.value, self.changes
