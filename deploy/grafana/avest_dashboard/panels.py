"""Panel, target and template-variable builders, and the grid layout that places them."""

from __future__ import annotations

from typing import Any

#: Every panel, target and query variable names the datasource through the
#: ``datasource`` variable, so the dashboard works in any Grafana: the variable
#: defaults to that Grafana's default Prometheus datasource (the shipped stack's
#: provisioned one is its default), whatever its uid.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


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


def right_axis_step(regex: str) -> dict:
    """Series matching ``regex`` drawn as steps on a 0..1 right axis (a flag)."""
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [
            {"id": "custom.axisPlacement", "value": "right"},
            {"id": "custom.lineInterpolation", "value": "stepAfter"},
            {"id": "min", "value": 0},
            {"id": "max", "value": 1},
            {"id": "decimals", "value": 0},
        ],
    }


def query_variable(
    name: str,
    label: str,
    query: str,
    hide: int = 0,
    regex: str = "",
    all_value: str | None = None,
    query_type: int = 1,
) -> dict:
    """A Prometheus query variable; ``all_value`` makes it multi-valued with an
    All option (selected by default) that stands for ``all_value``.
    ``query_type``: 1 label values, 3 query result (Grafana's editor's numbering)."""
    v: dict[str, Any] = {
        "current": {},
        "datasource": DATASOURCE,
        "definition": query,
        "hide": hide,
        "includeAll": all_value is not None,
        "label": label,
        "multi": all_value is not None,
        "name": name,
        "options": [],
        "query": {
            "qryType": query_type,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": regex,
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }
    if all_value is not None:
        v["allValue"] = all_value
        v["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
    return v


def datasource_variable() -> dict:
    """The ``datasource`` variable: any Prometheus datasource, none preselected
    by uid. Its value ``default`` is Grafana's *default* option (offered when the
    default datasource is a Prometheus one): Grafana starts on its default
    datasource, else on the first Prometheus datasource by name."""
    return {
        "current": {"selected": True, "text": "default", "value": "default"},
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


def textbox_variable(name: str, label: str, default: str, description: str) -> dict:
    return {
        "current": {"selected": False, "text": default, "value": default},
        "description": description,
        "hide": 0,
        "label": label,
        "name": name,
        "options": [{"selected": True, "text": default, "value": default}],
        "query": default,
        "skipUrlSync": False,
        "type": "textbox",
    }


#: Hides a series whose values are all zero (legend, tooltip and graph): for
#: panels of many rarely non-zero series (refusals, failures by method and code).
HIDE_WHEN_ZERO = {
    "matcher": {"id": "byValue", "options": {"reducer": "allIsZero", "op": "gte", "value": 0}},
    "properties": [
        {"id": "custom.hideFrom", "value": {"legend": True, "tooltip": True, "viz": True}}
    ],
}


def text(lay: Layout, title: str, description: str, content: str, w: int, h: int) -> dict:
    """A markdown panel (Grafana interpolates variables in its content)."""
    return {
        "description": description,
        "gridPos": lay.place(w, h),
        "id": lay.id(),
        "options": {"mode": "markdown", "content": content},
        "title": title,
        "type": "text",
    }
