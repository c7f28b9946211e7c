"""The key holder's state folder: its state file and its keys, read and written in one place.

The state file (``keyholder-state.npz``) holds arrays: the model (``params``), the server
optimizer's state (``opt_*``), the mixed policy's (``groups_*``), and ``meta``, UTF-8 JSON with
the model version, the last applied round, every released result, the refused rounds, the
detections by shard and reason, the blamed clients, and the key generation in use with the
round before which it was made. It is a checked state file
(:func:`crypto.files.write_checked`): replaced atomically, so a crash leaves the previous state
or the new one, and verified against its SHA-256 at load, so a damaged file stops the key
holder (:class:`~fedps.errors.CorruptStateError`, one line naming the file and what to do)
instead of starting over. A state file written before the checked format is loaded once
unchecked and rewritten at the next save.

The keys live in ``keys/``: the CKKS key pair (the secret key mode 0600,
:class:`crypto.SecretContext`), the key that signs every published model block (with its
public half in ``signing.pub`` for shards and clients) and the secret behind the commitment
challenges. A first start (no state file) creates them; a key holder that has a state file
and misses one of its keys stops, naming it: a key made anew in its place would silently
break what the old one protects.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
import zipfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from crypto import CkksParams, SecretContext
from crypto.files import (
    check_key,
    read_checked,
    write_atomic,
    write_checked,
    write_key,
)
from crypto.secret_context import SECRET_KEY_FILE
from crypto.signing import BlockSigner
from fedps.errors import CorruptStateError
from server.keyholder.global_model import ModelSnapshot
from server.keyholder.joint_keys import JointKeys
from server.keyholder.keyholder_settings import KeyHolderSettings

__all__ = ["STATE_FILE", "KeyHolderState", "RoundResult", "StateStore", "saved_version"]

_log = logging.getLogger("fedps")

#: The state file's name in the key holder's state folder.
STATE_FILE = "keyholder-state.npz"
_WHAT = "the key holder state"
_HINT = (
    f"restore {STATE_FILE} from a backup; without it the run cannot continue (docs/operations.md)"
)
#: A state file written before the quorum's one name: its results' old field name
_OLD_FIELDS = {"min_contributors": "fewest_contributors"}
#: What the loss of each key of a key holder that already has state means.
_LOST_KEYS = {
    SECRET_KEY_FILE: (
        "the secret key of this run is lost, and every ciphertext not yet decrypted with it; "
        "start a new run"
    ),
    "signing.key": (
        "the key that signs every published model is lost, and a new one would not match the "
        "signing.pub that shards and clients verify against; restore it from a backup, or "
        "start a new run"
    ),
    "challenge.key": (
        "the key behind the commitment challenges is lost, and a new one would fail every "
        "commitment of the rounds now open; restore it from a backup, or start a new run"
    ),
}


@dataclass(frozen=True)
class RoundResult:
    """What applying one round produced (cached: a repeated request gets the same result)."""

    round: int
    version: int
    fewest_contributors: int
    total_weight: float
    update_norm: float
    #: False: a flush that left the synchronous parameter groups as they were
    sync_groups_applied: bool = True
    #: every contributing client with its effective weight (weight x staleness multiplier)
    contributors: dict[str, float] = field(default_factory=dict)
    #: client level: the noise multiplier of the released sum (shares plus top-up); else 0
    noise_multiplier: float = 0.0
    #: client level: the std per value of the noise the key holder added to the sum
    top_up_std: float = 0.0


@dataclass(frozen=True)
class KeyHolderState:
    """Everything of the key holder that survives a restart, but its keys."""

    model: ModelSnapshot  # the parameters, version, last round, optimizer and policy state
    released: dict[int, RoundResult]
    refused: set[int]  # rounds whose check failed: never decrypted
    detections: dict[str, dict[str, int]]  # detected tamperings by shard, then by reason
    blamed: dict[str, str]  # clients proven guilty, with what they did
    #: the context id of the key pair in use when the state was saved (None: a state saved
    #: before keys rotated) and the last round applied before that pair was made
    key_context: str | None
    key_since: int
    saved_at: float = 0.0  # Unix time of the save (a loaded state: the file's mtime)

    def key_since_for(self, context_id: str) -> int:
        """The last round applied before the key pair ``context_id`` (the one loaded) was made.

        The state is saved before the keys rotate: keys of another context than the state names were
        made after its last round; a state that names none predates rotation (count from 0).
        """
        if self.key_context is None:
            return 0
        if self.key_context != context_id:
            return self.model.last_round
        return self.key_since


class StateStore:
    """Reads and writes the key holder's state folder ``directory``.

    Nothing happens before a method is called.

    Parameters
    ----------
    directory
        The key holder's state folder (private, 0700).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE
        self.keys_dir = directory / "keys"

    # ------------------------------------------------------------------ the state file
    def save(self, state: KeyHolderState) -> float:
        """Replace the state file with ``state``, atomically; returns the time it was saved.

        Raises
        ------
        OSError
            The file cannot be written (the previous one is left as it was).
        """
        model = state.model
        assert model.params is not None
        meta = {
            "version": model.version,
            "last_round": model.last_round,
            "released": {str(k): asdict(v) for k, v in state.released.items()},
            "refused": sorted(state.refused),
            "detections": state.detections,
            "blamed": state.blamed,
            "key_context": state.key_context,
            "key_since": state.key_since,
        }
        arrays: dict[str, np.ndarray] = {
            "params": model.params,
            "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        }
        arrays.update({f"opt_{k}": v for k, v in model.optimizer.items()})
        arrays.update({f"groups_{k}": v for k, v in model.groups.items()})
        buffer = io.BytesIO()
        np.savez(buffer, *[], **arrays)  # type: ignore[arg-type]
        write_checked(self.path, buffer.getbuffer())
        return time.time()

    def load(self) -> KeyHolderState | None:
        """The saved state, or None when there is none.

        Raises
        ------
        CorruptStateError
            The file is damaged (checksum, truncation) or does not hold a key holder's state.
        """
        raw = _read_state(self.path)
        if raw is None:
            return None
        try:
            with np.load(io.BytesIO(raw)) as data:
                meta = json.loads(bytes(data["meta"]).decode())
                params = data["params"]
                optimizer = {k[4:]: data[k] for k in data.files if k.startswith("opt_")}
                groups = {k[7:]: data[k] for k in data.files if k.startswith("groups_")}
            context = meta.get("key_context")
            model = ModelSnapshot(
                params, int(meta["version"]), int(meta["last_round"]), optimizer, groups
            )
            state = KeyHolderState(
                model=model,
                released={
                    int(k): RoundResult(**{_OLD_FIELDS.get(f, f): x for f, x in v.items()})
                    for k, v in meta["released"].items()
                },
                refused={int(r) for r in meta.get("refused", [])},
                detections={
                    str(shard): {str(k): int(v) for k, v in reasons.items()}
                    for shard, reasons in meta.get("detections", {}).items()
                },
                blamed={str(c): str(why) for c, why in meta.get("blamed", {}).items()},
                key_context=None if context is None else str(context),
                key_since=0 if context is None else int(meta["key_since"]),
                saved_at=self.path.stat().st_mtime,
            )
        except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
            raise _corrupt(self.path, exc) from exc
        _log.info("key holder resumed at version %d (round %d)", model.version, model.last_round)
        return state

    # ------------------------------------------------------------------ the keys
    def open_keys(self, params: CkksParams) -> tuple[SecretContext, BlockSigner, bytes]:
        """The CKKS key pair, the signing key and the challenge secret, created on a first start.

        ``signing.pub`` is written beside them.

        Raises
        ------
        CorruptStateError
            A key of a key holder that already has state is missing (one line naming it and
            what to do), or the challenge secret is damaged.
        """
        self._require_keys()
        keys = SecretContext.load_or_generate(self.keys_dir, params)
        signer, challenge_secret = self.open_secrets()
        return keys, signer, challenge_secret

    def open_key_material(
        self, settings: KeyHolderSettings, parties: Mapping[int, str] | None = None
    ) -> tuple[SecretContext | JointKeys, BlockSigner, bytes]:
        """The keys a key holder decrypts with, its signing key and its challenge secret.

        The CKKS key pair (:meth:`open_keys`), or with ``settings.parties`` above 1 the parties'
        joint keys (:class:`~.joint_keys.JointKeys`, at ``parties``: ``{index: address}``): a
        combiner holds no secret key.

        Raises
        ------
        CorruptStateError
            As :meth:`open_keys`.
        """
        if settings.parties <= 1:
            return self.open_keys(settings.params)
        signer, challenge_secret = self.open_secrets(require_key=False)
        keys = JointKeys.open(
            self.keys_dir,
            parties or {},
            params=settings.params,
            threshold=settings.threshold,
            signer=signer,
            lambda_bits=settings.lambda_bits,
        )
        return keys, signer, challenge_secret

    def open_secrets(self, *, require_key: bool = True) -> tuple[BlockSigner, bytes]:
        """The signing key and the challenge secret, created on a first start.

        ``signing.pub`` is written beside them. ``require_key=False``: a combiner of key-holder
        parties, which has no secret key of its own (the other keys are still required).

        Raises
        ------
        CorruptStateError
            As :meth:`open_keys`.
        """
        self._require_keys(skip=() if require_key else (SECRET_KEY_FILE,))
        challenge_secret = _load_or_create_secret(self.keys_dir / "challenge.key")
        signer = BlockSigner.load_or_create(self.keys_dir / "signing.key")
        write_atomic(self.keys_dir / "signing.pub", signer.public_key.hex().encode() + b"\n")
        return signer, challenge_secret

    def save_keys(self, keys: SecretContext) -> None:
        """Replace the CKKS key pair with ``keys``, in one step (:meth:`SecretContext.save`).

        Raises
        ------
        OSError
            The pair cannot be written (the current pair is left whole).
        """
        keys.save(self.keys_dir)

    def _require_keys(self, skip: tuple[str, ...] = ()) -> None:
        """Stop when a key of a key holder that already has state is missing.

        On a first start (no state) the keys are created; the keys named in ``skip`` are not
        required.
        """
        if not self.path.exists():
            return
        for name, lost in _LOST_KEYS.items():
            if name in skip:
                continue
            key = self.keys_dir / name
            if not key.exists():
                raise CorruptStateError(
                    f"{key} is missing but {self.path} exists: {lost} (docs/operations.md)"
                )


def saved_version(state_dir: Path) -> int | None:
    """The model version last applied by the key holder whose state folder is ``state_dir``.

    From its state file; None when it saved none.

    Raises
    ------
    CorruptStateError
        The file is damaged or holds no version.
    """
    path = state_dir / STATE_FILE
    raw = _read_state(path)
    if raw is None:
        return None
    try:
        with np.load(io.BytesIO(raw)) as data:
            return int(json.loads(bytes(data["meta"]).decode())["version"])
    except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
        raise _corrupt(path, exc) from exc


def _read_state(path: Path) -> bytes | None:
    """The key holder's state file, checked (None when there is none).

    Raises
    ------
    CorruptStateError
        The file is damaged.
    """
    return read_checked(path, what=_WHAT, hint=_HINT, legacy_prefix=b"PK\x03\x04")


def _corrupt(path: Path, exc: Exception) -> CorruptStateError:
    """The error for a state file that passed its checksum but cannot be read."""
    return CorruptStateError(f"{path}: {_WHAT} cannot be read ({exc}); {_HINT}")


def _load_or_create_secret(path: Path) -> bytes:
    """A 32-byte secret kept in a 0600 file.

    Created on first use, see :meth:`StateStore.open_keys`.

    Raises
    ------
    CorruptStateError
        The file does not hold 32 bytes.
    """
    if path.exists():
        secret = path.read_bytes()
        check_key(path, secret, size=32, what="key")
        return secret
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = os.urandom(32)
    write_key(path, secret, exclusive=True)
    return secret
