"""What the sidecar sink registers the pair as: its labels and the hardware name."""

from __future__ import annotations

from avest_client.vllm.pair import PairKey

#: Label added to the pair key from vLLM's speculative config (AVEST_LABELS may override).
SAMPLE_METHOD_LABEL = "draft_sample_method"
DEFAULT_HARDWARE = "default"


def pair_labels(pair_key: PairKey) -> dict[str, str]:
    """The labels registered with the pair: AVEST_LABELS plus vLLM's draft sampling method."""
    labels = dict(pair_key.labels)
    if pair_key.draft_sample_method:
        labels.setdefault(SAMPLE_METHOD_LABEL, pair_key.draft_sample_method)
    return labels


def default_hardware() -> str:
    """The CUDA device name when CUDA is already initialised here, else ``"default"``.

    Never initialises CUDA itself (the sink may be built in a process that
    must not, and the label is not worth it).
    """
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            name = torch.cuda.get_device_name()
            return name.encode()[:128].decode(errors="ignore") or DEFAULT_HARDWARE
    except Exception:  # noqa: BLE001
        pass
    return DEFAULT_HARDWARE
