"""The fedps error hierarchy: one root, one subclass per expected failure.

Expected errors carry a gRPC status so that servicers can turn them into a status code with a
clear message, and clients can map a status code back to the same exception class
(``fedps.transport.raise_from_rpc_error``). Programming errors stay ordinary Python exceptions.
"""

from __future__ import annotations

import grpc


class FedPSError(Exception):
    """Root of every error fedps raises on purpose."""

    status: grpc.StatusCode = grpc.StatusCode.INTERNAL


class ConfigError(FedPSError, ValueError):
    """A configuration file or field is invalid."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class InvalidArgumentError(FedPSError, ValueError):
    """A request is malformed: wrong size, count, parameters or values."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class UnknownClientError(FedPSError):
    """The caller is not a registered client, or not in the current cohort."""

    status = grpc.StatusCode.NOT_FOUND


class RoundClosedError(FedPSError):
    """The round or buffer a request names is closed, abandoned or not open yet."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class UnauthenticatedError(FedPSError):
    """The caller presented no valid credential."""

    status = grpc.StatusCode.UNAUTHENTICATED


class StaleUpdateError(FedPSError):
    """An asynchronous update is older than the maximum staleness."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class RateLimitedError(FedPSError):
    """A caller exceeded its per-round request budget."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class PolicyError(FedPSError):
    """The key holder's decryption policy refuses the request."""

    status = grpc.StatusCode.PERMISSION_DENIED


class QuarantinedError(PolicyError):
    """The key holder decrypts nothing more: a shard was caught tampering too often."""

    status = grpc.StatusCode.ABORTED


class PrivacyBudgetExceededError(FedPSError):
    """A client would spend more than its epsilon budget."""

    status = grpc.StatusCode.FAILED_PRECONDITION


class NotReadyError(FedPSError):
    """The peer is up but not ready yet (no model, no keys)."""

    status = grpc.StatusCode.UNAVAILABLE


class PeerUnavailableError(FedPSError):
    """A peer could not be reached."""

    status = grpc.StatusCode.UNAVAILABLE
