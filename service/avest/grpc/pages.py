"""How many pairs one ``ListPairs`` reply may hold: the page size cap.

The cap is fixed by the largest ``Pair`` the contract allows (K = ``MAX_K``, every
string and label at its size limit, every counter at its largest value), so a
full page fits the message limit whatever the pairs' K and keys.
"""

from __future__ import annotations

from avest_wire import limits
from avest_wire.bins import CALIBRATION_SLOTS
from avest_wire.v1 import estimator_pb2 as pb

#: Largest value of a uint64 counter (the longest varint, 10 bytes).
_U64 = (1 << 64) - 1
#: Room for what a reply holds besides its pairs: the next page token (well under
#: 200 bytes) and gRPC's 5-byte message header, with plenty to spare.
REPLY_OVERHEAD_BYTES = 1024
#: Per pair in a reply: the field tag (1 byte) and the length (a varint of at most
#: 3 bytes below 2 MiB, 4 below 256 MiB).
PAIR_FRAMING_BYTES = 5


def _largest_pair() -> pb.Pair:
    k = limits.MAX_K
    text = "x"
    position = pb.PositionCalibration(
        auc=0.5, logloss=0.5, ece=0.5, mean_predicted=0.5, observed=0.5, count=_U64
    )
    return pb.Pair(
        pair_id=text * limits.MAX_PAIR_ID_BYTES,
        key=pb.PairKey(
            target_model=text * limits.MAX_MODEL_BYTES,
            draft_model=text * limits.MAX_MODEL_BYTES,
            method=text * limits.MAX_METHOD_BYTES,
            num_speculative_tokens=k,
            labels={
                f"{i:02d}".ljust(limits.MAX_LABEL_NAME_BYTES, text): text
                * limits.MAX_LABEL_VALUE_BYTES
                for i in range(limits.MAX_LABELS)
            },
        ),
        update_rule=max(pb.UpdateRule.values()),
        refit_interval=(1 << 32) - 1,
        coefficients=pb.Coefficients(
            pair_id=text * limits.MAX_PAIR_ID_BYTES,
            version=_U64,
            round=_U64,
            slope=0.5,
            intercepts=[0.5] * k,
            update_time={"seconds": 253402300799, "nanos": 999_999_999},  # 9999-12-31
            calibration_knots=[0.5] * CALIBRATION_SLOTS,
            calibration_logits=[0.5] * CALIBRATION_SLOTS,
            calibration_served=True,
        ),
        drafts_observed=_U64,
        steps_observed=_U64,
        calibration=pb.Calibration(
            count=_U64,
            auc=0.5,
            logloss=0.5,
            ece=0.5,
            mean_predicted=0.5,
            observed=0.5,
            by_position=[position] * k,
        ),
        cost_curve_hardware=[
            f"{i:02d}".ljust(limits.MAX_HARDWARE_BYTES, text)
            for i in range(limits.MAX_HARDWARE_PER_PAIR)
        ],
    )


#: Encoded size of the largest Pair the contract allows (about 11 KiB).
LARGEST_PAIR_BYTES = int(_largest_pair().ByteSize())


def page_cap(message_bytes: int) -> int:
    """The most pairs a reply may hold so that it stays within ``message_bytes``
    (and within gRPC's default 4 MiB that a client receives, whatever the
    server's own limit): also the page size of a request that names none."""
    budget = min(message_bytes, limits.MAX_MESSAGE_BYTES) - REPLY_OVERHEAD_BYTES
    return max(1, budget // (LARGEST_PAIR_BYTES + PAIR_FRAMING_BYTES))
