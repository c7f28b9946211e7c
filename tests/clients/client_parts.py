"""An edge client's parts built by hand, for their unit tests: its privacy ledger, session,
update pipeline and pusher around a real trainer on the configured task's data, as
:class:`clients.edge_client.EdgeClient` composes them."""

from __future__ import annotations

from dataclasses import dataclass

from clients.client_session import ClientSession, Uplink, read_enrolment_token
from clients.client_setup import client_partition
from clients.client_state import ClientState, DataSource
from clients.dp_trainer import create_trainer
from clients.peer_failures import PeerFailures
from clients.privacy_ledger import PrivacyLedger
from clients.pusher import Pusher
from clients.update_pipeline import UpdatePipeline
from fedps.config import FedPSConfig
from fedps.learning.tasks import load_task
from fedps.rpc.coordinator_stub import CoordinatorStub

__all__ = ["ClientParts", "client_parts"]


@dataclass
class ClientParts:
    """One client's parts, sharing its failure count."""

    failures: PeerFailures
    ledger: PrivacyLedger
    session: ClientSession
    pipeline: UpdatePipeline
    pusher: Pusher

    def close(self) -> None:
        self.session.shutdown()
        self.session.uplink.close()


def client_parts(
    config: FedPSConfig, *, index: int = 0, uplink: Uplink | None = None, peer_wait_s: float = 5.0
) -> ClientParts:
    """Client ``index``'s parts (identity ``client-INDEX``, its enrolment token from
    ``tls.directory``, its ledger in memory); its uplink is the configured coordinator unless
    ``uplink`` is given. Nothing is opened: the session is neither registered nor joined."""
    identity = f"client-{index}"
    task = load_task(config)
    own = client_partition(config, index, task=task)
    model = task.create_model(config.training.seed)
    trainer = create_trainer(
        model, own, training=config.training, privacy=config.privacy, task=task
    )
    ledger = PrivacyLedger(
        ClientState.in_memory(identity),
        trainer,
        data=DataSource.of(own),
        privacy=config.privacy,
        name=f"edge-{index}",
    )
    failures = PeerFailures(f"edge-{index}", identity=identity, tls_directory=config.tls.directory)
    session = ClientSession(
        config,
        name=f"edge-{index}",
        enrolment_token=read_enrolment_token(config.tls, identity, required=True),
        ledger=ledger,
        failures=failures,
        uplink=uplink or CoordinatorStub(config.cluster.coordinator),
        peer_wait_s=peer_wait_s,
    )
    return ClientParts(
        failures, ledger, session, UpdatePipeline(session, failures), Pusher(session, failures)
    )
