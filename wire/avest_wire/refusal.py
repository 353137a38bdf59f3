"""Which step an Observe refusal names, as data beside the status text.

A step the service refuses ends the Observe stream with a status (e.g.
INVALID_ARGUMENT) whose message starts ``"sequence N of worker W: "``. The
same ``N`` travels in the status's trailing metadata under
:data:`REFUSED_SEQUENCE_KEY`, as a decimal string, so that a sender knows
which step to drop without reading the text. Releases before 0.2 send the
text only; a sender reads the text for ``N`` when the entry is absent.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Trailing-metadata key of the refused step's sequence number (gRPC keys are
#: lower case; a key without the ``-bin`` suffix carries printable ASCII).
REFUSED_SEQUENCE_KEY = "avest-refused-sequence"


def refused_sequence_metadata(sequence: int) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that names ``sequence`` as the refused step."""
    return ((REFUSED_SEQUENCE_KEY, str(int(sequence))),)


def refused_sequence_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> int | None:
    """The refused step's sequence number in a status's trailing metadata; None if absent."""
    for key, value in metadata or ():
        if key != REFUSED_SEQUENCE_KEY:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        return int(text) if text.isdecimal() else None
    return None
