"""Tests for fedps.config: defaults, TOML round trips and one named error per bad field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedps.compression_config import CompressionConfig
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError
from fedps.runtime.deployment import write_config


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fedps.toml"
    path.write_text(text)
    return path


def test_defaults_load_and_validate() -> None:
    # Prepare / Execute
    config = load_config(None)

    # Assert: the documented single-machine defaults, and they re-validate unchanged.
    assert config.training.rounds == 30
    assert config.training.clients == 4
    assert config.cluster.shards == ["127.0.0.1:7201", "127.0.0.1:7202"]
    assert config.cluster.shard_ids == ["shard-0", "shard-1"]
    assert config.privacy.target_epsilon == 7.5
    assert config.privacy.noise_multiplier is None
    # CKKS parameters are derived from the workload unless fixed.
    assert config.he.poly_modulus_degree is None
    # Mutual TLS by default; metrics, when configured, for the operator on loopback.
    assert config.tls.enabled and not config.tls.insecure
    assert not config.metrics.public
    assert (config.he.max_clients, config.he.max_abs_value, config.he.precision) == (
        100,
        1.0,
        1e-5,
    )
    assert FedPSConfig.model_validate(config.model_dump()) == config


def test_toml_file_round_trip(tmp_path: Path) -> None:
    # Prepare
    path = _write(
        tmp_path,
        """
[cluster]
keyholder = "10.0.0.1:7100"
coordinator = "10.0.0.2:7000"
shards = ["10.0.0.3:7201", "10.0.0.4:7202", "10.0.0.5:7203"]

[training]
rounds = 7
clients = 5
min_quorum = 3
server_optimizer = "fedadam"

[privacy]
noise_multiplier = 1.1

[he]
poly_modulus_degree = 4096
coeff_modulus_bits = 45
scale_bits = 35
""",
    )

    # Execute
    config = load_config(path)

    # Assert
    assert config.cluster.keyholder == "10.0.0.1:7100"
    assert config.cluster.shard_ids == ["shard-0", "shard-1", "shard-2"]
    assert (config.training.rounds, config.training.clients, config.training.min_quorum) == (
        7,
        5,
        3,
    )
    assert config.training.server_optimizer == "fedadam"
    # A noise multiplier given alone drops the default target epsilon.
    assert config.privacy.noise_multiplier == 1.1
    assert config.privacy.target_epsilon is None
    assert (config.he.poly_modulus_degree, config.he.scale_bits) == (4096, 35)
    assert config.he.coeff_modulus_bits == 45


def test_overrides_merge_over_the_file(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "[training]\nrounds = 7\nclients = 6\n")

    # Execute
    config = load_config(path, training={"rounds": 3})

    # Assert
    assert config.training.rounds == 3
    assert config.training.clients == 6


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"training": {"rounds": 0}}, "training.rounds: "),
        ({"training": {"lr": -1.0}}, "training.lr: "),
        ({"training": {"batch_size": "big"}}, "training.batch_size: "),
        ({"training": {"unknown_knob": 1}}, "training.unknown_knob: "),
        ({"cluster": {"unknown_knob": 1}}, "cluster.unknown_knob: "),
        ({"he": {"poly_modulus_degree": 3000}}, "he.poly_modulus_degree: "),
        ({"he": {"coeff_modulus_bits": 61}}, "he.coeff_modulus_bits: "),
        ({"privacy": {"delta": 1.5}}, "privacy.delta: "),
        ({"privacy": {"accountant": "moments"}}, "privacy.accountant: "),
        ({"privacy": {"clipping": "hooks"}}, "privacy.clipping: Input should be 'ghost' or"),
        ({"training": {"dataset": ""}}, "training.dataset: "),
        ({"security": {"weighting": "declared"}}, "security.weighting: "),
        ({"security": {"min_weight": 0}}, "security.min_weight: "),
        ({"security": {"max_shard_misses": 0}}, "security.max_shard_misses: "),
        ({"security": {"shard_deadline_s": 0}}, "security.shard_deadline_s: "),
        ({"compression": {"density": 0}}, "compression.density: "),
        ({"compression": {"density": 1.5}}, "compression.density: "),
        ({"compression": {"bits": 0}}, "compression.bits: "),
        ({"compression": {"bits": 17}}, "compression.bits: "),
        ({"compression": {"error_feedback": "sometimes"}}, "compression.error_feedback: "),
        (
            {"training": {"mode": "async", "clients": 4, "cohort_size": 2, "buffer_size": 3}},
            "could never flush",
        ),
    ],
)
def test_bad_field_is_named(sections: dict[str, dict[str, object]], expected: str) -> None:
    # Prepare / Execute
    with pytest.raises(ConfigError) as info:
        load_config(None, **sections)

    # Assert
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("sections", "fragments"),
    [
        ({"cluster": {"shards": ["nohost"]}}, ["cluster: ", "'nohost'", "host:port"]),
        ({"cluster": {"coordinator": "nohost"}}, ["cluster: ", "'nohost'"]),
        ({"cluster": {"keyholder": "host:99999"}}, ["cluster: ", "'host:99999'"]),
        ({"cluster": {"keyholder": ":7100"}}, ["cluster: ", "':7100'"]),
        ({"cluster": {"shards": []}}, ["cluster: ", "shard"]),
        ({"cluster": {"shards": ["h:1", "h:2", "h:1"]}}, ["cluster: ", "distinct"]),
        (
            {"cluster": {"listen": {"keyholder": "0.0.0.0"}}},
            ["cluster.listen: ", "'0.0.0.0'", "host:port"],
        ),
        (
            {"cluster": {"listen": {"shards": ["0.0.0.0:7201"]}}},
            ["cluster: ", "listen.shards", "one address per shard"],
        ),
        ({"training": {"min_quorum": 5, "clients": 4}}, ["training: ", "min_quorum", "clients"]),
        ({"training": {"cohort_size": 1, "min_quorum": 2}}, ["training: ", "cohort_size"]),
        (
            {"privacy": {"noise_multiplier": 1.0, "target_epsilon": 3.0}},
            ["privacy: ", "noise_multiplier", "target_epsilon"],
        ),
        (
            {"he": {"poly_modulus_degree": 2048, "coeff_modulus_bits": 45, "scale_bits": 42}},
            ["he: ", "scale_bits"],
        ),
        ({"he": {"coeff_modulus_bits": 45}}, ["he: ", "all of"]),
        ({"training": {"clients": 200}}, ["he.max_clients"]),
        ({"tls": {"enabled": True, "insecure": True}}, ["tls: ", "contradict"]),
        ({"tls": {"enabled": False}}, ["tls: ", "insecure = true", "--insecure"]),
        ({"metrics": {"coordinator": "0.0.0.0:9100"}}, ["metrics: ", "loopback", "public"]),
        ({"metrics": {"shards": ["10.0.0.2:9100"]}}, ["metrics: ", "'10.0.0.2:9100'"]),
        ({"metrics": {"parties": ["10.0.0.2:9100"]}}, ["metrics: ", "'10.0.0.2:9100'"]),
        ({"metrics": {"parties": ["127.0.0.1:9100"]}}, ["metrics.parties", "one address per"]),
        ({"keyholder": {"parties": 2, "threshold": 3}}, ["keyholder: ", "cannot exceed"]),
        ({"keyholder": {"parties": 3}}, ["keyholder.parties = 3", "cluster.parties"]),
        ({"cluster": {"parties": ["h:1", "h:1"]}}, ["cluster: ", "party addresses"]),
        (
            {
                "keyholder": {"parties": 2},
                "cluster": {"parties": ["h:1", "h:2"]},
                "training": {"mode": "async"},
            },
            ["keyholder.parties above 1", "sync"],
        ),
        (
            {
                "keyholder": {"parties": 2},
                "cluster": {"parties": ["h:1", "h:2"]},
                "compression": {"bits": 8},
            },
            ["keyholder.parties above 1", "compression.bits"],
        ),
    ],
)
def test_cross_field_error_names_section_and_field(
    sections: dict[str, dict[str, object]], fragments: list[str]
) -> None:
    # Prepare / Execute
    with pytest.raises(ConfigError) as info:
        load_config(None, **sections)

    # Assert
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message


def test_key_holder_parties_default_to_one_key_holder() -> None:
    # Prepare / Execute
    default = load_config(None)
    parties = load_config(
        None, keyholder={"parties": 3, "threshold": 2}, cluster={"parties": ["h:1", "h:2", "h:3"]}
    )
    every = load_config(None, keyholder={"parties": 2}, cluster={"parties": ["h:1", "h:2"]})

    # Assert
    assert (default.keyholder.parties, default.keyholder.quorum) == (1, 1)
    assert default.keyholder.lambda_bits == 16
    assert (parties.keyholder.parties, parties.keyholder.quorum) == (3, 2)
    assert every.keyholder.quorum == 2


def test_scale_bits_at_the_limit_is_accepted() -> None:
    # Prepare / Execute: scale_bits == coeff_modulus_bits - 4 is the largest allowed.
    config = load_config(
        None, he={"poly_modulus_degree": 2048, "coeff_modulus_bits": 45, "scale_bits": 41}
    )

    # Assert
    assert config.he.scale_bits == 41


def test_unknown_key_in_file_names_it(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "[privacy]\nepsilon = 3.0\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"privacy\.epsilon: "):
        load_config(path)


def test_unknown_section_is_refused(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "[trianing]\nrounds = 3\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match=r"trianing: "):
        load_config(path)


def test_invalid_toml(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, "[training\nrounds = = 3\n")

    # Execute / Assert
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "absent.toml"

    # Execute / Assert
    with pytest.raises(ConfigError, match="not found"):
        load_config(path)


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    # Prepare
    path = _write(tmp_path, 'training = "fast"\n')

    # Execute / Assert
    with pytest.raises(ConfigError, match="training"):
        load_config(path, training={"rounds": 3})


def test_write_config_round_trip_of_defaults(tmp_path: Path) -> None:
    # Prepare
    config = load_config(None)
    path = tmp_path / "out.toml"

    # Execute
    write_config(config, path)
    loaded = load_config(path)

    # Assert
    assert loaded == config


@given(
    rounds=st.integers(1, 1000),
    clients=st.integers(1, 50),
    shards=st.integers(1, 5),
    lr=st.floats(1e-4, 10.0),
    noise=st.one_of(st.none(), st.floats(0.0, 20.0)),
    poly=st.sampled_from([2048, 4096, 8192, 16384]),
    state_dir=st.text(
        st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=20
    ),
)
def test_write_config_round_trip(
    tmp_path_factory: pytest.TempPathFactory,
    rounds: int,
    clients: int,
    shards: int,
    lr: float,
    noise: float | None,
    poly: int,
    state_dir: str,
) -> None:
    # Prepare
    privacy: dict[str, object] = {} if noise is None else {"noise_multiplier": noise}
    config = load_config(
        None,
        cluster={
            "shards": [f"127.0.0.1:{7201 + i}" for i in range(shards)],
            "state_dir": state_dir,
        },
        training={"rounds": rounds, "clients": clients, "min_quorum": 1, "lr": lr},
        privacy=privacy,
        he={"poly_modulus_degree": poly, "coeff_modulus_bits": 45, "scale_bits": 30},
    )
    path = tmp_path_factory.mktemp("cfg") / "out.toml"

    # Execute
    write_config(config, path)
    loaded = load_config(path)

    # Assert
    assert loaded == config


def test_listen_addresses_default_to_the_dial_addresses() -> None:
    # Prepare / Execute
    cluster = load_config(None).cluster

    # Assert: every role binds where it is dialed
    assert cluster.listen_address("keyholder") == cluster.keyholder == "127.0.0.1:7100"
    assert cluster.listen_address("coordinator") == cluster.coordinator
    assert [cluster.listen_address("shard", i) for i in range(2)] == cluster.shards


def test_listen_table_separates_bind_from_dial(tmp_path: Path) -> None:
    # Prepare: containers dialed by service name, each binding every interface
    path = _write(
        tmp_path,
        """
[cluster]
keyholder = "keyholder:7100"
coordinator = "coordinator:7000"
shards = ["shard-0:7201", "shard-1:7202"]

[cluster.listen]
keyholder = "0.0.0.0:7100"
shards = ["0.0.0.0:7201", "[::]:7202"]
""",
    )

    # Execute
    cluster = load_config(path).cluster

    # Assert: listen where given, the dial address elsewhere; peers still dial the names
    assert cluster.listen_address("keyholder") == "0.0.0.0:7100"
    assert cluster.listen_address("coordinator") == "coordinator:7000"
    assert cluster.listen_address("shard", 1) == "[::]:7202"
    assert cluster.dial_address("shard", 1) == "shard-1:7202"
    assert cluster.keyholder == "keyholder:7100"


@pytest.mark.parametrize(("role", "index"), [("shard", 2), ("shard", -1), ("worker", 0)])
def test_listen_address_of_an_unknown_role_or_shard(role: str, index: int) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match=r"out of range|unknown role"):
        load_config(None).cluster.listen_address(role, index)


def test_write_config_round_trip_of_the_listen_table(tmp_path: Path) -> None:
    # Prepare
    config = load_config(
        None,
        cluster={
            "keyholder": "kh.example:7100",
            "listen": {"keyholder": "0.0.0.0:7100", "shards": ["0.0.0.0:1", "0.0.0.0:2"]},
        },
    )
    path = tmp_path / "out.toml"

    # Execute
    write_config(config, path)

    # Assert
    assert "[cluster.listen]" in path.read_text()
    assert load_config(path) == config


def test_sync_groups_need_async_mode() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match=r'training\.mode = "async"'):
        load_config(None, groups={"sync": ["2.*"]})
    mixed = load_config(None, training={"mode": "async"}, groups={"sync": ["2.*"]})
    assert mixed.groups.buffers_per_round(mixed.training) == 2  # ceil(4 clients / K = 3)


def test_compression_is_off_by_default_and_refuses_what_it_cannot_do() -> None:
    # Prepare / Execute
    default = load_config(None).compression
    sparse = load_config(None, compression={"density": 0.1, "error_feedback": True})

    # Assert: off by default; async buffers cannot share one mask
    assert (default.density, default.error_feedback, default.enabled) == (1.0, False, False)
    assert default.bits is None and not default.quantized
    assert sparse.compression.enabled and sparse.compression.error_feedback
    with pytest.raises(ConfigError, match=r'training\.mode = "sync".*one mask'):
        load_config(None, compression={"density": 0.1}, training={"mode": "async"})
    assert load_config(None, training={"mode": "async"}).compression.density == 1.0


def test_masked_training_needs_a_mask_and_each_examples_gradient() -> None:
    # Prepare / Execute
    masked = load_config(
        None,
        compression={"density": 0.2, "masked_training": True, "bits": 8},
        privacy={"clipping": "per_sample"},
    ).compression

    # Assert: with a density below 1 and per-sample clipping; spelt +mt
    assert masked.masked_training and masked.setting == "0.2+mt+8bit"
    assert CompressionConfig.from_setting("0.1+ef+mt") == CompressionConfig(
        density=0.1, error_feedback=True, masked_training=True
    )
    with pytest.raises(ConfigError, match="set a density below 1"):
        load_config(None, compression={"masked_training": True})
    for privacy in ({}, {"level": "client"}):  # ghost clipping (the default), client level
        with pytest.raises(ConfigError, match=r'privacy\.clipping = "per_sample"'):
            load_config(
                None, compression={"density": 0.2, "masked_training": True}, privacy=privacy
            )


def test_quantized_packing_needs_encryption_sync_rounds_and_derived_parameters() -> None:
    # Prepare / Execute
    packed = load_config(None, compression={"density": 0.1, "bits": 8}).compression

    # Assert: 8 bits with a mask is accepted; the packing refuses what it cannot sum exactly
    assert packed.quantized and packed.enabled and packed.bits == 8
    with pytest.raises(ConfigError, match=r"needs he\.enabled"):
        load_config(None, compression={"bits": 8}, he={"enabled": False})
    with pytest.raises(ConfigError, match=r'compression.bits needs training\.mode = "sync"'):
        load_config(None, compression={"bits": 8}, training={"mode": "async"})
    with pytest.raises(ConfigError, match="derives the CKKS parameters"):
        load_config(
            None,
            compression={"bits": 8},
            he={"poly_modulus_degree": 2048, "coeff_modulus_bits": 45, "scale_bits": 30},
        )


def test_client_level_dp_settings() -> None:
    # Execute / Assert: defaults, a bad clip norm, and client level in async mode
    assert load_config(None).privacy.level == "example"
    client = load_config(None, privacy={"level": "client", "clip_norm": 0.3})
    assert client.privacy.clip_norm == 0.3
    with pytest.raises(ConfigError, match=r"privacy\.clip_norm"):
        load_config(None, privacy={"level": "client", "clip_norm": 0})
    with pytest.raises(ConfigError, match="needs training"):
        load_config(None, privacy={"level": "client"}, training={"mode": "async"})


def test_insecure_is_the_one_way_to_turn_tls_off(tmp_path: Path) -> None:
    # Prepare / Execute: insecure alone, and insecure with enabled = false (consistent)
    insecure = load_config(None, tls={"insecure": True}).tls
    both = load_config(None, tls={"insecure": True, "enabled": False}).tls

    # Assert: TLS off either way; written out and read back, still off
    assert (insecure.enabled, insecure.insecure) == (False, True)
    assert both == insecure
    config = load_config(None, tls={"insecure": True})
    path = tmp_path / "written.toml"
    write_config(config, path)
    assert load_config(path).tls == insecure


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "[::1]"])
def test_metrics_on_loopback_need_no_opt_in(host: str) -> None:
    config = load_config(None, metrics={"keyholder": f"{host}:9100"})

    assert config.metrics.keyholder == f"{host}:9100"


def test_public_metrics_are_an_explicit_opt_in() -> None:
    config = load_config(None, metrics={"coordinator": "0.0.0.0:9100", "public": True})

    assert config.metrics.public and config.metrics.coordinator == "0.0.0.0:9100"


def test_errors_are_given_per_field() -> None:
    # Prepare
    sections: dict[str, dict[str, object]] = {
        "training": {"rounds": 0, "lr": "fast"},
        "privacy": {"delta": 2},
    }

    # Execute
    with pytest.raises(ConfigError) as info:
        load_config(None, **sections)

    # Assert: one message per bad field, by its dotted name
    assert set(info.value.fields) == {"training.rounds", "training.lr", "privacy.delta"}
    assert "greater than or equal to 1" in info.value.fields["training.rounds"]


def test_standby_shards_start_off_the_ring_and_one_shard_stays_on() -> None:
    # Prepare
    shards = ["127.0.0.1:7201", "127.0.0.1:7202", "127.0.0.1:7203"]

    # Execute
    config = load_config(None, cluster={"shards": shards, "standby": ["shard-2"]})

    # Assert: shard-2 is configured (its address known to every role), not on ring version 0
    assert config.cluster.shard_ids == ["shard-0", "shard-1", "shard-2"]
    assert config.cluster.ring_ids == ["shard-0", "shard-1"]
    for standby in (["shard-3"], ["shard-0", "shard-1", "shard-2"]):
        with pytest.raises(ConfigError, match="standby"):
            load_config(None, cluster={"shards": shards, "standby": standby})
