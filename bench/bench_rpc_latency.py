"""Score and Budget end to end at B = 256, K = 16: p50/p99, and where the time goes.

One run, one table. ``avest serve`` in a subprocess (loopback, no call-rate
limit, an admin token for the cost curves); one pair with K = 16 and the
vLLM-like cost curves of ``bench_budget.py``; sequential calls through the
sync :class:`EstimatorClient` with fresh inputs drawn from a pool of 16.

* ``Score`` (features in, confidences and survival out);
* ``Budget`` from confidences (the lossless default rule);
* ``Budget`` from features (scored through the calibration layer first).

Beside each round trip: the server's own view (``in handler``: the mean of
``avest_rpc_duration_seconds`` over the timed calls, from the interceptor's
start to its end), the CPU time per call of the server process (all its
threads, from ``/proc``) and of this process (the client), which the
machine's load inflates far less than wall time; and the handlers' work in
this process without gRPC (decode, validate, score or decide, encode).

``--baseline PATH`` starts a second server from another source tree
(``PATH/service``, ``PATH/wire`` first on its path) and times both servers in
the same run, alternating blocks of calls, so the two columns share the
machine's load. ``--profile FILE`` writes a cProfile of the (first) server.

Usage: python bench/bench_rpc_latency.py [--calls 2000] [--baseline ../old] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from grpc_floor import unary_floor
from prometheus_client.parser import text_string_to_metric_families
from serve_proc import ADMIN_TOKEN, CLI, serve
from timing import call_seconds

from avest_client import EstimatorClient
from avest_client.errors import InvalidArgumentError
from tests.support.serve import stop_process

B, K = 256, 16
BLOCK = 50
DRAFT = [(r, 1.0 + 0.01 * r) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
_CAPTURED = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
VERIFY = [(s, 5.0 + 0.004 * s + (0.4 if s > 256 else 0.0)) for s in _CAPTURED]
VERIFY += [(768, 9.0), (1024, 11.0), (2048, 18.0), (4096, 33.0), (8192, 65.0)]


class Server:
    def __init__(self, tree: Path | None, profile: str | None) -> None:
        self.data = tempfile.mkdtemp(prefix="avest-bench-rpc-")
        command = None
        if profile:
            script = Path(self.data) / "serve.py"
            script.write_text(CLI + "\n")
            command = [sys.executable, "-m", "cProfile", "-o", profile, str(script)]
        served = serve(
            Path(self.data),
            ["--log-level", "warning", "--admin-token", ADMIN_TOKEN, "--rpc-rate", "0"],
            tokens=False,
            tree=tree,
            command=command,
        )
        self.proc, self.grpc, self.http = served.proc, served.grpc_address, served.http_url

    def rpc_seconds(self) -> dict[str, tuple[float, float]]:
        """``{method: (sum, count)}`` of the server's RPC duration histogram (OK calls)."""
        out: dict[str, list[float]] = {}
        text = httpx.get(f"{self.http}/metrics", timeout=30).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if (
                    s.name.startswith("avest_rpc_duration_seconds_")
                    and s.labels.get("code") == "OK"
                ):
                    pair = out.setdefault(s.labels["method"], [0.0, 0.0])
                    if s.name.endswith("_sum"):
                        pair[0] = s.value
                    elif s.name.endswith("_count"):
                        pair[1] = s.value
        return {m: (v[0], v[1]) for m, v in out.items()}

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system, all threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        stop_process(self.proc, 60)


def calls(client: EstimatorClient, pid: str) -> dict[str, Callable[[int], object]]:
    rng = np.random.default_rng(1)
    feats = [rng.normal(0, 2, size=(B, K)).astype(np.float32) for _ in range(16)]
    confs = [rng.beta(5, 2, size=(B, K)).astype(np.float32) for _ in range(16)]
    sched = np.full(B, K)
    return {
        "Score": lambda i: client.score(pid, feats[i % 16]),
        "Budget": lambda i: client.budget(pid, confs[i % 16], sched, B, B),
        "Budget (features)": lambda i: client.budget(
            pid, feats[i % 16], sched, B, B, from_features=True
        ),
    }


def handler_ms(n: int = 300) -> dict[str, float]:
    """The handlers' work in this process, no gRPC: median ms per call."""
    from avest.core.budget import decide
    from avest.core.estimator import OnlineEstimator
    from avest.core.features import check_features
    from avest.core.model import survival
    from avest.state.costs import CostCurves
    from avest_wire import matrix as wire

    est = OnlineEstimator(K)
    table = CostCurves("", tuple(DRAFT), tuple(VERIFY), 512).table()
    rng = np.random.default_rng(2)
    feats = [wire.encode(rng.normal(0, 2, size=(B, K)))[0] for _ in range(16)]
    confs = [wire.encode(rng.beta(5, 2, size=(B, K)))[0] for _ in range(16)]
    sched = np.full(B, K)

    def score(i: int) -> None:
        x = check_features(wire.decode(feats[i % 16], B, K), K)
        p = est.predict_served(x)
        wire.encode(p), wire.encode(survival(p))

    def budget(i: int) -> None:
        conf = wire.decode(confs[i % 16], B, K, "confidences")
        d = decide("lossless-walk", conf.astype(np.float64), sched, table, B, B)
        [int(v) for v in d.verify_lengths]

    out = {}
    for name, fn in (("Score", score), ("Budget", budget)):
        out[name] = float(np.median(call_seconds(fn, n, warmup=20)) * 1e3)
    return out


def run(servers: dict[str, Server], n: int) -> dict[str, dict[str, dict[str, float]]]:
    clients = {}
    fns = {}
    for label, srv in servers.items():
        c = EstimatorClient(srv.grpc, timeout=30, token=ADMIN_TOKEN)
        pid = c.register("bench/target", "bench/draft", "bench", K).pair_id
        c.set_cost_curves(pid, DRAFT, VERIFY, cudagraph_limit=512)
        clients[label], fns[label] = c, calls(c, pid)
    times: dict[str, dict[str, list[float]]] = {lb: {} for lb in servers}
    server: dict[str, dict[str, float]] = {lb: {} for lb in servers}
    for method in fns[next(iter(servers))]:
        wire_name = method.split(" ")[0]
        able = []
        for label in servers:
            try:
                for i in range(BLOCK):  # warm up
                    fns[label][method](i)
            except InvalidArgumentError:  # an older tree without this request form
                continue
            able.append(label)
        before = {lb: servers[lb].rpc_seconds().get(wire_name, (0.0, 0.0)) for lb in able}
        cpu = {lb: [0.0, 0.0] for lb in able}  # server, client CPU seconds
        for start in range(0, n, BLOCK):  # alternate blocks: the servers share the load
            for label in able:
                fn = fns[label][method]
                out = times[label].setdefault(method, [])
                s0, c0 = servers[label].cpu_s(), time.process_time()
                out.extend(call_seconds(fn, BLOCK, first=start))
                cpu[label][0] += servers[label].cpu_s() - s0
                cpu[label][1] += time.process_time() - c0
        for label in able:
            s1, c1 = servers[label].rpc_seconds().get(wire_name, (0.0, 0.0))
            s0, c0 = before[label]
            server[label][method] = (s1 - s0) / max(c1 - c0, 1) * 1e3
            server[label][method + " cpu"] = cpu[label][0] / n * 1e3
            server[label][method + " client cpu"] = cpu[label][1] / n * 1e3
    result: dict[str, dict[str, dict[str, float]]] = {}
    for label in servers:
        result[label] = {}
        for method, t in times[label].items():
            a = np.array(t) * 1e3
            result[label][method] = {
                "p50_ms": float(np.percentile(a, 50)),
                "p99_ms": float(np.percentile(a, 99)),
                "server_mean_ms": server[label][method],
                "server_cpu_ms": server[label][method + " cpu"],
                "client_cpu_ms": server[label][method + " client cpu"],
            }
        clients[label].close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--baseline", type=Path, help="another source tree to time beside")
    parser.add_argument("--profile", help="cProfile output of the server")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    servers = {"this tree": Server(None, args.profile)}
    if args.baseline:
        servers["baseline"] = Server(args.baseline, None)
    try:
        result = run(servers, args.calls)
    finally:
        for srv in servers.values():
            srv.stop()
    handler = handler_ms()
    # the bare floor: a unary call of the same request size that does nothing
    floor = unary_floor(B * K * 4, B * K * 4 // 2)
    load = os.getloadavg()[0]
    if args.json:
        out = {"rpc": result, "handler_ms": handler, "grpc_floor": floor, "load": load}
        print(json.dumps(out, indent=2))
        return
    print(f"B={B}, K={K}, {args.calls} sequential calls per method and server; load {load:.1f}")
    print(
        f"{'server':<10} {'call':<18} {'p50 ms':>8} {'p99 ms':>8} {'in handler ms':>14} "
        f"{'server CPU ms':>14} {'client CPU ms':>14}"
    )
    for label, rows in result.items():
        for method, r in rows.items():
            print(
                f"{label:<10} {method:<18} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
                f"{r['server_mean_ms']:>14.3f} {r['server_cpu_ms']:>14.3f} "
                f"{r['client_cpu_ms']:>14.3f}"
            )
    print("handler alone (median ms): " + ", ".join(f"{k} {v:.3f}" for k, v in handler.items()))
    print(
        f"bare gRPC unary on this host ({B * K * 4}-byte request, nothing done; "
        f"bench/grpc_floor.py): p50 {floor['p50_ms']:.3f} ms, p99 {floor['p99_ms']:.3f} ms, "
        f"server CPU {floor['server_cpu_ms']:.3f} ms, client CPU {floor['client_cpu_ms']:.3f} ms"
    )
    print("target: p99 <= 1 ms")


if __name__ == "__main__":
    main()
