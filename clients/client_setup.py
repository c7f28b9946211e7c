"""What an edge client is made of before it talks to anyone.

Who it is, its state, its task, its trainer and its own data, opened from the configuration
(the only I/O of making a client).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clients.client_session import read_enrolment_token
from clients.client_state import ClientState, default_state_dir
from clients.dp_trainer import Trainer, create_trainer
from crypto.signing import BlockSigner
from fedps.config import FedPSConfig
from fedps.errors import InvalidArgumentError
from fedps.learning.datasets import Dataset, pool
from fedps.learning.tasks import ClientData, Task, load_task

__all__ = ["ClientSetup", "client_partition", "open_setup"]


@dataclass(frozen=True)
class ClientSetup:
    """An edge client's parts that :func:`open_setup` reads or loads.

    Attributes
    ----------
    name, identity
        Its display name; who it is (``tls.name`` or ``client-INDEX``).
    enrolment_token
        The token that proves its identity without TLS (empty if it has none).
    state
        Its signing key and privacy ledger (in its state folder, or in memory).
    task, trainer
        What it trains, and the trainer that does it.
    own_data
        Its own training data (None: a given trainer holds data fedps does not see).
    """

    name: str
    identity: str
    enrolment_token: str
    state: ClientState
    task: Task
    trainer: Trainer
    own_data: Dataset | None


def open_setup(
    config: FedPSConfig,
    *,
    index: int,
    name: str = "",
    state_dir: Path | None = None,
    signer: BlockSigner | None = None,
    token_required: bool = False,
    data: Path | Sequence[Path] | None = None,
    task: Task | None = None,
    trainer: Trainer | None = None,
) -> ClientSetup:
    """Read client ``index``'s enrolment token, open its state folder, load its task and data.

    Its identity is ``tls.name`` or ``client-INDEX``: the certificate it presents under mutual
    TLS, or, without TLS, the enrolment token ``tls.directory/NAME.token`` it registers with.

    Parameters
    ----------
    config
        The cluster configuration (the coordinator's address and training settings).
    index
        Which data partition this client holds.
    name
        A display name.
    state_dir
        The folder of its signing key and privacy ledger
        (default ``<cluster.state_dir>/clients/<identity>``).
    signer
        The client's signing key when its caller keeps the state folder (a Flower node opens
        its folder for each message and hands it to the client's ledger,
        :meth:`clients.privacy_ledger.PrivacyLedger.reopen`): the ledger lives in memory until
        then. Default: the key in the state folder.
    token_required
        Insist on the enrolment token even under mutual TLS (a Flower node is registered by
        its token whatever the transport).
    data
        The client's own data, passed to the task's ``load_data`` (``fedps client --data``);
        several files are pooled (:func:`client_partition`).
    task
        The task to train (default: the configured one, :func:`fedps.learning.tasks.load_task`).
    trainer
        A trainer the caller built, for a training fedps does not run itself (a Flower node
        that wraps the user's own ``train``:
        :class:`clients.flower.wrapped_trainer.WrappedTrainer`); no data is loaded then, and
        the ledger keeps its spend under :data:`clients.privacy_ledger.EXTERNAL_DATA`.
        Default: the task's trainer for ``privacy.level`` on the client's own data.

    Raises
    ------
    ConfigError
        Without TLS (``tls.insecure``) and without a readable enrolment token; or a state
        folder in use by another process, of another identity, or with a corrupt ledger.
    InvalidArgumentError
        Both ``state_dir`` and ``signer`` given, or both ``data`` and ``trainer``.
    """
    if state_dir is not None and signer is not None:
        raise InvalidArgumentError("a client keeps its key in state_dir or is given one")
    if data is not None and trainer is not None:
        raise InvalidArgumentError("a given trainer holds the client's data; no data then")
    identity = config.tls.name or f"client-{index}"
    token = read_enrolment_token(
        config.tls, identity, required=token_required or config.tls.insecure
    )
    state = (
        ClientState.open(state_dir or default_state_dir(config, identity), identity=identity)
        if signer is None
        else ClientState(identity, signer)  # in memory
    )
    task, trainer, own = _local_training(config, index, data=data, task=task, trainer=trainer)
    return ClientSetup(name or f"edge-{index}", identity, token, state, task, trainer, own)


def client_partition(
    config: FedPSConfig,
    index: int,
    *,
    data: Path | Sequence[Path] | None = None,
    task: Task | None = None,
) -> Dataset:
    """Client ``index``'s own training data.

    ``task``'s (default: the configured task's) ``load_data`` for the file or folder ``data``; for
    a built-in dataset, partition ``index`` under the configured partitioner. Several files are
    pooled (the centralised baseline of a task whose clients each hold a file): the i-th is
    loaded as client i of ``len(data)`` would load it, and their rows are concatenated.
    """
    t = config.training
    if not 0 <= index < t.clients:
        raise InvalidArgumentError(f"client index {index} out of range [0, {t.clients})")
    task = task or load_task(config)
    if data is None or isinstance(data, Path):
        return task.client_data(ClientData(data, index=index, num_clients=t.clients, seed=t.seed))
    files = list(data)
    return pool(
        [
            task.client_data(ClientData(path, index=i, num_clients=len(files), seed=t.seed))
            for i, path in enumerate(files)
        ]
    )


def _local_training(
    config: FedPSConfig,
    index: int,
    *,
    data: Path | Sequence[Path] | None,
    task: Task | None,
    trainer: Trainer | None,
) -> tuple[Task, Trainer, Dataset | None]:
    """Client ``index``'s task, its trainer and its own data.

    The data is None when a given ``trainer`` holds the data, whose task is the default one.
    """
    if trainer is not None:
        return task or trainer.task, trainer, None
    task = task or load_task(config)
    own = client_partition(config, index, data=data, task=task)
    model = task.create_model(config.training.seed)
    task.check_fit(model, own)
    trainer = create_trainer(
        model,
        own,
        training=config.training,
        privacy=config.privacy,
        seed=config.training.seed * 1000 + index + 1,
        task=task,
    )
    return task, trainer, own
