"""Fixtures of the key-holder party tests: three parties' joint keys and one aggregate."""

from __future__ import annotations

import numpy as np
import pytest

from tests.crypto.threshold_keys import Joint, aggregate, generate
from tests.server.keyholder.party_cluster import COHORT


@pytest.fixture(scope="module")
def joint() -> Joint:
    """The keys of three parties (shares and the joint public context)."""
    return generate(3)


@pytest.fixture(scope="module")
def rows(joint: Joint) -> np.ndarray:
    """One block's aggregate of :data:`COHORT`'s ciphertexts under ``joint``."""
    return aggregate(joint.public, len(COHORT), 2)[0]
