"""A Flower ``Grid`` that delivers messages to a ``ClientApp`` in this process.

Flower's simulation runtime runs each virtual node's ``ClientApp`` in a Ray actor behind an
in-memory SuperLink. :class:`InProcessGrid` keeps the part of that path that is fedps's (the
same ``ClientApp`` object, called with each node's own ``Context``; the same strategy, driven
by Flower's own ``Strategy.start`` loop) and replaces the transport with a thread pool, so a
thousand virtual nodes fit on one small machine. A node's ``Context`` (its ``partition-id``
and ``num-partitions`` node config and its ``state``) lives as long as the grid, as it does
in Flower's runtime. A ``ClientApp`` exception becomes an error reply, as in Flower.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["InProcessGrid"]

_log = logging.getLogger("fedps")
_FIRST_NODE_ID = 1001


class InProcessGrid(Grid):
    """``num_nodes`` virtual Flower nodes running ``client_app`` on ``workers`` threads.

    Parameters
    ----------
    client_app
        The ``ClientApp`` every node runs.
    num_nodes
        Virtual nodes; node ``i`` has ``partition-id = i``.
    workers
        Threads executing messages concurrently.
    run_id
        The run id in every ``Context`` and message.
    """

    def __init__(
        self, client_app: ClientApp, num_nodes: int, *, workers: int = 2, run_id: int = 1
    ) -> None:
        if num_nodes < 1 or workers < 1:
            raise ValueError("num_nodes and workers must be at least 1")
        self._app = client_app
        self._run = Run.create_empty(run_id)
        # What Flower's ServerApp runtime sets for its process (new messages read it); this
        # grid is that runtime here, as Flower's own legacy start_grid is for itself.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        self._contexts = {
            _FIRST_NODE_ID + i: Context(
                run_id=run_id,
                node_id=_FIRST_NODE_ID + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="flower-node")
        self._pending: dict[str, Future[Message]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the worker threads (after the messages in flight)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def set_run(self, run: Run) -> None:
        """Adopt ``run``."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run this grid serves."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A message to one node (Flower's ``Message`` constructor does the same)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Every virtual node."""
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Start executing each message on its node; returns the message ids."""
        ids: list[str] = []
        for message in messages:
            context = self._contexts.get(message.metadata.dst_node_id)
            if context is None:
                raise ValueError(f"no node {message.metadata.dst_node_id}")
            message_id = str(uuid4())
            message.metadata.__dict__["_message_id"] = message_id  # as Flower's grids do
            message.metadata.__dict__["_run_id"] = self._run.run_id
            future = self._executor.submit(self._handle, message, context)
            with self._lock:
                self._pending[message_id] = future
            ids.append(message_id)
        return ids

    def _handle(self, message: Message, context: Context) -> Message:
        try:
            reply = self._app(message, context)
        except Exception as exc:  # reported as an error reply, as Flower's runtime does
            _log.warning("node %d failed: %s", context.node_id, exc, exc_info=True)
            reason = f"{type(exc)}:<'{exc}'>"
            reply = Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                reply_to=message,
            )
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        return reply

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies that are ready, each returned once."""
        replies: list[Message] = []
        with self._lock:
            for message_id in message_ids:
                future = self._pending.get(message_id)
                if future is not None and future.done():
                    del self._pending[message_id]
                    replies.append(future.result())
        return replies

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages`` and wait for their replies (at most ``timeout`` seconds)."""
        ids = list(self.push_messages(messages))
        with self._lock:
            futures = [self._pending[i] for i in ids]
        started = time.time()
        wait(futures, timeout=timeout)
        replies = list(self.pull_messages(ids))
        if len(replies) < len(ids):
            _log.warning(
                "%d of %d replies missing after %.0fs",
                len(ids) - len(replies),
                len(ids),
                time.time() - started,
            )
        return replies
