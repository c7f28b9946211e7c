"""Tests for fedps.runtime.preflight: an unknown plug-in name is refused before anything starts."""

from __future__ import annotations

import pytest

from fedps.config import load_config
from fedps.errors import ConfigError
from fedps.runtime.preflight import check_names


def test_the_defaults_pass() -> None:
    check_names(load_config(None))


@pytest.mark.parametrize(
    ("field", "valid"),
    [
        ("partition", "dirichlet, iid, shard"),
        ("model", "mlp"),
        ("dataset", "digits"),
        ("mode", "async"),
        ("server_optimizer", "fedadam"),
        ("staleness", "hinge"),
    ],
)
def test_an_unknown_name_is_refused_naming_the_field_and_the_valid_names(
    field: str, valid: str
) -> None:
    # Prepare: a configuration that passes validation, with one misspelt name
    config = load_config(None, training={field: "random"})

    # Execute / Assert
    with pytest.raises(ConfigError, match=rf"training\.{field}: .*'random'.*{valid}"):
        check_names(config)
