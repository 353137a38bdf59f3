"""ListPairs and ``GET /v1/pairs`` a page at a time, against a real server.

Found: from about 970 pairs at K = 64 one ListPairs reply passed the 4 MiB message
limit, so ListPairs (and ``avest pairs``) failed with RESOURCE_EXHAUSTED for everyone.
Here the server's message limit is lowered to 256 KiB so that a few dozen K = 64
pairs pass it, the same failure with fewer pairs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import grpc
import pytest

from avest.commands.cli import main
from avest.grpc.pages import LARGEST_PAIR_BYTES, page_cap
from avest.http.api import MAX_PAGE_SIZE, PAGE_SIZE
from avest.state.listing import page_token
from avest_client import AsyncEstimatorClient, EstimatorClient, InvalidArgumentError
from avest_wire.limits import MAX_MESSAGE_BYTES
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import TOKEN, Live
from tests.support.rpc import register_named, stub_for

#: The live servers' admin token as gRPC metadata (deleting a pair needs it).
ADMIN = (("authorization", f"Bearer {TOKEN}"),)
#: The lowered message limit: 64 pairs at K = 64 (about 4.3 KB each) pass it.
SMALL_MESSAGE_BYTES = 256 * 1024
#: Pairs at K = 64 whose one-reply listing passed SMALL_MESSAGE_BYTES.
MANY = 64


def ids_of(pairs) -> list[str]:  # noqa: ANN001
    return [p.pair_id for p in pairs]


def listed(stub, page_size: int) -> tuple[list[str], int]:  # noqa: ANN001
    """Every pair id, following the pages; and how many pages it took."""
    ids, token, pages = [], "", 0
    while True:
        resp = stub.ListPairs(pb.ListPairsRequest(page_size=page_size, page_token=token))
        ids += ids_of(resp.pairs)
        pages += 1
        token = resp.next_page_token
        if not token:
            return ids, pages


def test_small_pages_list_every_pair_once_in_id_order(live: Live) -> None:
    made = sorted(register_named(live.stub, f"target-{i}", 4) for i in range(7))
    ids, pages = listed(live.stub, 3)
    assert ids == made and pages == 3
    # A page size that divides the pairs exactly: the last page says it is the last.
    ids, pages = listed(live.stub, 7)
    assert ids == made and pages == 1
    # A request that names no page size (as a 0.1.0 client's) gets them all in one page.
    resp = live.stub.ListPairs(pb.ListPairsRequest())
    assert ids_of(resp.pairs) == made and resp.next_page_token == ""


def test_pairs_registered_or_deleted_between_pages_do_not_disturb_the_listing(
    live: Live,
) -> None:
    made = sorted(register_named(live.stub, f"target-{i}", 4) for i in range(6))
    first = live.stub.ListPairs(pb.ListPairsRequest(page_size=2))
    assert ids_of(first.pairs) == made[:2]
    # The page's last pair and the next one go; new pairs come.
    for gone in made[1:3]:
        live.stub.DeletePair(pb.DeletePairRequest(pair_id=gone), metadata=ADMIN)
    added = [register_named(live.stub, f"later-{i}", 4) for i in range(4)]
    rest, token = [], first.next_page_token
    while token:
        resp = live.stub.ListPairs(pb.ListPairsRequest(page_size=2, page_token=token))
        rest += ids_of(resp.pairs)
        token = resp.next_page_token
    # Every pair after the first page's last id, once, in order; nothing before it again.
    assert rest == sorted(i for i in made[3:] + added if i > made[1])


def test_a_malformed_page_token_or_page_size_is_refused_and_changes_nothing(live: Live) -> None:
    made = sorted(register_named(live.stub, f"target-{i}", 4) for i in range(3))
    for token in ("not a token!", "AAAA", page_token("x"), page_token("ab") + "!", "a" * 5000):
        with pytest.raises(grpc.RpcError) as err:
            live.stub.ListPairs(pb.ListPairsRequest(page_token=token))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "page_token" in err.value.details()
        r = live.http.get("/v1/pairs", params={"page_token": token})
        # The schema states the pattern: FastAPI refuses what it does not match.
        assert r.status_code == 422 and "page_token" in r.text
    with pytest.raises(grpc.RpcError) as err:
        live.stub.ListPairs(pb.ListPairsRequest(page_size=-1))
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_size" in err.value.details()
    )
    assert live.http.get("/v1/pairs", params={"page_size": -1}).status_code == 422
    assert listed(live.stub, 0)[0] == made


@pytest.fixture
def crowded(open_server: Callable[..., Live]) -> tuple[Live, list[str]]:
    """A server with a 256 KiB message limit holding MANY pairs at K = 64."""
    live = open_server(max_message_bytes=SMALL_MESSAGE_BYTES)
    made = sorted(register_named(live.stub, f"target-{i:03d}", 64) for i in range(MANY))
    return live, made


def test_pairs_past_the_message_limit_are_listed_in_pages_that_fit_it(crowded) -> None:  # noqa: ANN001
    live, made = crowded
    cap = page_cap(SMALL_MESSAGE_BYTES)
    # The pairs do not fit one message: the reply the service used to send is over it.
    whole = pb.ListPairsResponse(
        pairs=[live.stub.GetPair(pb.GetPairRequest(pair_id=i)).pair for i in made]
    )
    assert whole.ByteSize() > SMALL_MESSAGE_BYTES > cap * LARGEST_PAIR_BYTES
    # A request without a page size gets the first, capped page and the token to go on.
    first = live.stub.ListPairs(pb.ListPairsRequest())
    assert ids_of(first.pairs) == made[:cap] and first.next_page_token
    assert first.ByteSize() <= SMALL_MESSAGE_BYTES
    # A larger page size is lowered to the cap.
    assert ids_of(live.stub.ListPairs(pb.ListPairsRequest(page_size=10_000)).pairs) == made[:cap]
    ids, pages = listed(live.stub, 0)
    assert ids == made and pages == -(-MANY // cap)


def test_both_clients_and_the_cli_follow_the_pages(crowded, capsys) -> None:  # noqa: ANN001
    live, made = crowded
    with EstimatorClient(live.grpc_address, timeout=30) as client:
        assert ids_of(client.pairs()) == made
        pages = list(client.pair_pages(page_size=5))
        assert [len(p.pairs) for p in pages] == [5] * (MANY // 5) + [MANY % 5]
        assert [p.next_page_token == "" for p in pages] == [False] * (len(pages) - 1) + [True]
        with pytest.raises(InvalidArgumentError):
            client.pairs_page(page_size=-1)

    async def listed_async() -> tuple[list[str], list[int]]:
        async with AsyncEstimatorClient(live.grpc_address, timeout=30) as client:
            sizes = [len(p.pairs) async for p in client.pair_pages(page_size=20)]
            return ids_of(await client.pairs()), sizes

    ids, sizes = asyncio.run(listed_async())
    assert ids == made and sizes == [20, 20, 20, 4]

    assert main(["pairs", "--address", live.grpc_address, "--json"]) == 0
    assert [p["pair_id"] for p in json.loads(capsys.readouterr().out)] == made


def test_a_thousand_pairs_at_k_64_are_listed_at_the_default_limit(server) -> None:  # noqa: ANN001
    """The case as found: at the default 4 MiB limit, 1000 pairs at K = 64 (a few
    seconds to register) are past what one reply may hold."""
    channel, stub = stub_for(server.grpc_address)
    try:
        made = sorted(register_named(stub, f"target-{i:04d}", 64) for i in range(1000))
        cap = page_cap(MAX_MESSAGE_BYTES)
        pages, token = [], ""
        while True:
            resp = stub.ListPairs(pb.ListPairsRequest(page_token=token), timeout=30)
            pages.append(resp)
            token = resp.next_page_token
            if not token:
                break
    finally:
        channel.close()
    assert [len(p.pairs) for p in pages] == [cap, cap, 1000 - 2 * cap]
    assert all(p.ByteSize() <= MAX_MESSAGE_BYTES for p in pages)
    # All of them in one reply, as the service used to send it: over the limit.
    whole = pb.ListPairsResponse(pairs=[pair for p in pages for pair in p.pairs])
    assert ids_of(whole.pairs) == made and whole.ByteSize() > MAX_MESSAGE_BYTES
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        assert ids_of(client.pairs()) == made


def test_the_http_listing_goes_in_pages_too(crowded) -> None:  # noqa: ANN001
    live, made = crowded
    ids, token, sizes = [], "", []
    while True:
        body = live.http.get("/v1/pairs", params={"page_size": 25, "page_token": token}).json()
        ids += [p["id"] for p in body["pairs"]]
        sizes.append(len(body["pairs"]))
        token = body["next_page_token"]
        if not token:
            break
    assert ids == made and sizes == [25, 25, 14]
    # No page size: the default page, with the token of the rest.
    body = live.http.get("/v1/pairs").json()
    assert [p["id"] for p in body["pairs"]] == made[:PAGE_SIZE] and body["next_page_token"]
    body = live.http.get("/v1/pairs", params={"page_token": body["next_page_token"]}).json()
    assert [p["id"] for p in body["pairs"]] == made[PAGE_SIZE:] and body["next_page_token"] == ""
    # A larger page size is lowered to the most a page holds.
    body = live.http.get("/v1/pairs", params={"page_size": 10_000}).json()
    assert len(body["pairs"]) == min(MAX_PAGE_SIZE, MANY)
