"""Simulated vLLM spec-decode counters for the no-GPU demo.

Replays a trace's verification counts (default: avest's bundled sample) at a
fixed pace and exposes them on ``/metrics`` exactly as vLLM 0.33 names and
labels them (vllm/v1/spec_decode/metrics.py, ``SpecDecodingProm``):

``vllm:spec_decode_num_drafts_total{model_name, engine}``
``vllm:spec_decode_num_draft_tokens_total{model_name, engine}``
``vllm:spec_decode_num_accepted_tokens_total{model_name, engine}``
``vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name, engine, position}``

with ``model_name`` the trace's target model (what the avest shim registers
as the pair's target, and vLLM's served model name by default). Per request
and step, as vLLM's ``SpecDecodingStats.observe_draft``: one draft when any
token was verified, ``num_verified`` draft tokens, ``num_accepted`` accepted
tokens, and positions ``0 .. num_accepted-1`` accepted. This lets the
dashboard's "avest vs vLLM" panels show something on a laptop; it is not vLLM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, start_http_server

from avest.offline.trace import bundled_sample_path, read_trace

LABELS = ["model_name", "engine"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", help="trace file (default: the bundled sample)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--steps-per-second", type=float, default=20.0)
    parser.add_argument("--model-name", help="model_name label (default: the trace's target)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: loop)")
    args = parser.parse_args(argv)

    trace = read_trace(args.trace or bundled_sample_path())
    model = args.model_name or str(trace.meta["target"])
    k = trace.k
    registry = CollectorRegistry()
    drafts = Counter(
        "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", LABELS, registry=registry
    )
    draft_tokens = Counter(
        "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", LABELS, registry=registry
    )
    accepted = Counter(
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        LABELS,
        registry=registry,
    )
    per_pos = Counter(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        [*LABELS, "position"],
        registry=registry,
    )
    labels = (model, "0")
    pos_children = [per_pos.labels(*labels, str(i)) for i in range(k)]
    for c in (drafts, draft_tokens, accepted):
        c.labels(*labels)

    start_http_server(args.port, addr=args.host, registry=registry)
    print(
        f"vllm_metrics_sim serving http://{args.host}:{args.port}/metrics model_name={model!r}",
        flush=True,
    )
    terminate = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: terminate.set())

    steps = list(trace.steps())
    period = 1.0 / args.steps_per_second if args.steps_per_second > 0 else 0.0
    done = 0
    while not terminate.is_set() and not (args.max_steps and done >= args.max_steps):
        for step in steps:
            verified = step.num_verified.astype(np.int64)
            acc = step.num_accepted.astype(np.int64)
            drafts.labels(*labels).inc(int((verified > 0).sum()))
            draft_tokens.labels(*labels).inc(int(verified.sum()))
            accepted.labels(*labels).inc(int(acc.sum()))
            for i, child in enumerate(pos_children):
                child.inc(int((acc > i).sum()))
            done += 1
            if (args.max_steps and done >= args.max_steps) or terminate.wait(period):
                break
    # With --max-steps: keep serving the final counts until terminated.
    terminate.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
