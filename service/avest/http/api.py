"""Admin HTTP API (FastAPI), served by uvicorn on a thread of its own (:mod:`avest.http.bridge`).

Every handler is ``async def`` and runs on the service's event loop thread, the
thread that owns the registry, to which the bridge hands each request (a plain
``def`` would run in a worker thread and read the state while the loop mutates
it); each one is cheap and does no blocking I/O.

==========================================  ==========================================
``GET /healthz``                            liveness: 200 while the event loop turns (and
                                            the version), 503 once it has not turned for
                                            10 s; answered on the HTTP thread
                                            (:mod:`avest.http.bridge`)
``GET /readyz``                             200 once started (naming the pairs set
                                            aside); 503 before, while draining, while
                                            store writes fail, and when no stored pair
                                            can be served (with the reason)
``GET /metrics``                            Prometheus text exposition
``GET /v1/pairs``                           the pairs, a page at a time (see ``PairsOut``)
``GET /v1/pairs/{id}``                      one pair: key, rule, coefficients, calibration
                                            (all-time and recent)
``GET /v1/pairs/{id}/history``              coefficient history (newest last, at most 256)
``GET /v1/pairs/{id}/reliability``          reliability-diagram data (JSON)
``GET /v1/pairs/{id}/workers``              workers seen: mode, last summary, version, drafts,
                                            standing (ok or quarantined) and score
``POST /v1/pairs/{id}/workers/{w}/release`` return a quarantined worker to the fit (admin
                                            token)
``GET /v1/pairs/{id}/reliability.svg``      the reliability diagram and per-position plot
``POST /v1/pairs/{id}/reset``               forget what the pair learned (admin token)
``DELETE /v1/pairs/{id}``                   delete the pair, its stored rows and metric
                                            series (admin token)
``/v1/pairs/{id}/recording[.npz]``          record raw steps (:mod:`avest.http.recording`)
``GET /docs``, ``GET /openapi.json``        the API reference (self-contained HTML), OpenAPI
==========================================  ==========================================

Access (:mod:`avest.policy.access`): ``/healthz``, ``/readyz`` and ``/metrics``
are open (probes and Prometheus; a token sent there is ignored); every other
``GET`` needs the worker or admin token when a worker token is configured;
everything else needs the admin token (401 without a token or with an unknown
one, 403 with the worker token or when no admin token is configured).

Floats that are undefined (NaN: AUC with one class, anything with no drafts)
are ``null`` in JSON. An unknown pair is a 404 whose ``detail`` names the id.
The response models are in :mod:`avest.http.models`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from avest import __version__
from avest.core.metrics import CalibrationState
from avest.http.docs import docs_page
from avest.http.models import (
    ErrorOut,
    HistoryEntryOut,
    HistoryOut,
    PairOut,
    PairsOut,
    ReliabilityBinOut,
    ReliabilityOut,
    Status,
    StrataOut,
    StratumOut,
    WorkerOut,
    WorkersOut,
    calibration_out,
    finite,
    pair_out,
)
from avest.http.recording import add_recording_routes
from avest.metrics.registry import accepts_gzip
from avest.policy.access import Access, http_role
from avest.state import listing
from avest.state.errors import NotFound
from avest.state.pairs import Pair
from avest_wire import limits
from avest_wire.errors import InvalidInput

#: Module level: the handlers' annotations are strings resolved in this module.
_BEARER = HTTPBearer(
    auto_error=False,
    description="AVEST_ADMIN_TOKEN for changes; AVEST_WORKER_TOKEN (or the admin token) to read",
)

_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorOut, "description": "No pair with that id"}
}
#: Replicas: a worker table is the pair's refitter's alone.
_NOT_REFITTED_HERE = {
    "model": ErrorOut,
    "description": "On replicas: this replica does not refit the pair (the message names the "
    "one that does)",
}
#: The query parameters bounding the history and the workers table.
_HistoryLimit = Annotated[int, Query(ge=1, le=256, description="At most this many, newest last")]
_WorkersLimit = Annotated[
    int, Query(ge=1, le=4096, description="At most this many; the rest fold into 'other'")
]
#: Pairs in a page of ``GET /v1/pairs`` when the request names no page size: a
#: K = 64 pair is about 15 KB of JSON, so a page stays under a megabyte.
PAGE_SIZE = 50
#: The most a request may ask for (a larger page_size is lowered to it): about 3 MB
#: at K = 64, built on the event loop that the RPCs share.
MAX_PAGE_SIZE = 200
_PageSize = Annotated[
    int, Query(ge=0, description=f"At most this many (0: {PAGE_SIZE}; at most {MAX_PAGE_SIZE})")
]
_PageToken = Annotated[
    str,
    Query(
        description="next_page_token of the previous page; empty for the first",
        pattern=f"^({listing.TOKEN_PATTERN})?$",
    ),
]
#: The position whose reliability to show (all pooled when absent), as data and as a diagram.
_Position = Annotated[int | None, Query(description="One position; all positions pooled if absent")]
_DiagramPosition = Annotated[
    int | None, Query(description="Reliability of one position; all pooled if absent")
]
#: What a change answers before it runs: it needs the admin token.
_ADMIN_ONLY: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "No token, or an unknown one"},
    403: {"model": ErrorOut, "description": "Not the admin token, or none configured"},
}


# -- the app ---------------------------------------------------------------------


def build_http(app: Any, metrics: Any, settings: Any, access: Access | None = None) -> FastAPI:
    """The admin API over ``app`` (an :class:`avest.state.app.Avest`)."""
    if access is None:
        access = Access(getattr(settings, "worker_token", ""), getattr(settings, "admin_token", ""))
    api = FastAPI(
        title="avest admin",
        version=__version__,
        description="Admin API of the avest acceptance-estimator sidecar: pairs, "
        "coefficients, calibration, reliability diagrams, Prometheus metrics.",
        # FastAPI's pages load Swagger UI / ReDoc from a CDN (blank offline): /docs
        # is served from avest.http.docs instead, self-contained.
        docs_url=None,
        redoc_url=None,
    )

    @api.middleware("http")
    async def check_access(request: Request, call_next: Any) -> Response:
        denied = access.check(
            http_role(request.method, request.url.path), request.headers.get("authorization")
        )
        if denied is None:
            response: Response = await call_next(request)
            return response
        if denied.unauthenticated:
            return JSONResponse(
                {"detail": denied.message},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return JSONResponse({"detail": denied.message}, status_code=403)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        response = await http_exception_handler(request, exc)
        if exc.status_code == 405:
            # Each route answers for its own methods: list every method the path has.
            allowed: set[str] = set()
            for route in api.router.routes:
                methods = getattr(route, "methods", None)
                if methods and route.matches(request.scope)[0] != Match.NONE:
                    allowed |= set(methods)
            if allowed:
                response.headers["Allow"] = ", ".join(sorted(allowed))
        return response

    @api.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc.args[0])}, status_code=404)

    def get_pair(pair_id: str) -> Pair:
        pair: Pair = app.registry.get(pair_id)  # NotFound names the id
        return pair

    def refitted_pair(pair_id: str) -> Pair:
        """The pair, when its worker table is here: on replicas, the refitter's alone."""
        pair = get_pair(pair_id)
        replication = app.replication
        if replication is not None and not replication.leads(pair):
            raise HTTPException(
                409,
                detail=f"pair {pair.id} is refitted by replica "
                f"{replication.refitter(pair) or '(none yet)'}, which judges its workers: "
                "ask that replica (its name is the pair's refitter in GET /v1/pairs/{id})",
            )
        return pair

    def pair_view(path: str, model: Any, tag: str = "pairs", **responses: Any) -> Any:
        """``GET /v1/pairs/{pair_id}<path>`` answering ``model``, or 404 for an unknown id
        (``responses``: more status codes it may answer, by code as text)."""
        more = {int(code[1:]): r for code, r in responses.items()}
        return api.get(
            "/v1/pairs/{pair_id}" + path,
            response_model=model,
            tags=[tag],
            responses={**_NOT_FOUND, **more},
        )

    @api.get("/", include_in_schema=False)
    async def index() -> RedirectResponse:
        return RedirectResponse("/docs")

    @api.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(api.openapi(), api.openapi_url or "/openapi.json"))

    @api.get("/healthz", response_model=Status, response_model_exclude_none=True, tags=["health"])
    async def healthz() -> Status:
        """Liveness: the service's event loop turns; the release serving. In the service
        the HTTP thread answers it from the loop's heartbeat (:mod:`avest.http.bridge`),
        503 once the loop has not turned for 10 s; this route documents it."""
        return Status(status="ok", version=__version__)

    @api.get(
        "/readyz",
        response_model=Status,
        response_model_exclude_none=True,
        tags=["health"],
        responses={
            503: {
                "model": Status,
                "description": "Starting, draining, store writes failing, or none of the "
                "stored pairs can be served (all set aside)",
            }
        },
    )
    async def readyz(response: Response) -> Status:
        """Readiness: 200 once the state is restored; 503 before that, while draining,
        while store writes fail (no step is acknowledged then; an I/O error reads
        "store I/O error: ..."), and while none of the stored pairs can be served
        (every one set aside), with the reason. The pairs set aside (quarantined at
        start, or unreadable) are listed by id with why (the others serve)."""
        quarantined = dict(getattr(app, "quarantined", {})) or None
        if getattr(app, "draining", False):
            response.status_code = 503
            return Status(status="draining")
        if not app.ready:
            response.status_code = 503
            return Status(status="starting" if not getattr(app, "_closed", False) else "stopped")
        store_error = getattr(app, "store_error", "")
        if store_error:
            response.status_code = 503
            return Status(status="store-error", reason=store_error, quarantined=quarantined)
        if quarantined and not app.registry.pairs:
            response.status_code = 503
            return Status(
                status="quarantined",
                reason=f"none of the {len(quarantined)} stored pair(s) can be served: every "
                "one is set aside (see quarantined); an admin deletes a pair to begin it afresh",
                quarantined=quarantined,
            )
        return Status(status="ready", quarantined=quarantined)

    @api.get(
        "/metrics",
        tags=["health"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}},
    )
    async def metrics_endpoint(request: Request) -> Response:
        """Prometheus metrics (text exposition format), rendered and gzipped (when
        accepted) off the event loop."""
        gzip = accepts_gzip(request.headers.get("accept-encoding", ""))
        body, ctype = await metrics.exposition_async(gzip=gzip)
        headers = {"Cache-Control": "no-store", "Vary": "Accept-Encoding"}
        if gzip:
            headers["Content-Encoding"] = "gzip"
        return Response(body, media_type=ctype, headers=headers)

    @api.get(
        "/v1/pairs",
        response_model=PairsOut,
        tags=["pairs"],
        responses={400: {"model": ErrorOut, "description": "A malformed page_token"}},
    )
    async def list_pairs(page_size: _PageSize = 0, page_token: _PageToken = "") -> PairsOut:
        """The registered pairs, one page at a time in id order: follow
        ``next_page_token`` (as ``page_token``) until it is empty."""
        size = min(page_size or PAGE_SIZE, MAX_PAGE_SIZE)
        try:
            pairs, token = listing.page(app.registry.pairs, size, page_token)
        except InvalidInput as exc:
            raise HTTPException(400, detail=str(exc)) from None
        return PairsOut(pairs=[pair_out(p, metrics) for p in pairs], next_page_token=token)

    @pair_view("", PairOut)
    async def get_pair_endpoint(pair_id: str) -> PairOut:
        """One pair: key, rule, coefficients in force, counters and calibration."""
        return pair_out(get_pair(pair_id), metrics)

    @pair_view("/history", HistoryOut)
    async def history(pair_id: str, limit: _HistoryLimit = 256) -> HistoryOut:
        """Coefficient history: registration, each refit, resets (newest last)."""
        pair = get_pair(pair_id)
        return HistoryOut(
            id=pair.id,
            history=[
                HistoryEntryOut.model_validate(h, from_attributes=True)
                for h in pair.history[-limit:]
            ],
        )

    @pair_view("/strata", StrataOut)
    async def strata(pair_id: str) -> StrataOut:
        """The pair's strata (kinds of request, docs/strata.md): each one's served
        coefficients beside the pair's, and the requests past the bound on strata."""
        pair = get_pair(pair_id)
        own = pair.stratified()
        return StrataOut(
            id=pair.id,
            strata=[
                StratumOut(
                    stratum=name,
                    slope=s.coefficients.slope,
                    intercepts=list(s.coefficients.intercepts),
                    rounds=s.rounds,
                    drafts=s.drafts,
                    idle=s.idle,
                    calibration=calibration_out(
                        (s.calibration or CalibrationState.empty(pair.k)).summary()
                    ),
                )
                for name, s in sorted(own.strata.items())
            ],
            max_strata=own.config.max_strata,
            fallback_rows=own.fallback_rows,
            fallback_drafts=own.fallback_drafts,
            retired=own.retired,
        )

    @pair_view("/workers", WorkersOut, _409=_NOT_REFITTED_HERE)
    async def workers(pair_id: str, limit: _WorkersLimit = 100) -> WorkersOut:
        """The workers seen sending to the pair: mode, last summary, version, drafts,
        standing and score (:mod:`avest.core.quarantine`). On replicas, the pair's
        refitter answers (409 elsewhere, naming it)."""
        pair = refitted_pair(pair_id)
        return WorkersOut(
            id=pair.id,
            workers=[WorkerOut(**w.as_dict()) for w in pair.workers.top(limit)],
            quarantined=pair.workers.quarantined,
            quarantined_steps=pair.workers.quarantined_steps,
            tracked=len(pair.workers),
            forgotten=pair.workers.forgotten,
        )

    @api.post(
        "/v1/pairs/{pair_id}/workers/{worker_id:path}/release",
        response_model=WorkerOut,
        tags=["pairs"],
        responses={
            **_ADMIN_ONLY,
            400: {"description": "A malformed request (refused before the route runs)"},
            404: {"model": ErrorOut, "description": "No such pair, or no such worker in it"},
            409: {
                "model": ErrorOut,
                "description": "The worker is not quarantined; or, on replicas, this replica "
                "does not refit the pair (the message names the one that does)",
            },
        },
    )
    async def release_worker(
        pair_id: str,
        worker_id: str,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> WorkerOut:
        """Return a quarantined worker to the fit: its data is folded again from its
        next message, and its score starts afresh (a worker that keeps sending data
        the others contradict is quarantined again). Needs ``Authorization: Bearer
        <admin token>`` (refused when the service has none)."""
        pair = refitted_pair(pair_id)
        try:
            row = app.release(pair, worker_id)
        except KeyError:
            raise HTTPException(
                404, detail=f"pair {pair.id} has no worker {limits.echo(worker_id)}"
            ) from None
        except ValueError:
            raise HTTPException(
                409, detail=f"worker {limits.echo(worker_id)} of pair {pair.id} is not quarantined"
            ) from None
        return WorkerOut(**row.as_dict())

    def _reliability(pair: Pair, position: int | None) -> Any:
        if position is not None and not 0 <= position < pair.k:
            raise HTTPException(
                422, detail=f"position must lie in [0, {pair.k}) for pair {pair.id}, got {position}"
            )
        return pair.estimator.calibration.reliability(position)

    @pair_view("/reliability", ReliabilityOut, "calibration")
    async def reliability(pair_id: str, position: _Position = None) -> ReliabilityOut:
        """Reliability-diagram data: per probability bin, drafts, mean predicted, observed."""
        pair = get_pair(pair_id)
        rel = _reliability(pair, position)
        return ReliabilityOut(
            id=pair.id,
            position=position,
            bins=[
                ReliabilityBinOut(
                    bin=i,
                    lower=float(rel.edges[i]),
                    upper=float(rel.edges[i + 1]),
                    count=float(rel.count[i]),
                    mean_predicted=finite(rel.mean_predicted[i]),
                    observed=finite(rel.observed[i]),
                )
                for i in range(len(rel.count))
            ],
        )

    @api.get(
        "/v1/pairs/{pair_id}/reliability.svg",
        tags=["calibration"],
        response_class=Response,
        responses={
            200: {"content": {"image/svg+xml": {}}, "description": "SVG document"},
            **_NOT_FOUND,
        },
    )
    async def reliability_svg(pair_id: str, position: _DiagramPosition = None) -> Response:
        """Reliability diagram (predicted vs observed per bin, with counts) beside
        predicted vs observed acceptance per draft position."""
        pair = get_pair(pair_id)
        rel = _reliability(pair, position)
        s = metrics.summary(pair)
        est = pair.estimator
        key = pair.key
        labels = ", ".join(f"{k}={v}" for k, v in key.labels.items())
        title = f"{key.target} \u2190 {key.draft}" + (f" [{labels}]" if labels else "")
        subtitle = (
            f"pair {pair.id}  method {key.method or '-'}  K={key.k}  rule {pair.rule_name}  "
            f"version {est.version}  round {est.round}  drafts {est.drafts}  "
            f"AUC {_fmt(s.auc)}  log loss {_fmt(s.logloss)}"
            + (f"  (reliability of position {position})" if position is not None else "")
        )
        ece = s.ece if position is None else s.by_position[position].ece
        from avest.offline.reliability import render

        # The pair is read here, on the loop; drawing (and the first import of
        # matplotlib) runs on a worker thread, so it never holds the event loop
        # that also serves gRPC.
        svg = await run_in_threadpool(
            render, rel, s.by_position, title=title, subtitle=subtitle, ece=ece
        )
        return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-store"})

    @api.post(
        "/v1/pairs/{pair_id}/reset",
        response_model=PairOut,
        tags=["pairs"],
        responses={**_ADMIN_ONLY, **_NOT_FOUND},
    )
    async def reset(
        pair_id: str,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> PairOut:
        """Forget what the pair learned: cold-start coefficients, round 0, empty
        counters, calibration and history; the version moves forward by one. Needs
        ``Authorization: Bearer <admin token>`` (refused when the service has none)."""
        pair = get_pair(pair_id)
        app.reset(pair)
        return pair_out(pair, metrics)

    @api.delete(
        "/v1/pairs/{pair_id}",
        response_model=PairOut,
        tags=["pairs"],
        responses={
            **_ADMIN_ONLY,
            503: {"model": ErrorOut, "description": "The store refused; nothing changed"},
            **_NOT_FOUND,
        },
    )
    async def delete_pair(
        pair_id: str,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> PairOut:
        """Delete the pair: its state, stored rows, cost curves and metric series; its
        watchers' streams end. Returns the pair as it was. Registering the same key
        again starts a new pair from the cold start. Needs ``Authorization: Bearer
        <admin token>`` (refused when the service has none). A pair set aside at
        start (see ``/readyz``) is deleted from the store too; the answer then names
        it and why it was set aside."""
        if pair_id in app.quarantined:
            try:
                why = await app.discard(pair_id)
            except Exception as exc:
                raise HTTPException(503, detail=f"pair {pair_id} not deleted: {exc}") from None
            return JSONResponse({"pair_id": pair_id, "set_aside": why, "deleted": True})
        pair = get_pair(pair_id)
        last = pair_out(pair, metrics)
        try:
            await app.remove(pair)
        except Exception as exc:
            raise HTTPException(503, detail=f"pair {pair.id} not deleted: {exc}") from None
        return last

    add_recording_routes(api, app, settings, get_pair)
    from avest.http.draft_lengths import draft_length_router

    api.include_router(draft_length_router(app))  # GET /v1/pairs/{id}/draft-lengths
    return api


def _fmt(v: float) -> str:
    return f"{v:.3f}" if math.isfinite(v) else "n/a"
