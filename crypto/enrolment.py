"""Enrolment tokens: how a client proves a provisioned identity when TLS is off.

Under mutual TLS a client's identity is the common name of its certificate (``client-3``).
Without TLS (``--insecure``) the operator provisions identities with tokens instead: the
deployment keeps one secret, ``enrolment.key`` (32 random bytes, mode 0600, in the
certificate directory), and the token of identity NAME is ``NAME.`` followed by the hex
HMAC-SHA256 of NAME under that key. ``fedps certs`` writes ``NAME.token`` (mode 0600) for
every client; the coordinator, which holds the key, checks a token in constant time and
admits its holder as NAME. Nobody without the key can make a token, so the identities are
exactly those the operator issued.

Keys and tokens are never logged or put into an error message; only file names are.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import stat
from pathlib import Path

from crypto.files import check_key, private_directory, write_key, write_private
from fedps.errors import ConfigError, UnauthenticatedError

__all__ = [
    "ENROLMENT_KEY_FILE",
    "TOKEN_SUFFIX",
    "create_enrolment_key",
    "issue_token",
    "issue_tokens",
    "load_enrolment_key",
    "read_token",
    "verify_token",
]

#: The deployment's enrolment secret inside the certificate directory.
ENROLMENT_KEY_FILE = "enrolment.key"
#: ``NAME.token`` holds identity NAME's token.
TOKEN_SUFFIX = ".token"
_KEY_BYTES = 32
_MAX_TOKEN_CHARS = 256
# Identity names as ``fedps certs`` makes them (client-3); no dots, so a token splits once.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
_MAC = re.compile(r"[0-9a-f]{64}")


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"invalid identity name {name!r}: letters, digits, '-' and '_' only (1-63 chars)"
        )


def _mac(key: bytes, name: str) -> str:
    return hmac.new(key, name.encode("ascii"), hashlib.sha256).hexdigest()


def create_enrolment_key(directory: Path) -> Path:
    """``directory/enrolment.key``: kept if it exists, else 32 new random bytes (mode 0600).

    Keeping an existing key keeps every token issued with it valid.
    """
    private_directory(directory)
    path = directory / ENROLMENT_KEY_FILE
    if not path.exists():
        write_key(path, secrets.token_bytes(_KEY_BYTES))
    return path


def load_enrolment_key(directory: Path) -> bytes:
    """The key in ``directory/enrolment.key``.

    Raises
    ------
    ConfigError
        The file is missing (suggesting ``fedps certs``), unreadable, or readable by group or
        others.
    CorruptStateError
        It is not 32 bytes, or not the key its checksum (``enrolment.key.sha256``) was
        written for.
    """
    path = directory / ENROLMENT_KEY_FILE
    key = _read_private(path, "enrolment key")
    check_key(path, key, size=_KEY_BYTES, what="enrolment key")
    return key


def issue_token(key: bytes, name: str) -> str:
    """The token of identity ``name`` under ``key``: ``NAME.`` + hex HMAC-SHA256."""
    _check_name(name)
    return f"{name}.{_mac(key, name)}"


def verify_token(key: bytes, token: str) -> str:
    """The identity a token proves.

    Raises
    ------
    UnauthenticatedError
        The token is malformed or was not made with ``key`` (the message never repeats it).
    """
    name, _, mac = token.rpartition(".")
    if len(token) > _MAX_TOKEN_CHARS or not _NAME.fullmatch(name) or not _MAC.fullmatch(mac):
        raise UnauthenticatedError("malformed enrolment token")
    if not hmac.compare_digest(_mac(key, name), mac):
        raise UnauthenticatedError("enrolment token not issued by this deployment")
    return name


def issue_tokens(directory: Path, names: list[str]) -> list[Path]:
    """Write ``NAME.token`` (mode 0600) into ``directory`` for each name; returns the token files.

    The enrolment key is created there first if it has none.
    """
    create_enrolment_key(directory)
    key = load_enrolment_key(directory)
    written = []
    for name in names:
        path = directory / f"{name}{TOKEN_SUFFIX}"
        write_private(path, (issue_token(key, name) + "\n").encode("ascii"))
        written.append(path)
    return written


def read_token(directory: Path, name: str) -> str | None:
    """The token in ``directory/NAME.token``, or ``None`` if there is no such file.

    Raises
    ------
    ConfigError
        The file is unreadable or readable by group or others.
    """
    path = directory / f"{name}{TOKEN_SUFFIX}"
    if not path.exists():
        return None
    return _read_private(path, "enrolment token").decode("ascii", "replace").strip()


def _read_private(path: Path, what: str) -> bytes:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"{what} {path} is readable by group or others (mode {mode:o}); chmod 600 it"
            )
        return path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found; create it with `fedps certs`") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
