"""Run one real ``vllm.LLM`` and write what it generated (engine environment only).

    python tests/engine/engine_driver.py MODELS OUT CONFIG_JSON

``CONFIG_JSON`` holds ``speculate`` (draft-model speculation with ``k``
drafts), ``adaptive`` (adaptive verification), ``batches`` (how many prompts
each ``generate`` call takes, in order), ``tokens`` (per prompt),
``temperature`` (or ``temperatures``, one per prompt) and ``eager`` (no CUDA graphs; default true, as on a CPU). The engine follows vLLM's own environment
(``VLLM_ENABLE_V1_MULTIPROCESSING``, ``VLLM_USE_V2_MODEL_RUNNER``, ...), and
avest's plugin its own (``AVEST_ADDRESS``, ``AVEST_MODE``, ...).

With ``pause`` set, before every batch after the first the driver writes
``OUT/paused-<i>.json`` (the shim's stats, where the estimator lives in this
process) and waits for ``OUT/resume-<i>``; the test stops or starts the
sidecar meanwhile. A resume file holding ``connected`` (``disconnected``) makes
the driver wait, at most 60 s, until the shim's sink says it is (is not)
connected before it goes on.
``OUT/result.json`` gets each prompt's token ids and the wall time; then the
driver exits as a user's script does, leaving vLLM to shut its engine down.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path


def shim_stats() -> dict:
    """The stats of the shim estimators built in this process (in-process engines only)."""
    try:
        from avest_client.vllm import lifecycle
    except ImportError:
        return {}
    live = list(lifecycle._live)
    return live[0].avest_stats() if live else {}


def wait_for_resume(out: Path, i: int) -> None:
    (out / f"paused-{i}.json").write_text(json.dumps(shim_stats(), default=str))
    resume = out / f"resume-{i}"
    while not resume.exists():
        time.sleep(0.05)
    want = resume.read_text().strip()
    if want in ("connected", "disconnected"):
        deadline = time.monotonic() + 60
        while bool((shim_stats().get("sink") or {}).get("connected")) != (want == "connected"):
            if time.monotonic() > deadline:
                raise SystemExit(f"the shim's sink is not {want} after 60 s")
            time.sleep(0.05)


def main(models: Path, out: Path, config: dict) -> None:
    logging.basicConfig(level=logging.INFO, format="%(process)d %(name)s %(levelname)s %(message)s")
    from vllm import LLM, SamplingParams

    prompts = json.loads((models / "prompts.json").read_text())
    kwargs: dict = {}
    if config["speculate"]:
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": str(models / "draft"),
            "num_speculative_tokens": config["k"],
            "enable_adaptive_verification": bool(config["adaptive"]),
        }
    started = time.monotonic()
    llm = LLM(
        model=str(models / "target"), dtype="float32", max_model_len=256,
        max_num_seqs=8, kv_cache_memory_bytes=64 << 20, seed=0,
        enforce_eager=config.get("eager", True), **kwargs,
    )  # fmt: skip

    def sampling(temperature: float, seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=temperature, max_tokens=config["tokens"], ignore_eos=True, seed=seed
        )

    # one temperature for every prompt, or (``temperatures``) one per prompt, in order
    per_prompt = config.get("temperatures")
    tokens: list[list[int]] = []
    first = 0
    for i, size in enumerate(config["batches"]):
        if i and config.get("pause"):
            wait_for_resume(out, i)
        params = (
            [sampling(t, first + j) for j, t in enumerate(per_prompt[first : first + size])]
            if per_prompt
            else sampling(config["temperature"], 0)
        )
        results = llm.generate(prompts[first : first + size], params, use_tqdm=False)
        tokens += [list(r.outputs[0].token_ids) for r in results]
        first += size
    seconds = time.monotonic() - started
    (out / "result.json").write_text(json.dumps({"tokens": tokens, "seconds": seconds}))
    # and exit as a user's script does: vLLM shuts its engine down at interpreter exit


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
