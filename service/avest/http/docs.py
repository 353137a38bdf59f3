"""``GET /docs``: the admin API's reference as one self-contained HTML page.

FastAPI's own ``/docs`` (Swagger UI) and ``/redoc`` load their scripts and
styles from a CDN, so on a host without internet access (a sidecar's usual
place) they render blank. No package of the service's environment ships the
Swagger UI assets, so this page is rendered on the server from the OpenAPI
schema instead: every operation with its parameters, request body and
responses, no script and nothing fetched from elsewhere. The schema itself
stays at ``/openapi.json`` for tools.
"""

from __future__ import annotations

import html
from typing import Any

_METHODS = ("get", "post", "put", "patch", "delete")

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; color: #222; }
h1 { margin-bottom: 0.2rem; } h2 { margin-top: 2rem; border-bottom: 1px solid #ddd; }
.op { border: 1px solid #ddd; border-radius: 6px; margin: 0.8rem 0; padding: 0.6rem 0.9rem; }
.method { display: inline-block; min-width: 4.5rem; font-weight: bold; text-transform: uppercase; }
.get { color: #1b6ac9; } .post { color: #2e8540; } .delete { color: #c62828; }
.put, .patch { color: #b26a00; }
code { background: #f4f4f4; padding: 0 0.2rem; } table { border-collapse: collapse; }
td, th { text-align: left; padding: 0.15rem 0.8rem 0.15rem 0; vertical-align: top; }
.muted { color: #666; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    return str(schema.get("type", "object"))


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    out = [
        '<div class="op">',
        f'<span class="method {method}">{method}</span> <code>{_e(path)}</code>',
        f" <span class='muted'>{_e(op.get('summary', ''))}</span>",
    ]
    if op.get("description"):
        out.append(f"<p>{_e(op['description'])}</p>")
    params = op.get("parameters", [])
    if params:
        out.append("<table><tr><th>parameter</th><th>in</th><th>type</th><th></th></tr>")
        for p in params:
            required = "required" if p.get("required") else ""
            out.append(
                f"<tr><td><code>{_e(p.get('name'))}</code></td><td>{_e(p.get('in'))}</td>"
                f"<td>{_e(_schema_name(p.get('schema', {})))}</td><td>{required}</td></tr>"
            )
        out.append("</table>")
    body = op.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        out.append(f"<p>body: {_e(media)} {_e(_schema_name(content.get('schema', {})))}</p>")
    responses = op.get("responses", {})
    if responses:
        out.append("<table><tr><th>response</th><th></th><th>schema</th></tr>")
        for code, resp in responses.items():
            schemas = [_schema_name(c.get("schema", {})) for c in resp.get("content", {}).values()]
            out.append(
                f"<tr><td>{_e(code)}</td><td>{_e(resp.get('description', ''))}</td>"
                f"<td>{_e(', '.join(schemas))}</td></tr>"
            )
        out.append("</table>")
    out.append("</div>")
    return "".join(out)


def _model(name: str, schema: dict[str, Any]) -> str:
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    rows = "".join(
        f"<tr><td><code>{_e(k)}</code></td><td>{_e(_schema_name(v))}</td>"
        f"<td>{'required' if k in required else ''}</td>"
        f"<td class='muted'>{_e(v.get('description', ''))}</td></tr>"
        for k, v in props.items()
    )
    doc = f"<p class='muted'>{_e(schema['description'])}</p>" if "description" in schema else ""
    return f"<h3 id='{_e(name)}'>{_e(name)}</h3>{doc}<table>{rows}</table>"


def docs_page(spec: dict[str, Any], openapi_url: str = "/openapi.json") -> str:
    """The HTML reference of ``spec`` (an OpenAPI document), with nothing loaded from outside."""
    info = spec.get("info", {})
    by_tag: dict[str, list[str]] = {}
    for path, item in spec.get("paths", {}).items():
        for method in _METHODS:
            op = item.get(method)
            if op is not None:
                tag = (op.get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append(_operation(path, method, op))
    sections = "".join(f"<h2>{_e(tag)}</h2>{''.join(ops)}" for tag, ops in by_tag.items())
    models = "".join(
        _model(name, schema)
        for name, schema in spec.get("components", {}).get("schemas", {}).items()
    )
    title = _e(info.get("title", "API"))
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{title} - API reference</title><style>{_STYLE}</style></head><body>"
        f"<h1>{title} <span class='muted'>{_e(info.get('version', ''))}</span></h1>"
        f"<p>{_e(info.get('description', ''))}</p>"
        f"<p>The OpenAPI (Swagger) document for tools: <a href='{_e(openapi_url)}'>"
        f"{_e(openapi_url)}</a>. Authentication: <code>Authorization: Bearer TOKEN</code>.</p>"
        f"{sections}<h2>schemas</h2>{models}</body></html>"
    )
