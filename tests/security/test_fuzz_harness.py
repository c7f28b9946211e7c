"""Tests for the fuzz harness itself: a spec that no longer matches the RPC it drives fails
when it is built, instead of fuzzing the wrong message type."""

from __future__ import annotations

import pytest

from fedps.proto import shard_pb2
from tests.security.fuzz.harness import RpcSpec

SHARD = shard_pb2.DESCRIPTOR.services_by_name["Shard"]


def test_a_spec_names_its_rpc() -> None:
    # Execute
    spec = RpcSpec(
        SHARD.methods_by_name["PullBlocks"], lambda rng: shard_pb2.PullRequest(), pools={}
    )

    # Assert
    assert (spec.name, spec.request) == ("Shard.PullBlocks", shard_pb2.PullRequest)


def test_a_request_of_another_type_fails_when_the_spec_is_built() -> None:
    # Prepare
    push = SHARD.methods_by_name["PushBlocks"]

    # Execute / Assert
    with pytest.raises(TypeError, match=r"Shard\.PushBlocks takes fedps\.proto\.PushRequest"):
        RpcSpec(push, lambda rng: shard_pb2.PullRequest(), pools={})


def test_a_reply_check_on_a_streamed_reply_fails_when_the_spec_is_built() -> None:
    # Prepare
    pull = SHARD.methods_by_name["PullBlocks"]

    def check(reply: shard_pb2.PullReply) -> str | None:
        return None

    # Execute / Assert
    with pytest.raises(TypeError, match="streams its replies"):
        RpcSpec(pull, lambda rng: shard_pb2.PullRequest(), pools={}, check_reply=check)
