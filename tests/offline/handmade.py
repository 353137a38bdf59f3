"""Trace metadata and cost profiles written by hand, for the simulator's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from avest.offline.trace import FORMAT


def hand_meta(k: int) -> dict[str, Any]:
    """The metadata of a hand-made trace drafting ``k`` positions, sampled at
    temperature 1 and top-p 1."""
    return {
        "format": FORMAT,
        "target": "t",
        "draft": "d",
        "method": "hand",
        "num_speculative_tokens": k,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def write_profile(
    path: Path, name: str, draft_curve: list, verify_curve: list, **more: Any
) -> Path:
    """An ``avest-costs/1`` profile file: the draft and verify curves as ``[size, ms]``
    points, and any further fields (``cudagraph_limit``)."""
    profile = {"format": "avest-costs/1", "name": name}
    profile |= {"draft_curve": draft_curve, "verify_curve": verify_curve, **more}
    path.write_text(json.dumps(profile))
    return path
