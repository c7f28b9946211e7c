"""The payloads fedps's Flower integration carries in Flower messages.

The Flower strategy (:mod:`server.flower.flower_strategy`) and the Flower client
(:mod:`clients.flower.flower_client`) speak the coordinator's client protocol over Flower messages.
This module holds what both ends must agree on, as plain mappings of Flower's record values
(``int``, ``float``, ``str``, ``bytes``), so that it imports neither Flower nor a role.

Every fedps message is a Flower ``train`` message whose ``"fedps"`` ConfigRecord names its
stage (``"stage"``), as Flower's SecAgg+ carries its stages: a ``ClientApp`` routes a message
only to a function registered for its type, so a mod around a user's own ``train``
(:class:`clients.flower.fedps_mod.FedPSMod`) sees every stage without the user registering
anything else.

``register`` (:data:`REGISTER_STAGE`)
    Node to strategy: :class:`Registration` (public signing key, examples, model size, and
    the enrolment token that proves the node's identity).
``train`` (:data:`TRAIN_STAGE`)
    Strategy to node: :class:`FlowerTask`; node to strategy: :class:`RoundReport`, metadata
    only. The node trains, encrypts and commits its update at the key holder
    (``trained``: committed), but pushes nothing yet.
``push`` (:data:`PUSH_STAGE`)
    Strategy to node, once the key holder froze the round's commitments and the shards take
    pushes: the same :class:`FlowerTask`; the node pushes the update it committed and
    answers with its :class:`RoundReport`. No message ever carries a model update, in
    plaintext or encrypted: updates go to the shards over fedps's own gRPC.

Every parser (``from_record``, ``from_metrics``) checks what it reads and raises
:class:`~fedps.errors.InvalidArgumentError`, naming the key, when a field is missing or of the
wrong type, a count is negative or a real is not finite: a payload is never half-parsed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from fedps.errors import InvalidArgumentError

__all__ = [
    "CONFIG_KEY",
    "METRICS_KEY",
    "PUSH_STAGE",
    "RECORD_KEY",
    "REGISTER_STAGE",
    "STAGES",
    "STAGE_KEY",
    "TRAIN_STAGE",
    "FlowerTask",
    "Registration",
    "RoundReport",
    "stage_of",
]

#: The key of the stage in the ``"fedps"`` ConfigRecord of every fedps message.
STAGE_KEY = "stage"
#: The stage that asks a node for its registration.
REGISTER_STAGE = "register"
#: The stage that asks a node to train, encrypt and commit (carries a :class:`FlowerTask`).
TRAIN_STAGE = "train"
#: The stage that asks a committed node to push (carries the same :class:`FlowerTask`).
PUSH_STAGE = "push"
#: Every stage, in the order a round walks them.
STAGES = (REGISTER_STAGE, TRAIN_STAGE, PUSH_STAGE)
#: The ConfigRecord holding fedps's task, registration and node state.
RECORD_KEY = "fedps"
#: The MetricRecord of a train reply.
METRICS_KEY = "metrics"
#: The run-config key naming the fedps TOML file (``[tool.flwr.app.config]``).
CONFIG_KEY = "fedps-config"

_Values = Mapping[str, object]


def _field(values: _Values, key: str, kind: type[object]) -> object:
    value = values.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise InvalidArgumentError(f"fedps record: {key!r} must be {kind.__name__}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgumentError(f"fedps record: {key!r} must be finite")
    return value


def _int(values: _Values, key: str) -> int:
    value = _field(values, key, int)
    assert isinstance(value, int)
    if value < 0:
        raise InvalidArgumentError(f"fedps record: {key!r} must be >= 0")
    return value


def _float(values: _Values, key: str) -> float:
    value = _field(values, key, float)
    assert isinstance(value, float)
    return value


def _str(values: _Values, key: str) -> str:
    value = _field(values, key, str)
    assert isinstance(value, str)
    return value


def stage_of(values: _Values) -> str:
    """The stage a fedps record names (one of :data:`STAGES`)."""
    stage = _str(values, STAGE_KEY)
    if stage not in STAGES:
        raise InvalidArgumentError(
            f"fedps record: {STAGE_KEY!r} must be one of {', '.join(STAGES)}, got {stage!r}"
        )
    return stage


@dataclass(frozen=True)
class Registration:
    """A node introduces itself.

    It sends the key that signs its updates, its data and model size, and its enrolment token (its
    identity ``client-N``, issued by ``fedps certs``; kept out of ``repr``).
    """

    signing_key: bytes
    name: str
    num_examples: int
    num_params: int
    enrolment_token: str = field(default="", repr=False)

    def to_record(self) -> dict[str, int | str | bytes]:
        """The ConfigRecord values."""
        return {
            "signing-key": self.signing_key,
            "name": self.name,
            "num-examples": self.num_examples,
            "num-params": self.num_params,
            "enrolment-token": self.enrolment_token,
        }

    @classmethod
    def from_record(cls, values: _Values) -> Registration:
        """Parse a node's registration reply (a node that sent no token gets ``""``)."""
        key = _field(values, "signing-key", bytes)
        assert isinstance(key, bytes)
        token = _str(values, "enrolment-token") if "enrolment-token" in values else ""
        return cls(
            key,
            _str(values, "name"),
            _int(values, "num-examples"),
            _int(values, "num-params"),
            enrolment_token=token,
        )


@dataclass(frozen=True)
class FlowerTask:
    """The coordinator's ``TRAIN`` task for one node, with the identity it registered."""

    round: int
    version: int
    deadline_unix: float
    weight_scale: float
    context_id: str
    client_id: str
    run_id: str

    def to_record(self) -> dict[str, int | float | str]:
        """The ConfigRecord values."""
        return {
            "round": self.round,
            "version": self.version,
            "deadline": self.deadline_unix,
            "weight-scale": self.weight_scale,
            "context-id": self.context_id,
            "client-id": self.client_id,
            "run-id": self.run_id,
        }

    @classmethod
    def from_record(cls, values: _Values) -> FlowerTask:
        """Parse the task of a train or push message (``deadline`` is Unix seconds)."""
        return cls(
            round=_int(values, "round"),
            version=_int(values, "version"),
            deadline_unix=_float(values, "deadline"),
            weight_scale=_float(values, "weight-scale"),
            context_id=_str(values, "context-id"),
            client_id=_str(values, "client-id"),
            run_id=_str(values, "run-id"),
        )


@dataclass(frozen=True)
class RoundReport:
    """What a node reports after a train message (never the update)."""

    round: int
    trained: bool
    bytes_pushed: int
    budget_exhausted: bool
    weight: float
    epsilon: float
    delta: float
    num_examples: int

    def to_metrics(self) -> dict[str, int | float]:
        """The MetricRecord values (``num-examples`` is Flower's weighting convention)."""
        values = asdict(self)
        return {
            k.replace("_", "-"): int(v) if isinstance(v, bool) else v for k, v in values.items()
        }

    @classmethod
    def from_metrics(cls, values: _Values) -> RoundReport:
        """Parse a train reply's metrics (flags travel as ``0``/``1``, see :meth:`to_metrics`)."""
        return cls(
            round=_int(values, "round"),
            trained=bool(_int(values, "trained")),
            bytes_pushed=_int(values, "bytes-pushed"),
            budget_exhausted=bool(_int(values, "budget-exhausted")),
            weight=_float(values, "weight"),
            epsilon=_float(values, "epsilon"),
            delta=_float(values, "delta"),
            num_examples=_int(values, "num-examples"),
        )
