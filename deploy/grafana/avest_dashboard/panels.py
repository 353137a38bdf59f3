"""Panel, target and template-variable builders, and the grid layout that places them."""

from __future__ import annotations

from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "avest-prometheus"}


class Layout:
    """Places panels left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def new_row(self) -> dict[str, int]:
        self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": 1, "w": 24, "x": 0, "y": self.y}
        self.y += 1
        return pos

    def id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def target(expr: str, legend: str = "__auto", ref: str = "A", instant: bool = False) -> dict:
    t: dict[str, Any] = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
    }
    if instant:
        t.update({"instant": True, "range": False, "format": "table"})
    else:
        t.update({"instant": False, "range": True})
    return t


def refs(*targets: tuple[str, str]) -> list[dict]:
    return [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)]


def timeseries(
    lay: Layout,
    title: str,
    description: str,
    targets: list[dict],
    unit: str = "short",
    w: int = 12,
    h: int = 8,
    minimum: float | None = None,
    maximum: float | None = None,
    threshold: float | None = None,
    overrides: list[dict] | None = None,
    decimals: int | None = None,
) -> dict:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": True,
        },
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if decimals is not None:
        defaults["decimals"] = decimals
    if threshold is not None:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "green", "value": None}, {"color": "red", "value": threshold}],
        }
        defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
    return {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "gridPos": lay.place(w, h),
        "id": lay.id(),
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": targets,
        "title": title,
        "type": "timeseries",
    }


def stat(
    lay: Layout,
    title: str,
    description: str,
    expr: str,
    unit: str = "short",
    w: int = 4,
    mappings: list[dict] | None = None,
    thresholds: list[dict] | None = None,
) -> dict:
    return {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "mappings": mappings or [],
                "thresholds": {
                    "mode": "absolute",
                    "steps": thresholds or [{"color": "blue", "value": None}],
                },
            },
            "overrides": [],
        },
        "gridPos": lay.place(w, 4),
        "id": lay.id(),
        "options": {
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
        "targets": [target(expr, "__auto")],
        "title": title,
        "type": "stat",
    }


def row(lay: Layout, title: str) -> dict:
    return {
        "collapsed": False,
        "gridPos": lay.new_row(),
        "id": lay.id(),
        "panels": [],
        "title": title,
        "type": "row",
    }


def dashed(regex: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "custom.lineWidth", "value": 2},
        ],
    }


def query_variable(name: str, label: str, query: str, hide: int = 0) -> dict:
    return {
        "current": {},
        "datasource": DATASOURCE,
        "definition": query,
        "hide": hide,
        "includeAll": False,
        "label": label,
        "multi": False,
        "name": name,
        "options": [],
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }
