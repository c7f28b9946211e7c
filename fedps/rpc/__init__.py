"""The wire: channels and peer identity, typed records of every message, a stub per service.

Each stub is typed.

- :mod:`~fedps.rpc.transport`: channels, server binding, peer identity, the two-way error
  table, retries; :mod:`~fedps.rpc.service_call`: one call with its deadline and retry.
- :mod:`~fedps.rpc.messages` and ``*_messages``: :class:`~fedps.rpc.messages.WireRecord`
  twins of the protobuf messages (roles never build ``_pb2`` messages themselves).
- ``*_stub``: the calling side of each service (:class:`~fedps.rpc.coordinator_stub.
  CoordinatorStub`, :class:`~fedps.rpc.keyholder_stub.KeyHolderStub`,
  :class:`~fedps.rpc.shard_stub.ShardStub`), and :class:`~fedps.rpc.model_reader.ModelReader`,
  the published model read from every shard.

Its modules are imported one by one: a role imports only the services it calls.
"""

__all__: list[str] = []
