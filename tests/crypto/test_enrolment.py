"""Tests for enrolment tokens (crypto/enrolment.py): only the key's holder makes them, a token
proves exactly one identity, and the files are private."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.enrolment import (
    ENROLMENT_KEY_FILE,
    create_enrolment_key,
    issue_token,
    issue_tokens,
    load_enrolment_key,
    read_token,
    verify_token,
)
from fedps.errors import ConfigError, CorruptStateError, UnauthenticatedError

_KEY = bytes(range(32))
_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}", fullmatch=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@given(_names)
def test_a_token_proves_its_name(name: str) -> None:
    # Execute
    token = issue_token(_KEY, name)

    # Assert
    assert token.startswith(f"{name}.")
    assert verify_token(_KEY, token) == name


@given(_names, st.binary(min_size=32, max_size=32).filter(lambda k: k != _KEY))
def test_a_token_of_another_key_is_refused(name: str, other: bytes) -> None:
    with pytest.raises(UnauthenticatedError, match="not issued by this deployment"):
        verify_token(_KEY, issue_token(other, name))


def test_a_mac_does_not_carry_over_to_another_name() -> None:
    # Prepare
    mac = issue_token(_KEY, "client-0").rpartition(".")[2]

    # Execute / Assert
    with pytest.raises(UnauthenticatedError):
        verify_token(_KEY, f"client-1.{mac}")


@pytest.mark.parametrize(
    "token",
    [
        "",
        "client-0",
        "client-0.",
        ".00",
        "client-0." + "0" * 63,
        "client-0." + "g" * 64,
        "client/0." + "0" * 64,
        "a.b." + "0" * 64,
        "x" * 300,
    ],
)
def test_malformed_tokens_are_refused(token: str) -> None:
    with pytest.raises(UnauthenticatedError, match="malformed"):
        verify_token(_KEY, token)


def test_changed_tokens_are_refused() -> None:
    # Prepare
    token = issue_token(_KEY, "client-0")
    name, _, mac = token.rpartition(".")

    # Execute / Assert: case, whitespace and one changed digit
    for changed in [token.upper(), f"{name}.{mac.upper()}", f" {token}", f"{token}\n"]:
        with pytest.raises(UnauthenticatedError):
            verify_token(_KEY, changed)
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    with pytest.raises(UnauthenticatedError):
        verify_token(_KEY, f"{name}.{flipped}")


def test_the_error_never_repeats_the_token() -> None:
    token = issue_token(b"\x02" * 32, "client-0")

    with pytest.raises(UnauthenticatedError) as info:
        verify_token(_KEY, token)

    assert token.rpartition(".")[2] not in str(info.value)


def test_issue_token_refuses_names_that_are_no_identity() -> None:
    for name in ["", "a.b", "../x", "client 0", "-client"]:
        with pytest.raises(ValueError, match="invalid identity name"):
            issue_token(_KEY, name)


def test_tokens_and_key_are_private_and_the_key_is_kept(tmp_path: Path, loose_umask: None) -> None:
    # Execute: two runs, as `fedps certs` twice
    first = issue_tokens(tmp_path / "certs", ["client-0", "client-1"])
    key = load_enrolment_key(tmp_path / "certs")
    again = issue_tokens(tmp_path / "certs", ["client-0"])

    # Assert: 0600 files; the key survives the second run, so tokens already handed out stay
    # valid (the same token is written again)
    assert [p.name for p in first] == ["client-0.token", "client-1.token"]
    assert _mode(tmp_path / "certs" / ENROLMENT_KEY_FILE) == 0o600
    assert all(_mode(p) == 0o600 for p in first)
    assert len(key) == 32
    assert load_enrolment_key(tmp_path / "certs") == key
    assert again[0].read_text() == first[0].read_text()
    token = read_token(tmp_path / "certs", "client-1")
    assert token is not None and verify_token(key, token) == "client-1"


def test_read_token_of_a_missing_file_is_none(tmp_path: Path) -> None:
    assert read_token(tmp_path, "client-0") is None


def test_readable_secrets_are_refused(tmp_path: Path) -> None:
    # Prepare
    issue_tokens(tmp_path, ["client-0"])
    (tmp_path / "client-0.token").chmod(0o644)
    (tmp_path / ENROLMENT_KEY_FILE).chmod(0o640)

    # Execute / Assert
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token(tmp_path, "client-0")
    with pytest.raises(ConfigError, match="chmod 600"):
        load_enrolment_key(tmp_path)


def test_missing_or_short_key_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"enrolment\.key not found.*fedps certs"):
        load_enrolment_key(tmp_path)
    path = create_enrolment_key(tmp_path)
    path.write_bytes(b"short")
    with pytest.raises(CorruptStateError, match="5 bytes, not 32"):
        load_enrolment_key(tmp_path)
