"""fedps's secure aggregation around any Flower ``ClientApp``'s own ``train``, as a mod.

Flower extends a ``ClientApp`` with mods, functions ``mod(message, context, call_next)`` in
``ClientApp(mods=[...])`` (Flower's ``secaggplus_mod`` is one). :class:`FedPSMod` is fedps's:
the app keeps its own ``train`` (its data, loss, optimizer and loop), and the update leaves
the node encrypted, committed and pushed to the fedps shards, never in a Flower reply::

    from flwr.clientapp import ClientApp
    from clients.flower.fedps_mod import FedPSMod

    app = ClientApp(mods=[FedPSMod()])  # the fedps TOML file: run config "fedps-config"

    @app.train()
    def train(msg, context):
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        ...  # the app's own training
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict())}), reply_to=msg)

For each fedps message (a ``train`` message with a ``"fedps"`` record, sent by
:class:`server.flower.flower_strategy.FlowerStrategy`) the mod does what a fedps node does
(:class:`clients.flower.flower_client.FlowerNode`): it registers the node, and for a round it
pulls the key holder's signed global model of the round's version from the shards, loads it
into the task's model (``load_task(config)``, the model the key holder holds: the app's model
must have the same parameters) and calls the app's ``train`` with that model as the message's
``"arrays"`` (and the strategy's ``"config"``). From the reply's arrays it forms the update
(trained minus global, every trainable parameter), clips it to L2 norm ``privacy.clip_norm``
and adds this node's share of the Gaussian noise (client-level DP, DP-FedAvg:
:class:`clients.flower.wrapped_trainer.WrappedTrainer`; ``privacy.level = "client"`` is
required, since fedps cannot clip the per-sample gradients of a training it does not run),
encrypts it under the key holder's CKKS public key, commits it at the key holder and, at the
push stage, pushes it to the shards. The reply to the strategy carries metadata only (weight,
epsilon); the app's reply, arrays and metrics alike, goes no further than the mod. Messages
that are not fedps's pass through to the app untouched.

Buffers (BatchNorm statistics, for instance) are not trainable parameters and are not
aggregated: each node keeps its own, carried over from its previous round (only the trainable
parameters are replaced by the global model's).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from clients.flower.flower_client import FlowerClient, FlowerNode, fedps_record
from clients.flower.wrapped_trainer import WrappedTrainer
from crypto.signing import BlockSigner
from fedps.config import FedPSConfig
from fedps.errors import FedPSError, InvalidArgumentError
from fedps.learning.tasks import load_task
from fedps.sharding.blocks import flatten_model

__all__ = ["ARRAYS_KEY", "CONFIG_RECORD_KEY", "FedPSMod", "wrapped_client"]

#: The ArrayRecord that carries the global model to the app's ``train`` (Flower's convention).
ARRAYS_KEY = "arrays"
#: The ConfigRecord of the strategy's training configuration (Flower's convention).
CONFIG_RECORD_KEY = "config"


def wrapped_client(config: FedPSConfig, *, index: int, signer: BlockSigner) -> FlowerClient:
    """A node's client that trains with the app's own ``train``.

    It is a :class:`~clients.flower.wrapped_trainer.WrappedTrainer` on the configured task's model.
    """
    task = load_task(config)
    t = config.training
    trainer = WrappedTrainer(
        task.create_model(t.seed),
        training=t,
        privacy=config.privacy,
        seed=t.seed * 1000 + index + 1,
        task=task,
    )
    return FlowerClient(config, index=index, signer=signer, trainer=trainer)


class FedPSMod:
    """A Flower mod: fedps's DP, encryption and secure aggregation around the app's ``train``.

    Parameters
    ----------
    config
        The fedps configuration, or a function of the node's ``Context`` that returns it;
        ``None``: load the TOML file named by the run config's ``fedps-config`` key.
    cache_size
        Built clients kept per process (a speed-up only; 0 rebuilds for every message).
    timeout_s
        How long a node waits for the key holder when it attaches.
    """

    def __init__(
        self,
        config: FedPSConfig | Callable[[Context], FedPSConfig] | None = None,
        *,
        cache_size: int = 16,
        timeout_s: float = 60.0,
    ) -> None:
        self._node = FlowerNode(
            config, client_factory=wrapped_client, cache_size=cache_size, timeout_s=timeout_s
        )

    def __call__(self, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        """Answer a fedps message; pass any other message to ``call_next``.

        The ``train`` stage runs ``call_next``, the app's ``train``, on the global model.
        """
        if fedps_record(message) is None:
            return call_next(message, context)
        config = message.content.config_records.get(CONFIG_RECORD_KEY, ConfigRecord())

        def local(model: torch.nn.Module) -> None:
            _train_with_app(model, message, context, call_next, config)

        return self._node.handle(message, context, local=local)


def _train_with_app(
    model: torch.nn.Module,
    message: Message,
    context: Context,
    call_next: ClientAppCallable,
    config: ConfigRecord,
) -> None:
    """Train ``model`` (holding the global parameters) in place with the app's ``train``.

    The app sees the fedps message with its content replaced by Flower's usual train content,
    the model as ``"arrays"`` and the strategy's ``"config"`` (as Flower's SecAgg+ mod hands
    the app the message it received); the fedps record is not shown to it.

    Raises
    ------
    FedPSError
        If the app's ``train`` replied with an error.
    InvalidArgumentError
        If its reply holds no model, one that does not fit the task's model, or a
        non-finite value.
    """
    message.content = RecordDict(
        {ARRAYS_KEY: ArrayRecord(model.state_dict()), CONFIG_RECORD_KEY: config}
    )
    reply = call_next(message, context)
    if reply.has_error():
        raise FedPSError(f"the app's train failed: {reply.error.reason}")
    records = reply.content.array_records
    arrays = records.get(ARRAYS_KEY) if len(records) != 1 else next(iter(records.values()))
    if arrays is None:
        raise InvalidArgumentError(
            f"the app's train replied with no model: reply with an ArrayRecord ({ARRAYS_KEY!r})"
        )
    try:
        model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidArgumentError(
            f"the app's train replied with arrays that do not fit the fedps task's model "
            f"(the model the key holder holds): {exc}"
        ) from exc
    if not np.all(np.isfinite(flatten_model(model))):
        raise InvalidArgumentError("the app's train replied with a non-finite parameter")
