"""The RPCs of one service, fuzzed against a running cluster: :class:`ServiceRpcs`."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from google.protobuf.descriptor import ServiceDescriptor

from tests.security.fuzz.cluster import FuzzCluster
from tests.security.fuzz.harness import RpcSpec


class ServiceRpcs(abc.ABC):
    """The oracles and specs of one service's RPCs, against ``cluster``.

    Each ``judge_*`` oracle returns ``GENUINE`` (must succeed), ``LEGIT`` (success allowed),
    ``SKIP`` (valid and state-changing: not sent) or ``bad(reason)`` (must be refused).
    """

    #: The service, as its generated module describes it.
    service: ClassVar[ServiceDescriptor]

    def __init__(self, cluster: FuzzCluster) -> None:
        self.cluster = cluster

    @abc.abstractmethod
    def specs(self) -> list[RpcSpec[Any]]:
        """One spec per RPC of the service."""

    def checked_specs(self) -> list[RpcSpec[Any]]:
        """:meth:`specs`, after checking that they are exactly the service's RPCs (an RPC
        added or removed needs, or loses, its oracle)."""
        specs = self.specs()
        names = [spec.method.name for spec in specs]
        rpcs = {method.name for method in self.service.methods}
        if set(names) != rpcs or len(names) != len(rpcs):
            raise RuntimeError(
                f"{self.service.name}: RPCs without an oracle: {sorted(rpcs - set(names))}; "
                f"oracles of RPCs that do not exist: {sorted(set(names) - rpcs)}"
            )
        return specs
