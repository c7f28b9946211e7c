"""The container files (deploy/Dockerfile, deploy/compose.yaml, deploy/fedps.toml) checked
without a container engine: every service runs a real ``fedps`` command with options it
accepts, the configuration it mounts loads, services are dialed by their names on the ports
they listen on and expose, and the image runs ``fedps`` with the pinned torch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml  # type: ignore[import-untyped]  # PyYAML (a dependency of flwr) ships no stubs

from fedps.cli import app
from fedps.config import FedPSConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"


def _services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """The service's volumes: {target in the container: source}."""
    mounts: dict[str, str] = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        mounts[target] = source
    return mounts


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _config(service: dict[str, Any]) -> FedPSConfig:
    """The configuration a service's command reads, from the file it mounts there."""
    path = _option(service["command"], "-c")
    source = _mounts(service)[path]
    return load_config(DEPLOY / source)


def _parse(command: list[str]) -> click.Context:
    """Parse ``fedps COMMAND...`` as the CLI would, without running it."""
    group = typer.main.get_command(app)
    assert isinstance(group, click.Group)
    name, *args = command
    sub = group.commands.get(name)
    assert sub is not None, f"{name!r} is not a fedps command ({sorted(group.commands)})"
    return sub.make_context(name, list(args))


def _depends_on(services: dict[str, dict[str, Any]], name: str) -> set[str]:
    """Every service ``name`` waits for, directly or through others."""
    seen: set[str] = set()
    todo = list(services[name].get("depends_on", {}))
    while todo:
        dep = todo.pop()
        if dep not in seen:
            seen.add(dep)
            todo += list(services[dep].get("depends_on", {}))
    return seen


def test_every_service_runs_a_fedps_command_with_valid_options() -> None:
    # Prepare
    services = _services()

    # Execute / Assert: each command parses (unknown options, bad values fail here)
    for name, service in services.items():
        command = service["command"]
        ctx = _parse(command)
        assert str(ctx.params["config"]) == "/config/fedps.toml", name


def test_services_share_one_configuration_that_loads() -> None:
    # Prepare / Execute
    configs = {name: _config(service) for name, service in _services().items()}

    # Assert: one file for all, and it is deploy/fedps.toml
    assert len({c.model_dump_json() for c in configs.values()}) == 1
    assert next(iter(configs.values())) == load_config(DEPLOY / "fedps.toml")


def test_roles_are_dialed_by_service_name_on_the_port_they_listen_on_and_expose() -> None:
    # Prepare
    services = _services()
    cluster = load_config(DEPLOY / "fedps.toml").cluster
    roles = [("keyholder", "keyholder", 0), ("coordinator", "coordinator", 0)]
    roles += [(f"shard-{i}", "shard", i) for i in range(len(cluster.shards))]
    roles += [(f"party-{j}", "party", j) for j in range(1, len(cluster.parties) + 1)]

    for service_name, role, index in roles:
        # Execute
        service = services[service_name]
        dial_host, _, dial_port = cluster.dial_address(role, index).rpartition(":")
        listen_host, _, listen_port = cluster.listen_address(role, index).rpartition(":")

        # Assert: the service runs that role (and that shard), reachable as configured
        command = service["command"]
        assert command[0] == ("keyholder" if role == "party" else role)
        if role == "shard":
            assert int(_option(command, "--index")) == index
        if role == "party":  # a key-holder party, in the compose file's `parties` profile
            assert int(_option(command, "--party")) == index
            assert service["profiles"] == ["parties"]
        assert dial_host == service_name
        assert listen_host == "0.0.0.0"
        assert listen_port == dial_port
        assert [str(p) for p in service["expose"]] == [listen_port]
        # ... and healthy once its port takes a TCP connection: a plain socket connect from
        # the container, no RPC and no fedps import that a busy host could starve
        check = service["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python3", "-c"], check
        assert f"socket.create_connection(('127.0.0.1', {listen_port})" in check[3], check


def test_clients_have_distinct_indexes_one_per_configured_client() -> None:
    # Prepare
    services = _services()
    training = load_config(DEPLOY / "fedps.toml").training

    # Execute
    indexes = sorted(
        int(_option(s["command"], "--index"))
        for s in services.values()
        if s["command"][0] == "client"
    )

    # Assert
    assert indexes == list(range(training.clients))


def test_certificates_come_first_and_reach_every_role() -> None:
    # Prepare
    services = _services()
    config = load_config(DEPLOY / "fedps.toml")
    tls_dir = str(config.tls.directory)
    certs = services["certs"]

    # Assert: `fedps certs` writes into the volume the roles read (under mutual TLS)
    assert config.tls.enabled
    assert certs["command"][0] == "certs" and _option(certs["command"], "-o") == tls_dir
    assert _mounts(certs)[tls_dir] == "certs"
    for name, service in services.items():
        if name == "certs":
            continue
        assert _mounts(service)[tls_dir] == "certs", name
        assert "certs" in _depends_on(services, name), name
        assert _mounts(service)[str(config.cluster.state_dir)] == f"{name}-state", name
        for dep, condition in service.get("depends_on", {}).items():
            expected = "service_completed_successfully" if dep == "certs" else "service_healthy"
            assert condition["condition"] == expected, (name, dep)
    assert all(volume.endswith(":ro") for volume in services["keyholder"]["volumes"][:2])


def test_dockerfile_runs_fedps_as_a_user_with_the_pinned_torch() -> None:
    # Prepare
    text = DOCKERFILE.read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    client = pyproject["project"]["optional-dependencies"]["client"]
    torch_pin = next(d for d in client if d.startswith("torch=="))
    config = load_config(DEPLOY / "fedps.toml")

    # Execute
    instructions = re.findall(r"^([A-Z]+) (.*)$", text, flags=re.MULTILINE)

    # Assert
    values: dict[str, list[str]] = {}
    for keyword, value in instructions:
        values.setdefault(keyword, []).append(value)
    assert values["ENTRYPOINT"] == ['["fedps"]'] * 2  # the server image and the full one
    assert [v.split()[-1] for v in values["FROM"]] == ["base", "server", "full"]
    assert torch_pin == "torch==2.13.0" and f" {torch_pin}" in text
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert values["USER"] and values["USER"][-1] not in ("root", "0")
    volumes = yaml.safe_load(values["VOLUME"][0])
    assert {str(config.cluster.state_dir), str(config.tls.directory)} <= set(volumes)


def test_docker_compose_accepts_the_file() -> None:
    # Prepare
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client")
    if subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker client has no compose plugin")

    # Execute
    result = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
    )

    # Assert
    assert result.returncode == 0, result.stderr


def test_the_dashboard_service_shows_the_cluster_to_viewers_on_this_host_only() -> None:
    # Prepare
    services = _services()
    dashboard = services["dashboard"]

    # Execute
    context = _parse(dashboard["command"])

    # Assert: view-only (the roles are other services), published on the host's loopback,
    # started once the coordinator is up, with the operator's certificate to read the roles
    assert context.params["view_only"] is True
    assert context.params["public"] is False
    assert dashboard["ports"] == ["127.0.0.1:8765:8765"]
    assert "coordinator" in _depends_on(services, "dashboard")
    assert _mounts(dashboard)["/certs"] == "certs"
