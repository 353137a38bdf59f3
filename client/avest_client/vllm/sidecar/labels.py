"""What the sidecar sink registers the pair as: its labels and the hardware name."""

from __future__ import annotations

from avest_wire.pair import PairKey

DEFAULT_HARDWARE = "default"


def pair_labels(pair_key: PairKey) -> dict[str, str]:
    """The labels registered with the pair: AVEST_LABELS plus vLLM's draft sampling method
    (:func:`avest_client.vllm.pair.pair_from_vllm_config` adds it to the key)."""
    return dict(pair_key.labels)


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
