"""Fixtures of the security tests."""

from tests.security.arena import arena

__all__ = ["arena"]
