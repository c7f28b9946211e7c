"""The ``[metrics]`` section (:class:`MetricsConfig`), part of :mod:`fedps.config`.

Also :func:`is_loopback`, the test its addresses (and the dashboard's) must pass unless public.
"""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MetricsConfig", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address, IPv6 in brackets or not) is loopback."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetricsConfig(BaseModel):
    """Prometheus endpoints (``host:port``, port 0: any free port); empty: no endpoint.

    They listen on loopback only (``127.0.0.1``, ``::1``, ``localhost``), for the operator on
    that host; ``public = true`` allows any other address and warns when a role starts.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    keyholder: str = ""
    coordinator: str = ""
    shards: list[str] = Field(default_factory=list, description="one per shard, in order")
    parties: list[str] = Field(
        default_factory=list, description="one per key-holder party, party 1 first (or none)"
    )
    public: bool = Field(
        False, description="allow non-loopback metrics addresses (anyone reaching them reads)"
    )

    @model_validator(mode="after")
    def _check(self) -> MetricsConfig:
        for addr in [self.keyholder, self.coordinator, *self.shards, *self.parties]:
            host, sep, port = addr.rpartition(":")
            if addr and not (sep and host and port.isdigit() and int(port) < 65536):
                raise ValueError(f"metrics address {addr!r} is not host:port")
            if addr and not self.public and not is_loopback(host):
                raise ValueError(
                    f"metrics address {addr!r} is not loopback: metrics answer the operator on "
                    "the host; set public = true to serve them to the network"
                )
        return self
