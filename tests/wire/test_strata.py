"""A request's stratum: from its temperature and an optional label, before drafting."""

from __future__ import annotations

import math

import pytest

from avest_wire.errors import InvalidInput
from avest_wire.strata import (
    DEFAULT_EDGES,
    GREEDY,
    GREEDY_TEMPERATURE,
    MAX_EDGES,
    MAX_STRATA,
    MAX_STRATUM_BYTES,
    bucket_names,
    check_stratum,
    stratum_of,
)


@pytest.mark.parametrize(
    ("temperature", "stratum"),
    [
        (0.0, GREEDY),
        (GREEDY_TEMPERATURE / 2, GREEDY),  # vLLM samples greedily below its epsilon
        (GREEDY_TEMPERATURE, "t<0.5"),
        (0.3, "t<0.5"),
        (0.5, "t0.5-1"),  # an edge opens its bucket
        (0.7, "t0.5-1"),
        (0.999, "t0.5-1"),
        (1.0, "t>=1"),
        (2.0, "t>=1"),
    ],
)
def test_default_buckets(temperature: float, stratum: str) -> None:
    assert DEFAULT_EDGES == (0.5, 1.0)
    assert stratum_of(temperature) == stratum


def test_edges_are_configurable_and_every_name_is_listed() -> None:
    edges = (0.25, 0.8, 1.2)
    names = bucket_names(edges)
    assert names == ("greedy", "t<0.25", "t0.25-0.8", "t0.8-1.2", "t>=1.2")
    got = [stratum_of(t, edges) for t in (0.0, 0.1, 0.25, 0.79, 0.8, 1.2, 5.0)]
    assert got == ["greedy", "t<0.25", "t0.25-0.8", "t0.25-0.8", "t0.8-1.2", "t>=1.2", "t>=1.2"]
    assert set(got) == set(names)
    # No edges: greedy against sampled.
    assert [stratum_of(t, ()) for t in (0.0, 0.7, 1.0)] == ["greedy", "sampled", "sampled"]
    # Every bucket of the most edges allowed fits in the bound on strata.
    most = tuple(0.1 * (i + 1) for i in range(MAX_EDGES))
    assert len(bucket_names(most)) == MAX_STRATA


def test_a_label_prefixes_the_name() -> None:
    assert stratum_of(0.0, label="lora-sql") == "lora-sql/greedy"
    assert stratum_of(0.7, label="chat") == "chat/t0.5-1"
    assert stratum_of(0.7, (), label="chat") == "chat/sampled"


@pytest.mark.parametrize("temperature", [-0.1, math.nan, math.inf, -math.inf])
def test_a_temperature_outside_its_domain_is_refused(temperature: float) -> None:
    with pytest.raises(InvalidInput) as info:
        stratum_of(temperature)
    assert info.value.field == "temperature"


@pytest.mark.parametrize(
    "edges",
    [
        (1.0, 0.5),
        (0.5, 0.5),
        (0.0, 1.0),
        (-1.0,),
        (math.nan,),
        (math.inf,),
        tuple(0.01 * (i + 1) for i in range(MAX_EDGES + 1)),
    ],
)
def test_bad_edges_are_refused(edges: tuple[float, ...]) -> None:
    with pytest.raises(InvalidInput) as info:
        stratum_of(0.7, edges)
    assert info.value.field == "edges"


@pytest.mark.parametrize("label", ["", "a/b", "x" * MAX_STRATUM_BYTES, "tab\there"])
def test_bad_labels_are_refused(label: str) -> None:
    with pytest.raises(InvalidInput) as info:
        stratum_of(0.0, label=label)
    assert info.value.field in {"label", "stratum"}


def test_check_stratum() -> None:
    assert check_stratum("greedy") == "greedy"
    assert check_stratum("é" * (MAX_STRATUM_BYTES // 2)) == "é" * (MAX_STRATUM_BYTES // 2)
    for bad in ["", "é" * (MAX_STRATUM_BYTES // 2 + 1), "new\nline", 3]:
        with pytest.raises(InvalidInput):
            check_stratum(bad)  # type: ignore[arg-type]
