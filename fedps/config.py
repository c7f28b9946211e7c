"""fedps configuration: one TOML file validated into typed settings.

Every field has a default that works on one machine, so ``fedps demo`` needs no file at all.
The ``[cluster]`` table is the cluster spec (like TensorFlow's ``TF_CONFIG``): the addresses
of the key holder, the coordinator and every shard. Errors name the bad field::

    [cluster]
    keyholder = "127.0.0.1:7100"
    coordinator = "127.0.0.1:7000"
    shards = ["127.0.0.1:7201", "127.0.0.1:7202"]

    [cluster.listen]             # optional: where roles bind, when peers dial another
    keyholder = "0.0.0.0:7100"   # address (NAT, containers); each defaults to the above

    [training]
    rounds = 30
    clients = 4
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedps.compression_config import CompressionConfig
from fedps.errors import ConfigError
from fedps.metrics_config import MetricsConfig, is_loopback

__all__ = [
    "ClusterConfig",
    "CompressionConfig",
    "FedPSConfig",
    "GroupsConfig",
    "HEConfig",
    "KeyHolderConfig",
    "ListenConfig",
    "MetricsConfig",
    "PrivacyConfig",
    "SecurityConfig",
    "TlsConfig",
    "TrainingConfig",
    "is_loopback",
    "load_config",
    "read_toml",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_address(addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {addr!r} is not host:port")


class ListenConfig(_Section):
    """Where each role binds (``host:port``) when it is not the address its peers dial.

    Behind NAT, in a container or on a host with several interfaces, a role listens on one
    address (``0.0.0.0:7100``) and is dialed at another (``keyholder:7100``, a public name):
    the ``[cluster]`` addresses are the dialed ones (certificates name their hosts), these the
    bound ones. Empty (the default): the role binds the address it is dialed at.
    """

    keyholder: str = ""
    coordinator: str = ""
    shards: list[str] = Field(
        default_factory=list, description="one per shard of cluster.shards, in order (or none)"
    )
    parties: list[str] = Field(
        default_factory=list, description="one per cluster.parties (or none)"
    )

    @model_validator(mode="after")
    def _check(self) -> ListenConfig:
        for addr in [self.keyholder, self.coordinator, *self.shards, *self.parties]:
            if addr:
                _check_address(addr)
        return self


class ClusterConfig(_Section):
    """Where each role is dialed, and where it listens when that differs.

    Addresses are ``host:port``; listening addresses are in ``[cluster.listen]``.
    """

    keyholder: str = "127.0.0.1:7100"
    coordinator: str = "127.0.0.1:7000"
    shards: list[str] = Field(default_factory=lambda: ["127.0.0.1:7201", "127.0.0.1:7202"])
    parties: list[str] = Field(
        default_factory=list,
        description="one per key-holder party (keyholder.parties > 1), party 1 first",
    )
    listen: ListenConfig = Field(default_factory=ListenConfig)
    virtual_nodes: int = Field(128, ge=1, le=4096)
    shard_gone_after_s: float = Field(
        120.0,
        ge=0,
        description="a shard that leaves the coordinator's calls unanswered this long is declared "
        "gone and its blocks move to the other shards along the ring (0: never; keep it below "
        "security.max_shard_misses x security.shard_deadline_s, after which the run stops)",
    )
    standby: list[str] = Field(
        default_factory=list, description="shards (shard-N) off the ring until fedps shard --join"
    )
    state_dir: Path = Path("fedps-state")
    fsync: bool = Field(True, description="shards fsync each accepted push before acknowledging it")

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if not self.shards:
            raise ValueError("at least one shard address is required")
        if not set(self.standby) <= set(self.shard_ids) or not self.ring_ids:
            raise ValueError("standby names shards of cluster.shards (shard-N) and leaves one on")
        for addr in [self.keyholder, self.coordinator, *self.shards, *self.parties]:
            _check_address(addr)
        if len(set(self.shards)) != len(self.shards):
            raise ValueError("shard addresses must be distinct")
        if len(set(self.parties)) != len(self.parties):
            raise ValueError("party addresses must be distinct")
        if self.listen.shards and len(self.listen.shards) != len(self.shards):
            raise ValueError("listen.shards needs one address per shard (or none)")
        if self.listen.parties and len(self.listen.parties) != len(self.parties):
            raise ValueError("listen.parties needs one address per party (or none)")
        return self

    @property
    def shard_ids(self) -> list[str]:
        """Stable shard names, by position in ``shards``."""
        return [f"shard-{i}" for i in range(len(self.shards))]

    @property
    def ring_ids(self) -> list[str]:
        """The shards on the ring when the run starts (ring version 0): all but ``standby``."""
        return [sid for sid in self.shard_ids if sid not in self.standby]

    def dial_address(self, role: str, index: int = 0) -> str:
        """The address peers dial ``role`` at.

        ``role`` is ``keyholder``, ``coordinator``, ``shard`` (``index`` from 0) or ``party``
        (``index`` from 1).

        Raises
        ------
        ValueError
            An unknown role or a shard index out of range.
        """
        if role == "shard":
            if not 0 <= index < len(self.shards):
                raise ValueError(f"shard index {index} out of range [0, {len(self.shards)})")
            return self.shards[index]
        if role == "party":  # key-holder party ``index`` in 1..P
            if not 1 <= index <= len(self.parties):
                raise ValueError(f"party {index} out of range [1, {len(self.parties)}]")
            return self.parties[index - 1]
        if role not in ("keyholder", "coordinator"):
            raise ValueError(f"unknown role {role!r}: keyholder, coordinator, shard or party")
        return self.keyholder if role == "keyholder" else self.coordinator

    def listen_address(self, role: str, index: int = 0) -> str:
        """The address ``role`` binds: its ``[cluster.listen]`` entry, else its dial address.

        Raises
        ------
        ValueError
            An unknown role or a shard index out of range.
        """
        dial = self.dial_address(role, index)
        listen = self.listen
        many = {"shard": (listen.shards, index), "party": (listen.parties, index - 1)}
        if role in many:  # one address per shard or party, or none
            addresses, at = many[role]
            bound = addresses[at] if addresses else ""
        else:
            bound = listen.keyholder if role == "keyholder" else listen.coordinator
        return bound or dial


class TrainingConfig(_Section):
    """Federated training: rounds, cohort, quorum, deadline and local SGD."""

    # Plug-ins are named: a built-in or a name given to its register_* function
    # (fedps.learning.datasets.register_dataset, ...); an unknown name stops the role that uses it.
    dataset: str = Field("digits", min_length=1, description="digits | mnist5k | fashion_mnist")
    data_dir: str | None = None
    model: str = "mlp"
    partition: str = Field("iid", min_length=1, description="iid | dirichlet | shard")
    dirichlet_alpha: float = Field(0.5, gt=0)
    shards_per_client: int = Field(2, ge=1)
    rounds: int = Field(30, ge=1)
    clients: int = Field(4, ge=1, description="clients expected to register")
    cohort_size: int = Field(0, ge=0, description="clients per round (0: all registered)")
    min_quorum: int = Field(2, ge=1, description="fewest updates a round may close with")
    deadline_s: float = Field(60.0, gt=0)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.5, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1, description="clients' local SGD momentum")
    server_optimizer: str = Field("fedavg", min_length=1, description="fedavg | fedavgm | fedadam")
    server_lr: float = Field(1.0, gt=0)
    server_momentum: float = Field(0.9, ge=0, lt=1)
    eval_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(5, ge=1)
    seed: int = 0
    # Asynchronous training (FedBuff): rounds count buffer flushes.
    mode: str = Field("sync", min_length=1, description="sync | async (a round policy)")
    buffer_size: int = Field(3, ge=1, description="updates per flush (K)")
    staleness: str = Field("polynomial", min_length=1, description="constant | polynomial | hinge")
    staleness_a: float = Field(0.5, ge=0, description="polynomial exponent / hinge slope")
    staleness_b: float = Field(4.0, ge=0, description="hinge: staleness without discount")
    max_staleness: int = Field(8, ge=0, description="older updates are refused")
    # Simulated heterogeneity: this fraction of clients is slow_factor times slower.
    slow_fraction: float = Field(0.0, ge=0, le=1)
    slow_factor: float = Field(1.0, ge=1)
    dropout: float = Field(
        0.0, ge=0, lt=1, description="simulated: chance a client dies mid-round (never pushes)"
    )

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.mode == "async" and self.buffer_size < self.min_quorum:
            raise ValueError(
                f"buffer_size ({self.buffer_size}) is below min_quorum ({self.min_quorum}), "
                "the smallest aggregate the key holder will decrypt"
            )
        if self.min_quorum > self.clients:
            raise ValueError(f"min_quorum ({self.min_quorum}) exceeds clients ({self.clients})")
        if self.cohort_size and self.cohort_size < self.min_quorum:
            raise ValueError("cohort_size must be 0 (all) or at least min_quorum")
        if self.mode == "async" and self.buffer_size > (self.cohort_size or self.clients):
            raise ValueError(
                f"buffer_size ({self.buffer_size}) exceeds the clients a buffer is offered to "
                f"({self.cohort_size or self.clients}); it could never flush"
            )
        return self


class PrivacyConfig(_Section):
    """Differential privacy: give a noise multiplier or a target epsilon (see docs/privacy.md).

    ``level = "example"``: per-client DP-SGD (Opacus), per-sample gradients clipped to
    ``max_grad_norm``. ``level = "client"``: DP-FedAvg, each client's whole update clipped to
    ``clip_norm`` and noised, with uniform client weights.
    """

    noise_multiplier: float | None = Field(None, ge=0)
    target_epsilon: float | None = Field(7.5, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    accountant: Literal["rdp", "prv", "gdp"] = "rdp"
    level: str = Field(
        "example",
        min_length=1,
        description="protect one example (DP-SGD) or one client's data (DP-FedAvg): a trainer",
    )
    clip_norm: float = Field(0.5, gt=0, description="client level: L2 clip of each update")
    clipping: Literal["ghost", "per_sample"] = Field(
        "ghost",
        description="example level: how per-sample gradients are clipped, ghost (Opacus's fast "
        "gradient clipping: norms without the per-sample gradients, a second backward pass) or "
        "per_sample (Opacus's hooks materialise them); the same clipped sum, the same accounting",
    )
    insecure_reproducible: bool = Field(
        False,
        description="draw DP noise, Poisson and cohort sampling from training.seed: anyone "
        "holding the configuration can regenerate and remove the noise (debugging only; warns)",
    )
    noise_ahead_mib: int = Field(
        256,
        ge=0,
        description="memory a client may hold of the DP noise it draws ahead of its next round "
        "while it waits (0: drawn only as it is added; never with insecure_reproducible)",
    )

    @property
    def noise_mode(self) -> str:
        """``"secure"`` (a CSPRNG, the default) or ``"insecure-reproducible"``."""
        return "insecure-reproducible" if self.insecure_reproducible else "secure"

    @model_validator(mode="after")
    def _check(self) -> PrivacyConfig:
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            if "target_epsilon" not in self.model_fields_set:
                return self.model_copy(update={"target_epsilon": None})
            raise ValueError("give noise_multiplier or target_epsilon, not both")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("give noise_multiplier or target_epsilon")
        return self


class HEConfig(_Section):
    """Homomorphic encryption.

    By default the CKKS parameters are derived from the workload (``max_clients``,
    ``max_abs_value``, ``precision``; see docs/crypto.md); give ``poly_modulus_degree``,
    ``coeff_modulus_bits`` and ``scale_bits`` to fix them.
    """

    enabled: bool = Field(
        True, description="false: plaintext updates (insecure baseline for benchmarks only)"
    )
    max_clients: int = Field(100, ge=1, description="most updates one aggregate may sum")
    max_abs_value: float = Field(
        1.0, gt=0, description="clients clip each weighted update value to this magnitude"
    )
    precision: float = Field(
        1e-5, gt=0, lt=1, description="max error of a decrypted sum, relative to max_abs_value"
    )
    poly_modulus_degree: Literal[2048, 4096, 8192, 16384] | None = None
    coeff_modulus_bits: int | None = Field(None, ge=20, le=60)
    scale_bits: int | None = Field(None, ge=10, le=56)

    @model_validator(mode="after")
    def _check(self) -> HEConfig:
        fixed = [self.poly_modulus_degree, self.coeff_modulus_bits, self.scale_bits]
        if any(v is not None for v in fixed) and any(v is None for v in fixed):
            raise ValueError(
                "give all of poly_modulus_degree, coeff_modulus_bits and scale_bits, or none"
            )
        bits, scale = self.coeff_modulus_bits, self.scale_bits
        if bits is not None and scale is not None and scale > bits - 4:
            raise ValueError("scale_bits must be at most coeff_modulus_bits - 4")
        return self


class KeyHolderConfig(_Section):
    """Key-holder parties: no single process holds the secret key (docs/crypto.md).

    ``parties = 1`` (the default) is one key holder with the whole key. With ``parties = P``
    above 1, P party processes (``cluster.parties``) each hold a share, and any ``threshold =
    T`` of them decrypt a round together (0: all P); each floods its partial decryption to
    ``lambda_bits`` bits of statistical security per released coefficient.
    """

    parties: int = Field(1, ge=1, le=16)
    threshold: int = Field(0, ge=0, le=16, description="T; 0: every party (P-of-P)")
    lambda_bits: int = Field(
        16, ge=1, le=21, description="statistical security of each party's flooding"
    )

    @model_validator(mode="after")
    def _check(self) -> KeyHolderConfig:
        if self.threshold > self.parties:
            raise ValueError(f"threshold ({self.threshold}) cannot exceed parties ({self.parties})")
        return self

    @property
    def quorum(self) -> int:
        """T: how many parties decrypt together."""
        return self.threshold or self.parties


class SecurityConfig(_Section):
    """Release hygiene, rate limits and poisoning guard (see docs/security.md)."""

    flood_bits: int = Field(
        4,
        ge=0,
        le=40,
        description="noise flooding: std = 2**flood_bits x the worst-case decryption error",
    )
    max_pushes_per_round: int = Field(
        64, ge=1, description="push messages one client may send to one shard per round"
    )
    weighting: Literal["uniform", "examples"] = Field(
        "uniform",
        description="aggregation weights the key holder accepts: uniform (every client 1), "
        "or examples (num_examples / the cohort's largest, at least min_weight)",
    )
    min_weight: float = Field(
        0.1,
        gt=0,
        le=1,
        description='weighting = "examples": the smallest weight a client may have, so that '
        "no declared num_examples can make the other contributors negligible",
    )
    max_detections: int = Field(
        3,
        ge=1,
        description="detected tamperings by one shard after which the key holder decrypts "
        "nothing more",
    )
    max_shard_misses: int = Field(
        3,
        ge=1,
        description="missed call deadlines in a row of one shard (the key holder's fetch of "
        "its aggregates, the coordinator's opening or closing of a round) after which the "
        "run stops, naming the shard",
    )
    shard_deadline_s: float = Field(
        60.0,
        gt=0,
        description="how long the key holder waits for a shard's aggregates, and the "
        "coordinator for a shard to open or close a round; a shard that has not answered "
        "by then missed its deadline",
    )
    rotate_every_rounds: int = Field(
        10,
        ge=0,
        description="a new CKKS key pair once N rounds have passed since the last one (0: "
        "never; the key holder warns when one key may release more blocks than the leakage "
        "bound allows, docs/security.md)",
    )
    keyholder_key: str = Field(
        "",
        pattern=r"^([0-9a-f]{64})?$",
        description="pinned Ed25519 key of the key holder (hex, from keys/signing.pub)",
    )


class TlsConfig(_Section):
    """Mutual TLS between every party (certificates from ``fedps certs``), on by default.

    Every channel and port uses TLS and both ends present a certificate signed by the
    deployment's CA; a client's identity is its certificate's common name. ``insecure = true``
    (``--insecure``) is the one way to turn TLS off: traffic is then plaintext, each role warns
    when it starts, and clients prove their identity with the enrolment tokens that
    ``fedps certs`` writes next to the certificates. ``enabled`` only confirms the default.
    """

    enabled: bool = Field(
        True, description="mutual TLS (the default); turn it off with insecure = true"
    )
    directory: Path = Field(
        Path("fedps-certs"),
        description="where `fedps certs` writes and roles read certificates, the enrolment "
        "key and client tokens",
    )
    name: str = Field(
        "",
        description="identity (NAME.crt, NAME.key, NAME.token) this process uses; empty: the "
        "role's name (keyholder, coordinator, shard-N, client-N)",
    )
    insecure: bool = Field(
        False,
        description="turn TLS off: plaintext traffic, clients admitted by enrolment token "
        "(warns at every start)",
    )

    @model_validator(mode="after")
    def _check(self) -> TlsConfig:
        if self.name and (
            "/" in self.name or "\\" in self.name or self.name.startswith(".") or self.name == "ca"
        ):
            raise ValueError(f"name {self.name!r} is not a certificate file stem")
        if self.insecure and self.enabled:
            if "enabled" in self.model_fields_set:
                raise ValueError(
                    "enabled = true and insecure = true contradict each other: insecure turns "
                    "TLS off; set one"
                )
            return self.model_copy(update={"enabled": False})
        if not self.enabled and not self.insecure:
            raise ValueError(
                "TLS is on by default; to run without it set insecure = true (or pass "
                "--insecure), not enabled = false"
            )
        return self


class GroupsConfig(_Section):
    """Mixed policy (async mode): parameter groups that stay synchronous.

    In ``training.mode = "async"`` every parameter changes at each buffer flush, except those
    whose name (``model.named_parameters()``, e.g. ``"2.weight"``) matches one of the ``sync``
    patterns (``fnmatch``): they change only when a round closes, every ``round_buffers``
    applied flushes, by the weighted average of every update of that round.
    """

    sync: list[str] = Field(
        default_factory=list, description="name patterns of the parameters kept synchronous"
    )
    round_buffers: int = Field(
        0, ge=0, description="applied flushes per round (0: ceil(clients / buffer_size))"
    )

    def buffers_per_round(self, training: TrainingConfig) -> int:
        """Applied flushes after which the synchronous groups change."""
        return self.round_buffers or -(-training.clients // training.buffer_size)


class TaskConfig(_Section):
    """The task: the user's model, data loading, loss and metrics (:mod:`fedps.learning.tasks`).

    ``app`` names a registered task (``register_task``, or the ``fedps.learning.tasks`` entry-point
    group) or a module, ``"my_pkg.task"`` or ``"my_pkg.task:attr"``, found on the path with
    ``dir`` (the project directory) appended. Empty: the built-in task of
    ``training.dataset`` with ``training.model``.

    Rounds are evaluated on the task's ``load_eval_data`` (the operator's data). A task
    without it is evaluated by its clients only with ``client_eval``: each reports the task's
    metrics of the model it trains from (the previous round's), on its own training data, and
    the coordinator records their median over the round's clients. Those numbers come from
    private data and are not covered by the DP guarantee, so it is off by default and warns.
    """

    app: str = ""
    dir: str = Field("", description="the project directory (default: the config file's)")
    client_eval: bool = Field(
        False,
        description="without the operator's evaluation data, clients report the task's "
        "metrics on their own data (outside the DP guarantee; warns)",
    )


class FedPSConfig(_Section):
    """The whole configuration."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    he: HEConfig = Field(default_factory=HEConfig)
    keyholder: KeyHolderConfig = Field(default_factory=KeyHolderConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    tls: TlsConfig = Field(default_factory=TlsConfig)
    groups: GroupsConfig = Field(default_factory=GroupsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)

    @model_validator(mode="after")
    def _check(self) -> FedPSConfig:
        if self.compression.enabled and self.training.mode != "sync":
            raise ValueError(
                'compression.density below 1 needs training.mode = "sync": an async buffer '
                "sums updates trained for different rounds, each sent under its round's mask, "
                "and shards add ciphertexts slot by slot, so every update of one sum must share "
                "one mask"
            )
        if self.compression.quantized:
            self._check_quantized()
        if self.compression.masked_training and (
            self.privacy.level != "example" or self.privacy.clipping != "per_sample"
        ):
            raise ValueError(
                'compression.masked_training needs privacy.level = "example" and privacy.clipping'
                " = \"per_sample\": it clips each example's gradient on the mask's coordinates"
            )
        parties = self.keyholder.parties
        if parties > 1 and len(self.cluster.parties) != parties:
            raise ValueError(
                f"keyholder.parties = {parties} needs cluster.parties, one address per party "
                f"(got {len(self.cluster.parties)})"
            )
        if parties > 1 and self.compression.quantized:
            raise ValueError(
                "keyholder.parties above 1 cannot decrypt compression.bits' packing: its sums "
                "are rounded exactly, the parties' are flooded"
            )
        if parties > 1 and self.training.mode != "sync":
            raise ValueError(
                'keyholder.parties above 1 needs training.mode = "sync": a party decrypts '
                "unweighted sums of a closed round only"
            )
        if self.metrics.shards and len(self.metrics.shards) != len(self.cluster.shards):
            raise ValueError("metrics.shards needs one address per shard (or none)")
        if self.metrics.parties and len(self.metrics.parties) != len(self.cluster.parties):
            raise ValueError("metrics.parties needs one address per key-holder party (or none)")
        if self.privacy.level == "client" and self.training.mode != "sync":
            raise ValueError(
                'privacy.level = "client" needs training.mode = "sync": its noise is split '
                "over a round's cohort"
            )
        if self.groups.sync and self.training.mode != "async":
            raise ValueError(
                "groups.sync keeps some parameters synchronous in an async run; "
                'set training.mode = "async" (a sync run is synchronous everywhere)'
            )
        cohort = self.training.cohort_size or self.training.clients
        if self.privacy.level == "client":  # Poisson cohorts: n on average, sometimes more
            cohort = _poisson_cohort_bound(self.training.clients, cohort)
        if cohort > self.he.max_clients:
            raise ValueError(
                f"a round of {cohort} clients exceeds he.max_clients ({self.he.max_clients}), "
                "which sizes the CKKS headroom; raise he.max_clients"
            )
        return self

    def _check_quantized(self) -> None:
        """``compression.bits`` packs encrypted values of synchronous rounds, derived parameters."""
        if not self.he.enabled:
            raise ValueError(
                "compression.bits packs quantized values into ciphertext coefficients; it "
                "needs he.enabled"
            )
        if self.training.mode != "sync":
            raise ValueError(
                'compression.bits needs training.mode = "sync": staleness multipliers would '
                "scale the packed fields past their headroom"
            )
        if self.he.poly_modulus_degree is not None:
            raise ValueError(
                "compression.bits derives the CKKS parameters from bits and he.max_clients; "
                "leave poly_modulus_degree, coeff_modulus_bits and scale_bits unset"
            )


def _poisson_cohort_bound(clients: int, cohort: int) -> int:
    """A cohort size Poisson sampling of ``clients`` at rate ``cohort / clients`` never exceeds.

    Practically never: the mean plus 6 sqrt(mean) + 6 (a tail of about 1e-9 or less), at most
    ``clients``.
    """
    mean = min(cohort, clients)
    return min(clients, math.ceil(mean + 6 * math.sqrt(mean) + 6))


def read_toml(path: Path, what: str) -> dict[str, object]:
    """A TOML file's tables; ``what`` names the file in errors (``config``, ``grid``).

    Raises
    ------
    ConfigError
        If the file is missing or is not TOML.
    """
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc


def load_config(path: Path | None = None, **overrides: Mapping[str, object]) -> FedPSConfig:
    """Load and validate a TOML file (``None``: all defaults).

    Parameters
    ----------
    path
        The TOML file.
    overrides
        Per-section dictionaries merged over the file, e.g. ``training={"rounds": 3}``.

    Raises
    ------
    ConfigError
        With one line per bad field, naming it (``training.rounds: ...``).
    """
    data: dict[str, object] = read_toml(path, "config") if path is not None else {}
    for section, values in overrides.items():
        current = data.get(section, {})
        if not isinstance(current, dict):
            raise ConfigError(f"{section}: must be a table")
        data[section] = {**current, **values}
    task = data.get("task", {})
    if path is not None and isinstance(task, dict) and task.get("app"):
        # the project directory, as Flower's: relative to the configuration file
        project = Path(str(task.get("dir", "")) or ".")
        data["task"] = {**task, "dir": str(path.parent.resolve() / project)}
    try:
        return FedPSConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        fields: dict[str, str] = {}
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            lines.append(f"{loc}: {err['msg']}")
            fields.setdefault(loc, err["msg"])
        raise ConfigError("invalid configuration: " + "; ".join(lines), fields=fields) from None
    except ConfigError as exc:
        raise ConfigError(f"invalid configuration: {exc}", fields=exc.fields) from None
