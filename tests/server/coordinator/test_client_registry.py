"""Tests for server.coordinator.client_registry: identities, credentials, liveness, spend."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from crypto.enrolment import create_enrolment_key, issue_token, load_enrolment_key
from crypto.signing import BlockSigner
from fedps.config import PrivacyConfig, TlsConfig, TrainingConfig, load_config
from fedps.errors import ConfigError, InvalidArgumentError, UnauthenticatedError, UnknownClientError
from fedps.learning.accounting import epsilon
from server.coordinator import client_registry
from server.coordinator.client_registry import ClientRegistry
from server.coordinator.privacy_ledger import Declaration, PrivacyLedger

NUM_PARAMS = 10
DELTA = 1e-5


@pytest.fixture
def tls(tmp_path: Path) -> TlsConfig:
    """TLS off: enrolment tokens are the proof of identity."""
    create_enrolment_key(tmp_path)
    return _tls(tmp_path)


def _tls(directory: Path) -> TlsConfig:
    return load_config(None, tls={"insecure": True, "directory": str(directory)}).tls


@pytest.fixture
def registry(tls: TlsConfig) -> ClientRegistry:
    return ClientRegistry(tls, num_params=NUM_PARAMS, liveness_s=60.0)


def _register(
    registry: ClientRegistry, identity: str = "client-0", *, epsilon: float = 0.0
) -> tuple[str, bytes]:
    return registry.register(
        "edge",
        100,
        NUM_PARAMS,
        BlockSigner().public_key,
        identity=identity,
        epsilon=epsilon,
        delta=DELTA,
    )


def test_a_token_proves_the_identity_and_a_restart_keeps_the_id(
    registry: ClientRegistry, tls: TlsConfig
) -> None:
    # Prepare
    token = issue_token(load_enrolment_key(tls.directory), "client-7")
    first_key, second_key = BlockSigner().public_key, BlockSigner().public_key

    # Execute: the client registers, restarts (new signing key) and registers again
    client_id, first = registry.register("a", 5, NUM_PARAMS, first_key, enrolment_token=token)
    again, second = registry.register("b", 6, NUM_PARAMS, second_key, enrolment_token=token)

    # Assert: one client, the latest key and credential; the old credential is refused
    assert client_id == again == "client-7"
    assert list(registry.clients) == ["client-7"]
    assert registry.clients["client-7"].signing_key == second_key.hex()
    assert registry.clients["client-7"].num_examples == 6
    registry.check_in("client-7", second, epsilon=0.0, delta=DELTA)
    with pytest.raises(UnauthenticatedError):
        registry.check_in("client-7", first, epsilon=0.0, delta=DELTA)


def test_registration_without_identity_or_with_a_bad_model_is_refused(
    registry: ClientRegistry,
) -> None:
    key = BlockSigner().public_key

    # Execute / Assert
    with pytest.raises(UnauthenticatedError, match="enrolment token"):
        registry.register("a", 5, NUM_PARAMS, key)
    with pytest.raises(InvalidArgumentError, match="parameters"):
        registry.register("a", 5, NUM_PARAMS + 1, key, identity="client-0")
    with pytest.raises(InvalidArgumentError, match="signing key"):
        registry.register("a", 5, NUM_PARAMS, bytes(32), identity="client-0")
    with pytest.raises(InvalidArgumentError, match="example"):
        registry.register("a", 0, NUM_PARAMS, key, identity="client-0")
    assert len(registry) == 0


def test_without_tls_a_missing_enrolment_key_is_a_clear_error(tmp_path: Path) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match="enrolment"):
        ClientRegistry(_tls(tmp_path), num_params=1, liveness_s=1)


def test_unknown_ids_and_wrong_credentials_are_refused(registry: ClientRegistry) -> None:
    # Prepare
    _register(registry)

    # Execute / Assert
    with pytest.raises(UnknownClientError):
        registry.check_in("mallory", b"x", epsilon=0.0, delta=DELTA)
    with pytest.raises(UnauthenticatedError):
        registry.check_in("client-0", b"", epsilon=0.0, delta=DELTA)
    with pytest.raises(UnauthenticatedError):
        registry.record_report(
            "client-0",
            b"wrong",
            epsilon=0.0,
            delta=DELTA,
            bytes_pushed=0,
            budget_exhausted=False,
        )


def test_spend_and_traffic_are_kept_and_survive_a_state_round_trip(
    registry: ClientRegistry, tls: TlsConfig
) -> None:
    # Prepare
    _, credential = _register(registry, epsilon=1.0)
    _, other = _register(registry, "client-1")

    # Execute
    registry.check_in("client-0", credential, epsilon=3.0, delta=DELTA)
    registry.record_report(
        "client-0", credential, epsilon=2.0, delta=DELTA, bytes_pushed=100, budget_exhausted=True
    )
    registry.record_report(
        "client-1", other, epsilon=0.5, delta=DELTA, bytes_pushed=20, budget_exhausted=False
    )
    restored = ClientRegistry(tls, num_params=NUM_PARAMS, liveness_s=60.0)
    restored.load_state_dict(registry.state_dict())

    # Assert
    for r in (registry, restored):
        assert r.max_epsilon == (3.0, DELTA)
        assert r.client_epsilons == {"client-0": 3.0, "client-1": 0.5}
        assert r.bytes_pushed == 120
        assert r.client_rounds == {"client-0": 1, "client-1": 1}
        assert r.usable() == 1
        assert r.live() == ["client-1"]  # an exhausted client is never live
    with pytest.raises(InvalidArgumentError, match="bytes_pushed"):
        registry.record_report(
            "client-1", other, epsilon=0.5, delta=DELTA, bytes_pushed=-1, budget_exhausted=False
        )


def test_a_client_not_heard_from_is_not_live(
    tls: TlsConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the registry's clock is the test's, so that a loaded machine's pauses between
    # two lines cannot make a client that just checked in look silent
    now = [time.time()]  # a new entry's last_seen is read from the real clock
    monkeypatch.setattr(client_registry, "time", SimpleNamespace(time=lambda: now[0]))
    registry = ClientRegistry(tls, num_params=NUM_PARAMS, liveness_s=60.0)
    _, credential = _register(registry)

    # Execute
    now[0] += 61.0
    silent = registry.live()
    registry.check_in("client-0", credential, epsilon=0.0, delta=DELTA)

    # Assert
    assert silent == []
    assert registry.live() == ["client-0"]


def test_cohort_views(registry: ClientRegistry) -> None:
    # Prepare
    registry.register("a", 30, NUM_PARAMS, BlockSigner().public_key, identity="b")
    key = BlockSigner().public_key
    registry.register("b", 70, NUM_PARAMS, key, identity="a")

    # Execute
    keys = registry.signing_keys({"b", "a"})

    # Assert: sorted by client id, the keys as registered
    assert list(keys) == ["a", "b"]
    assert keys["a"] == key
    assert registry.most_examples({"a", "b"}) == 70
    assert registry.most_examples({"b"}) == 30


def test_a_cohort_member_that_missed_a_deadline_is_not_live_until_it_asks_again(
    registry: ClientRegistry,
) -> None:
    # Prepare: three live clients, each last heard from before the round's deadline
    credentials = {
        cid: cred for cid, cred in (_register(registry, f"client-{i}") for i in range(3))
    }
    deadline = time.time() + 60.0

    # Execute: client-2 never reported; then it asks for a task again
    registry.mark_missed(["client-2"], deadline=deadline)
    while_missing = sorted(registry.live())
    registry.check_in("client-2", credentials["client-2"], epsilon=0.0, delta=DELTA)

    # Assert: left out of the draw until it asked again
    assert while_missing == ["client-0", "client-1"]
    assert sorted(registry.live()) == ["client-0", "client-1", "client-2"]


def test_a_missed_deadline_is_forgiven_by_a_registration_and_not_held_against_the_heard(
    registry: ClientRegistry,
) -> None:
    # Prepare
    for i in range(2):
        _register(registry, f"client-{i}")
    passed = time.time() - 60.0  # both were heard from after this deadline

    # Execute
    registry.mark_missed(["client-0", "client-1", "nobody"], deadline=passed)
    heard_after = sorted(registry.live())
    registry.mark_missed(["client-0"], deadline=time.time() + 60.0)
    missing = sorted(registry.live())
    _register(registry, "client-0")  # a restarted client registers again

    # Assert
    assert heard_after == ["client-0", "client-1"]
    assert missing == ["client-1"]
    assert sorted(registry.live()) == ["client-0", "client-1"]


A = Declaration("source-a", 1.1, 0.05, 20)


def _with_ledger(tls: TlsConfig, state_dir: Path, target: float | None = None) -> ClientRegistry:
    privacy = PrivacyConfig(target_epsilon=target, noise_multiplier=None if target else 1.0)
    ledger = PrivacyLedger.open(state_dir, privacy=privacy, training=TrainingConfig(), fsync=False)
    return ClientRegistry(tls, num_params=NUM_PARAMS, liveness_s=60.0, ledger=ledger)


def _released(registry: ClientRegistry, round_: int, *who: str) -> None:
    assert registry.ledger is not None
    declared = registry.declarations(who)
    registry.ledger.record_round("run", round_, contributors=declared, members=declared)


@pytest.mark.privacy
def test_with_the_server_ledger_a_client_cannot_lower_its_figure(
    tls: TlsConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: client-0 declared A and took part in three released rounds
    registry = _with_ledger(tls, tmp_path / "coordinator")
    registry.register(
        "edge", 100, NUM_PARAMS, BlockSigner().public_key, identity="client-0", declared=A
    )
    for round_ in (1, 2, 3):
        _released(registry, round_, "client-0")
    server = epsilon(1.1, 0.05, 60, DELTA)

    # Execute: it registers again with a new key, on a fresh ledger of its own (epsilon 0)
    with caplog.at_level(logging.WARNING, logger="fedps"):
        _register(registry, "client-0", epsilon=0.0)

    # Assert: the server's figure stands; the operator is told twice (key, lower spend)
    assert registry.client_epsilons == {"client-0": server}
    assert registry.max_epsilon == (server, DELTA)
    assert registry.reported_epsilons == {"client-0": 0.0}
    assert [w.split(" ", 3)[:3] for w in registry.warnings] == [
        ["client-0", "registered", "with"],
        ["client-0", "registered", "with"],
    ]
    assert "new signing key" in registry.warnings[0]
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "epsilon 0.0000" in registry.warnings[1] and len(warned) == 2
    # a client that says more than the server's ledger is reported with its own figure
    registry.check_in(
        "client-0", _register(registry, "client-0", epsilon=9.0)[1], epsilon=9.0, delta=DELTA
    )
    assert registry.client_epsilons == {"client-0": 9.0}


@pytest.mark.privacy
def test_a_client_the_server_ledger_says_is_spent_is_not_live(
    tls: TlsConfig, tmp_path: Path
) -> None:
    # Prepare: a target two rounds of A stay under and three do not
    target = (epsilon(1.1, 0.05, 40, DELTA) + epsilon(1.1, 0.05, 60, DELTA)) / 2
    registry = _with_ledger(tls, tmp_path / "coordinator", target)
    for identity in ("client-0", "client-1"):
        registry.register(
            "edge", 100, NUM_PARAMS, BlockSigner().public_key, identity=identity, declared=A
        )

    # Execute
    _released(registry, 1, "client-0", "client-1")
    before = (sorted(registry.live()), registry.usable())
    _released(registry, 2, "client-0")

    # Assert: client-0's own figure says nothing (0), the server's ledger stops it
    assert before == (["client-0", "client-1"], 2)
    assert registry.live() == ["client-1"] and registry.usable() == 1
    assert registry.spent_clients() == ["client-0"]
    assert registry.spent_out("client-0") and not registry.spent_out("client-9")


def test_a_declaration_no_accountant_can_compose_is_refused(registry: ClientRegistry) -> None:
    with pytest.raises(InvalidArgumentError, match="declared"):
        registry.register(
            "edge",
            100,
            NUM_PARAMS,
            BlockSigner().public_key,
            identity="client-0",
            declared=Declaration("s", -1.0, 0.1, 3),
        )
