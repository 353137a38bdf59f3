"""PromQL pieces of the dashboard: selectors, vLLM 0.33 metric names, thresholds,
and the pair picker's query."""

from __future__ import annotations

from avest.metrics import names as m

#: Thresholds drawn on the panels; the same numbers as deploy/prometheus/alerts.yml.
ECE_THRESHOLD = 0.05
DIVERGENCE_THRESHOLD = 0.1

# vLLM 0.33 (vllm/v1/spec_decode/metrics.py): labels model_name, engine (+ position).
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

#: The sidecar picked by the ``job`` and ``instance`` variables: every avest
#: series is selected through it (``instance`` may be All: every target of the job,
#: every replica when the job's targets are replicas on one PostgreSQL database).
SIDECAR = 'job="$job",instance=~"$instance"'
#: One pair of that sidecar (``pair`` variable).
PAIR = f'{SIDECAR},pair="$pair"'
#: The strata of that pair picked by the ``stratum`` variable (multi-valued; All is ``.*``).
STRATUM = 'stratum=~"$stratum"'
VLLM_SEL = 'model_name="$target"'
RI = "$__rate_interval"


def sidecar(name: str, matchers: str = "") -> str:
    """``name`` selected on the sidecar, plus ``matchers`` (``a="b",...``)."""
    return f"{name}{{{SIDECAR}{',' + matchers if matchers else ''}}}"


def pair(name: str, matchers: str = "") -> str:
    """``name`` selected on the sidecar's pair, plus ``matchers``."""
    return f"{name}{{{PAIR}{',' + matchers if matchers else ''}}}"


def pair_gauge(name: str, *by: str) -> str:
    """A gauge of the sidecar's pair, one series per value of the labels ``by``
    (``position``, ``bin``...) whichever target exports it. On replicas a pair's
    series come from its refitter alone, and move to another replica at a
    fail-over (both may export them for a scrape or two), so a pair's gauges are
    read ``max by (pair, ...)``, its counters summed (``sum(rate(...))``)."""
    return f"max by ({', '.join(('pair', *by))}) ({pair(name)})"


def stratum_gauge(name: str) -> str:
    """A per-stratum gauge of the sidecar's pair, one series per stratum picked
    (``stratum`` variable), read ``max by (pair, stratum)`` as :func:`pair_gauge`."""
    return f"max by (pair, stratum) ({pair(name, STRATUM)})"


#: The label the pair picker's query adds to ``avest_pair_info``: the name the
#: picker shows, ``target ← draft [labels]`` (without `` [...]`` when the pair
#: has no labels), as /v1/pairs/{id}/reliability.svg titles it.
PAIR_NAME_LABEL = "name"


def pair_names() -> str:
    """``avest_pair_info`` of the sidecar with a label ``name`` = ``target ← draft
    [labels]``, for the pair variable (``query_result``)."""
    info = sidecar(m.PAIR_INFO)
    n = PAIR_NAME_LABEL
    joined = (
        f'label_join(label_join({info}, "{n}", " \u2190 ", "target", "draft"),'
        f' "{n}", " [", "{n}", "labels")'
    )
    # "t ← d [labels" -> "t ← d [labels]"; "t ← d [" (no labels) -> "t ← d".
    closed = f'label_replace({joined}, "{n}", "$1]", "{n}", `(.* \\[.+)`)'
    return f'label_replace({closed}, "{n}", "$1", "{n}", `(.*) \\[`)'


#: The pair variable's regex over Grafana's ``query_result`` lines
#: (``name{label="value",...} value timestamp``): text = the name, value = the id.
PAIR_REGEX = f'/^(?=.*[{{,]{PAIR_NAME_LABEL}="(?<text>[^"]*)")(?=.*[{{,]pair="(?<value>[^"]*)")/'


def vllm_per_position() -> str:
    return (
        f"sum by (position) (rate({VLLM_ACCEPTED_PER_POS}{{{VLLM_SEL}}}[{RI}]))\n"
        f"/ on () group_left sum(rate({VLLM_DRAFTS}{{{VLLM_SEL}}}[{RI}]))"
    )


def vllm_acceptance_length() -> str:
    return (
        f"1 + sum(rate({VLLM_ACCEPTED}{{{VLLM_SEL}}}[{RI}]))"
        f" / sum(rate({VLLM_DRAFTS}{{{VLLM_SEL}}}[{RI}]))"
    )
