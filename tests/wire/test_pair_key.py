"""The pair key: one type for worker, client and service, and an id that never changes."""

from __future__ import annotations

import hashlib
import json

import pytest

from avest_wire.errors import InvalidInput
from avest_wire.pair import Labels, PairKey


def test_the_id_is_the_hash_of_the_canonical_key() -> None:
    key = PairKey.of("t/m", "d/m", "eagle3", 5, {"temperature": "1.0", "a": "b"})
    blob = json.dumps(
        {"draft": "d/m", "k": 5, "labels": {"a": "b", "temperature": "1.0"}, "method": "eagle3",
         "target": "t/m"},
        sort_keys=True, separators=(",", ":"),
    )  # fmt: skip
    assert key.pair_id == hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_labels_in_any_order_or_form_give_one_key() -> None:
    a = PairKey("t", "d", "m", 3, {"x": "1", "y": "2"})
    b = PairKey("t", "d", "m", 3, (("y", "2"), ("x", "1")))
    assert a == b and hash(a) == hash(b) and a.pair_id == b.pair_id
    assert a.labels == {"x": "1", "y": "2"} and list(a.labels) == ["x", "y"]
    assert isinstance(a.labels, Labels) and {a: 1}[b] == 1
    assert PairKey("t", "d", "", 3) != PairKey("t", "d", "", 4)


@pytest.mark.parametrize(
    "args,field",
    [
        (("", "d", "m", 3), "target_model"),
        (("t", "", "m", 3), "draft_model"),
        (("t", "d", "m", 0), "num_speculative_tokens"),
        (("t", "d", "m", 65), "num_speculative_tokens"),
    ],
)
def test_a_key_the_service_registers_names_both_models_and_a_k_in_range(args, field) -> None:
    with pytest.raises(InvalidInput) as err:
        PairKey.of(*args)
    assert err.value.field == field
