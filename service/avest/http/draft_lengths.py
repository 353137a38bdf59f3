"""``GET /v1/pairs/{id}/draft-lengths`` and ``GET /v1/pairs/{id}/schedule``.

``schedule`` is the pair's draft length by batch size (:mod:`avest.state.schedules`),
ready for vLLM's ``speculative_config.num_speculative_tokens_per_batch_size``, the
same as gRPC's ``GetSchedule``. ``draft-lengths`` is the recommended
``num_speculative_tokens`` per concurrency:

Per concurrency, from the pair's stored cost curves (one hardware label) and
its current estimates: the recent mean predicted acceptance per position
(the estimator's own conditional acceptance at each depth). The closed form
is :func:`avest.core.draft_length.best_lengths`: fixed lengths ``0..K``
without trimming (``0`` is speculation off). The pair's draft curve is what
vLLM profiled, the cost of a whole proposal of ``K`` drafts; an
autoregressive drafter pays ``1/K`` of it per position, a parallel one (DSpark,
DFlash) all of it for any length.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from avest.core.draft_length import best_lengths, rates_from_predictions
from avest.state.errors import Conflict
from avest.state.schedules import drafter_of

DEFAULT_CONCURRENCY = "1,8,16,32,64,128,256"


class LengthAtConcurrencyOut(BaseModel):
    concurrency: int = Field(description="Requests per decode step")
    num_speculative_tokens: int = Field(description="Best fixed length; 0 = speculation off")
    throughput: list[float] = Field(description="Expected tokens/s for lengths 0..K")
    gain_over_off: float = Field(description="Best length against speculation off, minus 1")


class DraftLengthsOut(BaseModel):
    id: str
    hardware: str = Field(description="Label of the cost curves used")
    drafter: str = Field(description="autoregressive (cost per position) or parallel")
    k: int
    rates: list[float] = Field(
        description="Acceptance per position given the earlier ones accepted (recent mean "
        "predicted; 0 for a position never verified)"
    )
    concurrency: list[LengthAtConcurrencyOut]


class ScheduleRangeOut(BaseModel):
    range_start: int = Field(description="First batch size (requests per step), inclusive")
    range_end: int = Field(
        description="Last batch size, inclusive; the last range also governs larger ones"
    )
    num_speculative_tokens: int = Field(description="Drafts per request; 0 = speculation off")
    adaptive_verification: bool = Field(description="Whether AV is expected to pay off here")
    expected_goodput: float = Field(description="Expected tokens/s of this choice at range_start")
    best_fixed_goodput: float = Field(
        description="Expected tokens/s at range_start of the best fixed length (AV off)"
    )


class ScheduleOut(BaseModel):
    id: str
    hardware: str = Field(description="Label of the cost curves used")
    coefficients_version: int
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] = Field(
        description="vLLM's speculative_config entry: [range_start, range_end, length]"
    )
    ranges: list[ScheduleRangeOut]
    features: str = Field(
        description="Whose features the schedule read: 'reached' (every draft that reached "
        "each position, verified or trimmed) or 'labelled' (the recent calibration's verified "
        "drafts, while workers send no reached counts: under adaptive verification it leans "
        "toward confident drafts)"
    )


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HTTPException(
            422, detail=f"concurrency must be integers like 8,16, got {text!r}"
        ) from None
    if not values or min(values) < 1 or max(values) > 65536:
        raise HTTPException(422, detail=f"concurrency must be integers in [1, 65536], got {text!r}")
    return values


def draft_length_router(app: Any) -> APIRouter:
    """The route over ``app`` (an :class:`avest.state.app.Avest`)."""
    router = APIRouter()

    @router.get(
        "/v1/pairs/{pair_id}/draft-lengths",
        response_model=DraftLengthsOut,
        tags=["pairs"],
        responses={404: {"description": "No such pair, or no cost curves for the hardware"}},
    )
    async def draft_lengths(
        pair_id: str,
        hardware: Annotated[
            str | None, Query(description="Cost-curve label; optional when the pair has one")
        ] = None,
        concurrency: Annotated[
            str, Query(description="Comma-separated requests per step")
        ] = DEFAULT_CONCURRENCY,
        drafter: Annotated[
            str | None,
            Query(description="autoregressive or parallel; default from the pair's method"),
        ] = None,
    ) -> DraftLengthsOut:
        """Recommended num_speculative_tokens per concurrency (fixed lengths, no trimming)."""
        pair = app.registry.get(pair_id)  # NotFound names the id (404)
        cs = _concurrencies(concurrency)
        if drafter not in (None, "autoregressive", "parallel"):
            raise HTTPException(
                422, detail=f"drafter must be autoregressive or parallel, got {drafter!r}"
            )
        if hardware is None:
            if len(pair.costs) != 1:
                known = ", ".join(sorted(pair.costs)) or "none"
                raise HTTPException(
                    404 if not pair.costs else 422,
                    detail=f"pair {pair.id}: name one hardware label (known: {known})",
                )
            hardware = next(iter(pair.costs))
        table = pair.cost_table(hardware)  # NotFound (404) names the known labels
        kind = drafter or drafter_of(pair)
        summary = pair.estimator.recent_calibration.summary()
        rates = rates_from_predictions([p.mean_predicted for p in summary.by_position])
        choices = best_lengths(rates, table, cs, per_position=kind == "autoregressive")
        return DraftLengthsOut(
            id=pair.id,
            hardware=hardware,
            drafter=kind,
            k=pair.k,
            rates=[float(r) for r in rates],
            concurrency=[
                LengthAtConcurrencyOut(
                    concurrency=ch.concurrency,
                    num_speculative_tokens=ch.length,
                    throughput=list(ch.throughput),
                    gain_over_off=ch.gain_over_off,
                )
                for ch in choices
            ],
        )

    @router.get(
        "/v1/pairs/{pair_id}/schedule",
        response_model=ScheduleOut,
        tags=["pairs"],
        responses={
            404: {"description": "No such pair, or no cost curves for the hardware"},
            409: {"description": "Too little evidence yet (the detail says how much)"},
        },
    )
    async def schedule(
        pair_id: str,
        hardware: Annotated[
            str | None, Query(description="Cost-curve label; optional when the pair has one")
        ] = None,
    ) -> ScheduleOut:
        """The pair's draft length by batch size on one hardware label."""
        pair = app.registry.get(pair_id)  # NotFound names the id (404)
        try:
            served = await app.schedules.get(pair, hardware)
        except Conflict as exc:
            raise HTTPException(409, detail=str(exc)) from None
        return ScheduleOut(
            id=served.pair_id,
            hardware=served.hardware,
            coefficients_version=served.version,
            num_speculative_tokens_per_batch_size=served.schedule.to_vllm(),
            ranges=[ScheduleRangeOut(**r.fields()) for r in served.ranges()],
            features=served.features,
        )

    return router
