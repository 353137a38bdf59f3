"""Admin routes that record a pair's raw stream into an ``avest-trace/1`` file.

==============================================  =======================================
``POST /v1/pairs/{id}/recording``               start (or restart) recording: ``fraction``
                                                of the raw steps, up to ``steps`` (admin)
``GET /v1/pairs/{id}/recording``                its progress
``GET /v1/pairs/{id}/recording.npz``            what it holds, as an ``avest-trace/1`` file
``DELETE /v1/pairs/{id}/recording``             stop and forget it (admin)
==============================================  =======================================

Access (tokens) is the admin API's middleware: POST and DELETE need the admin token.
"""

from __future__ import annotations

import io
import json
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, HTTPException, Query, Response

from avest.state.pairs import Pair
from avest.state.recording import MAX_STEPS, Recording


def trace_bytes(pair: Pair, recording: Recording) -> bytes:
    """The recording as an ``avest-trace/1`` archive (validated by the trace module)."""
    from avest.offline.trace import FORMAT, Trace

    labels = dict(pair.key.labels)

    def number(name: str) -> float:
        try:
            return float(labels.get(name, "1.0"))
        except ValueError:
            return 1.0

    meta = {
        "format": FORMAT,
        "target": pair.key.target,
        "draft": pair.key.draft,
        "method": pair.key.method,
        "num_speculative_tokens": pair.k,
        "temperature": number("temperature"),
        "top_p": number("top_p"),
        "labels": labels,
        "recorded_from": pair.id,
        "fraction": recording.fraction,
        "note": "request ids are per row (the wire carries none); temperature and top_p "
        "from the pair's labels when present, else 1.0",
    }
    a = recording.arrays()
    if a["features"].shape[1] != pair.k:
        a["features"] = np.zeros((0, pair.k), np.float32)
    trace = Trace(meta=meta, **a).validate()
    arrays = trace.arrays()
    arrays["meta"] = np.array(json.dumps(meta))
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return buf.getvalue()


def add_recording_routes(api: FastAPI, app: Any, settings: Any, get_pair: Any) -> None:
    not_found: dict[int | str, dict[str, Any]] = {404: {"description": "No pair with that id"}}

    @api.post("/v1/pairs/{pair_id}/recording", tags=["recording"], responses=not_found)
    async def start_recording(
        pair_id: str,
        fraction: Annotated[float, Query(gt=0.0, le=1.0, description="Share of raw steps")] = 1.0,
        steps: Annotated[int, Query(ge=1, le=MAX_STEPS, description="Steps to keep")] = 1000,
    ) -> dict[str, Any]:
        """Record the pair's incoming raw steps (a sampled fraction), up to ``steps``."""
        pair = get_pair(pair_id)
        rec = Recording(fraction, steps)
        app.recordings[pair.id] = rec
        return {"id": pair.id, **rec.status()}

    @api.get("/v1/pairs/{pair_id}/recording", tags=["recording"], responses=not_found)
    async def recording_status(pair_id: str) -> dict[str, Any]:
        """Progress of the pair's recording."""
        pair = get_pair(pair_id)
        rec = app.recordings.get(pair.id)
        if rec is None:
            raise HTTPException(404, detail=f"pair {pair.id} has no recording")
        return {"id": pair.id, **rec.status()}

    @api.get(
        "/v1/pairs/{pair_id}/recording.npz",
        tags=["recording"],
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}}, **not_found},
    )
    async def recording_file(pair_id: str) -> Response:
        """What the recording holds, as an ``avest-trace/1`` (.npz) file."""
        pair = get_pair(pair_id)
        rec = app.recordings.get(pair.id)
        if rec is None:
            raise HTTPException(404, detail=f"pair {pair.id} has no recording")
        return Response(trace_bytes(pair, rec), media_type="application/octet-stream")

    @api.delete("/v1/pairs/{pair_id}/recording", tags=["recording"], responses=not_found)
    async def stop_recording(pair_id: str) -> dict[str, Any]:
        """Stop the pair's recording and forget what it held."""
        pair = get_pair(pair_id)
        rec = app.recordings.pop(pair.id, None)
        return {"id": pair.id, "stopped": rec is not None}
