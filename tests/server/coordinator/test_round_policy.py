"""Tests for server.coordinator.round_policy: the registry and the two policies."""

from __future__ import annotations

import math
from collections.abc import Set

import pytest

from fedps.config import TrainingConfig
from fedps.errors import ConfigError
from server.coordinator.round_policy import (
    AsyncBuffers,
    RoundPolicy,
    SyncRounds,
    create_round_policy,
    register_round_policy,
)

COHORT = frozenset({"a", "b", "c", "d"})


def test_the_registry_picks_by_name_and_names_the_choices() -> None:
    # Prepare
    training = TrainingConfig(mode="async", buffer_size=3, min_quorum=2)

    # Execute / Assert
    assert isinstance(create_round_policy("sync", training), SyncRounds)
    assert isinstance(create_round_policy("async", training), AsyncBuffers)
    with pytest.raises(ConfigError, match=r"unknown round policy 'fedfoo'.*'async', 'sync'"):
        create_round_policy("fedfoo", training)
    with pytest.raises(ValueError, match="already registered"):
        register_round_policy("sync", AsyncBuffers)


def test_a_registered_policy_can_be_created() -> None:
    # Prepare
    class Everyone(SyncRounds):
        def commitments_complete(
            self, cohort: Set[str], committed: Set[str], reported: Set[str]
        ) -> bool:
            return False

    # Execute
    register_round_policy("test-everyone", Everyone)
    policy: RoundPolicy = create_round_policy("test-everyone", TrainingConfig())

    # Assert
    assert isinstance(policy, Everyone)


def test_sync_rounds_wait_for_the_cohort_until_the_deadline() -> None:
    # Prepare
    policy = SyncRounds(TrainingConfig(min_quorum=2, deadline_s=30.0))

    # Execute / Assert
    assert policy.min_quorum == 2
    assert policy.commit_deadline(100.0) == 130.0
    assert not policy.commitments_complete(COHORT, {"a", "b", "c"}, set())
    assert policy.commitments_complete(COHORT, {"a", "b", "c"}, {"d"})  # d: nothing to send
    assert policy.commitments_complete(COHORT, set(COHORT), set())


def test_async_buffers_have_no_deadline_and_flush_at_k() -> None:
    # Prepare
    policy = AsyncBuffers(TrainingConfig(mode="async", min_quorum=2, buffer_size=3))

    # Execute / Assert
    assert policy.min_quorum == 3
    assert policy.commit_deadline(100.0) == math.inf
    assert not policy.commitments_complete(COHORT, {"a", "b"}, {"c", "d"})
    assert policy.commitments_complete(COHORT, {"a", "b", "c"}, set())
