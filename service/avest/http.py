"""Admin HTTP API (FastAPI). Placeholder: health and metrics only."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Response


def build_http(app: Any, metrics: Any, settings: Any) -> FastAPI:
    api = FastAPI(title="avest admin")

    @api.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/readyz")
    def readyz(response: Response) -> dict[str, str]:
        if not app.ready:
            response.status_code = 503
            return {"status": "not ready"}
        return {"status": "ready"}

    @api.get("/metrics")
    def metrics_endpoint() -> Response:
        body, ctype = metrics.exposition()
        return Response(body, media_type=ctype)

    return api
