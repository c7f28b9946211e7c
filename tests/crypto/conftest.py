"""Fixtures shared by the crypto tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """A umask that would leave new files world-readable: secrets must be 0600 regardless."""
    old = os.umask(0o022)
    yield
    os.umask(old)
