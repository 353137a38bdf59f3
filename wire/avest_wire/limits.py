"""The contract's size limits, in one place.

The service enforces every number here (INVALID_ARGUMENT, or
RESOURCE_EXHAUSTED for the message size); the client imports the same
numbers to refuse a request before sending it. Lengths are in UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The methods of ``avest.v1.EstimatorService`` that the read port (``avest serve
#: --read-address``) serves too, from each pair as last published: a client given a
#: read address sends these there, every other call to the main port.
READ_PORT_METHODS = frozenset({"GetCoefficients", "Score", "Budget"})
#: Draft positions (K) of a pair: vLLM's largest ``num_speculative_tokens`` in use is
#: far below; 64 keeps a K x 2052-cell sketch and a K-row Newton system small.
MAX_K = 64
#: The feature ``logit(q_max)`` is clamped to ``[-MAX_LOG_ODDS, MAX_LOG_ODDS]``, as vLLM
#: 0.33 clamps it: a one-hot draft row would otherwise be +inf.
MAX_LOG_ODDS = 40.0
#: Most decode steps one round summary may cover.
MAX_SUMMARY_STEPS = 1_000_000
#: Requests one decode step of a round summary may count (``RoundSummary.reached``
#: at the first position): far above any batch (vLLM's ``max_num_seqs`` is in the
#: hundreds), so that only a forged count meets it.
MAX_STEP_REQUESTS = 65_536
#: ``target_model`` and ``draft_model``.
MAX_MODEL_BYTES = 256
#: ``method`` (non-empty: vLLM always names its speculative method).
MAX_METHOD_BYTES = 64
#: Labels of a pair key, and the size of each label's name and value.
MAX_LABELS = 16
MAX_LABEL_NAME_BYTES = 64
MAX_LABEL_VALUE_BYTES = 128
#: ``worker_id`` of an Observe step.
MAX_WORKER_ID_BYTES = 128
#: ``pair_id`` as sent (ids are 16 hex digits; longer ones cannot exist).
MAX_PAIR_ID_BYTES = 64
#: A cost curve: points per curve, the largest batch size and step time.
MAX_COST_POINTS = 256
MAX_COST_SIZE = 1_000_000
MAX_COST_MS = 1_000_000.0
#: ``hardware`` label of a cost curve, and how many a pair may hold.
MAX_HARDWARE_BYTES = 128
MAX_HARDWARE_PER_PAIR = 16
#: Largest gRPC message accepted (the service's default ``max_message_bytes``).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: How far ahead of a worker's highest applied sequence number a step may be.
#: Forwarders skip numbers only when their bounded queue overflows, so a real
#: gap is at most the steps dropped in one outage; a larger jump is refused.
MAX_SEQUENCE_GAP = 1 << 24
#: Largest sequence number at all (exact in a double, so in JSON too).
MAX_SEQUENCE = (1 << 53) - 1
#: Echoed ids and names are cut to this many characters in error messages.
ECHO_CHARS = 40


def echo(value: object) -> str:
    """``repr`` of a value for an error message, cut to :data:`ECHO_CHARS`."""
    text = repr(value)
    if len(text) <= ECHO_CHARS:
        return text
    return text[: ECHO_CHARS - 4] + "...'" + f" ({len(str(value))} chars)"


def byte_length(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def key_problem(
    target: str, draft: str, method: str, labels: Mapping[str, str]
) -> tuple[str, str] | None:
    """``(field, problem)`` for a pair key outside the limits, else ``None``."""
    for name, value in (("target_model", target), ("draft_model", draft)):
        if not value:
            return name, "must not be empty"
        if byte_length(value) > MAX_MODEL_BYTES:
            return name, f"is {byte_length(value)} bytes, at most {MAX_MODEL_BYTES}"
    if not method:
        return "method", "must not be empty"
    if byte_length(method) > MAX_METHOD_BYTES:
        return "method", f"is {byte_length(method)} bytes, at most {MAX_METHOD_BYTES}"
    if len(labels) > MAX_LABELS:
        return "labels", f"has {len(labels)} entries, at most {MAX_LABELS}"
    for label, value in labels.items():
        if not label or byte_length(label) > MAX_LABEL_NAME_BYTES:
            return "labels", f"name {echo(label)} must be 1 to {MAX_LABEL_NAME_BYTES} bytes"
        if byte_length(value) > MAX_LABEL_VALUE_BYTES:
            return "labels", f"value of {echo(label)} is over {MAX_LABEL_VALUE_BYTES} bytes"
    return None


def worker_id_problem(worker_id: str) -> str | None:
    if not worker_id or byte_length(worker_id) > MAX_WORKER_ID_BYTES:
        return f"must be 1 to {MAX_WORKER_ID_BYTES} bytes"
    return None
