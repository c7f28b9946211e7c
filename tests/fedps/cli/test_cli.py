"""Tests for the ``fedps`` command: expected errors are one line on stderr and exit code 2."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from clients.client_state import SIGNING_KEY_FILE, ClientState
from clients.dp_trainer import PrivacySpend
from crypto.enrolment import issue_tokens
from fedps.config import PrivacyConfig, load_config
from fedps.provisioning import issue_cluster_certificates
from fedps.runtime.deployment import free_port
from tests.waiting import HANG_S

_ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedps.cli", *args],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=cwd,
        env=_ENV,
        check=False,
    )


def _assert_one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fedps: error:")
    return lines[0]


def test_demo_with_bad_config_field(tmp_path: Path) -> None:
    # Prepare
    config = tmp_path / "bad.toml"
    config.write_text("[training]\nrounds = 0\n")

    # Execute
    result = _run("demo", "--config", str(config), cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "training.rounds" in line
    assert "Traceback" not in result.stdout


def test_demo_with_an_unknown_partition_stops_before_anything_starts(tmp_path: Path) -> None:
    # Prepare: a name that passes the field's validation but names no partitioner
    config = tmp_path / "bad.toml"
    config.write_text('[training]\npartition = "random"\n')

    # Execute
    result = _run("demo", "--config", str(config), cwd=tmp_path)

    # Assert: one line with the field and the valid names, and no role was started
    line = _assert_one_error_line(result)
    assert "training.partition" in line and "'random'" in line
    assert "dirichlet, iid, shard" in line
    assert "round" not in result.stdout


def test_client_with_an_index_out_of_range_says_so(tmp_path: Path) -> None:
    # Execute: 2 clients, index 7 (no certificates exist: that is not what it should say)
    config = tmp_path / "two.toml"
    config.write_text("[training]\nclients = 2\n")
    result = _run("client", "--config", str(config), "--index", "7", cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "--index 7 is out of range" in line and "0 to 1" in line
    assert "certs" not in line


def test_status_with_coordinator_down(tmp_path: Path) -> None:
    # Prepare: every address is a loopback port nobody listens on; the operator's
    # certificate (mutual TLS is the default) from `fedps certs`.
    ports = [free_port() for _ in range(3)]
    config = tmp_path / "down.toml"
    config.write_text(
        "[cluster]\n"
        f'coordinator = "127.0.0.1:{ports[0]}"\n'
        f'keyholder = "127.0.0.1:{ports[1]}"\n'
        f'shards = ["127.0.0.1:{ports[2]}"]\n'
        f'[tls]\ndirectory = "{tmp_path / "certs"}"\n'
    )
    issue_cluster_certificates(load_config(config), tmp_path / "certs")

    # Execute
    result = _run("status", "--config", str(config), cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "coordinator" in line


def test_status_without_certificates_says_how_to_make_them(tmp_path: Path) -> None:
    # Prepare: the default configuration runs under mutual TLS; there are no certificates
    # Execute
    result = _run("status", cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "fedps-certs" in line and "fedps certs" in line


def test_tls_off_needs_insecure_not_enabled_false(tmp_path: Path) -> None:
    # Prepare
    config = tmp_path / "plain.toml"
    config.write_text("[tls]\nenabled = false\n")

    # Execute
    result = _run("status", "--config", str(config), cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "tls" in line and "insecure" in line


def test_experiment_with_bad_grid_axis(tmp_path: Path) -> None:
    # Prepare
    grid = tmp_path / "grid.toml"
    grid.write_text("[grid]\nepsilon = [1.0]\nlearning_rate = [0.1]\n")

    # Execute
    result = _run("experiment", str(grid), "--results", str(tmp_path / "r.jsonl"), cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "unknown grid axis learning_rate" in line
    assert not (tmp_path / "r.jsonl").exists()


def test_experiment_report_without_results(tmp_path: Path) -> None:
    # Prepare / Execute
    result = _run("experiment", "report", str(tmp_path / "absent.jsonl"), cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "results file not found" in line


def test_experiment_report_usage(tmp_path: Path) -> None:
    # Prepare / Execute: report takes exactly one results file.
    result = _run("experiment", "report", cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "usage: fedps experiment report" in line


def test_missing_config_file(tmp_path: Path) -> None:
    # Prepare / Execute
    result = _run("status", "--config", str(tmp_path / "absent.toml"), cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "not found" in line


def test_help_lists_every_command(tmp_path: Path) -> None:
    # Prepare: the installed console script when there is one, else the module.
    script = Path(sys.executable).with_name("fedps")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "fedps.cli"]

    # Execute
    result = subprocess.run(
        [*command, "--help"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=tmp_path,
        env=_ENV,
        check=False,
    )

    # Assert
    assert result.returncode == 0, result.stderr
    listed = {line.strip("│ ").split(" ")[0] for line in result.stdout.splitlines()}
    for name in ["keyholder", "shard", "coordinator", "client", "up", "demo", "status", "ui"]:
        assert name in listed, result.stdout
    assert "experiment" in listed, result.stdout


def test_client_with_a_corrupt_privacy_ledger_stops_naming_it(tmp_path: Path) -> None:
    # Prepare: a client's state folder whose ledger was damaged, and its enrolment token
    config = tmp_path / "client.toml"
    config.write_text(f'[tls]\ninsecure = true\ndirectory = "{tmp_path / "certs"}"\n')
    issue_tokens(tmp_path / "certs", ["client-0"])
    state = tmp_path / "client-state"
    state.mkdir()
    (state / "ledger.json").write_text('{"entries": [')

    # Execute
    result = _run("client", "--config", str(config), "--state-dir", str(state), cwd=tmp_path)

    # Assert: it stops before it connects, saying which file, and leaves the file alone
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("fedps: error: privacy ledger")
    assert str(state / "ledger.json") in last and "corrupt" in last
    assert (state / "ledger.json").read_text() == '{"entries": ['


def test_client_with_an_edited_ledger_and_a_recomputed_sha256_stops_naming_it(
    tmp_path: Path,
) -> None:
    # Prepare: a client's state folder whose recorded spend was edited down, its checksum
    # recomputed as a plain SHA-256 (without the folder's ledger key)
    config = tmp_path / "client.toml"
    config.write_text(f'[tls]\ninsecure = true\ndirectory = "{tmp_path / "certs"}"\n')
    issue_tokens(tmp_path / "certs", ["client-0"])
    state = tmp_path / "client-state"
    folder = ClientState.open(state, identity="client-0")
    folder.record("ab" * 32, PrivacySpend(((1.0, 0.1, 400),), 3.0), privacy=PrivacyConfig())
    folder.close()
    ledger = state / "ledger.json"
    document = json.loads(ledger.read_text())
    del document["hmac_sha256"]
    document["entries"][0]["history"] = [[1.0, 0.1, 1]]
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    document["hmac_sha256"] = hashlib.sha256(canonical).hexdigest()
    ledger.write_text(json.dumps(document))

    # Execute
    result = _run("client", "--config", str(config), "--state-dir", str(state), cwd=tmp_path)

    # Assert: refused as a damaged ledger is: one line that names the file
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("fedps: error: privacy ledger")
    assert str(ledger) in last and "checksum mismatch" in last


def test_client_with_a_flipped_bit_in_its_signing_key_stops_naming_it(tmp_path: Path) -> None:
    # Prepare: a client's state folder (ledger and key), then one bit of the key flipped
    config = tmp_path / "client.toml"
    config.write_text(f'[tls]\ninsecure = true\ndirectory = "{tmp_path / "certs"}"\n')
    issue_tokens(tmp_path / "certs", ["client-0"])
    state = tmp_path / "client-state"
    ClientState.open(state, identity="client-0").close()
    key = state / SIGNING_KEY_FILE
    damaged = bytearray(key.read_bytes())
    damaged[0] ^= 0x01
    key.write_bytes(bytes(damaged))

    # Execute
    result = _run("client", "--config", str(config), "--state-dir", str(state), cwd=tmp_path)

    # Assert: it stops before it connects, naming the key and its checksum
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("fedps: error: signing key")
    assert str(key) in last and "signing.key.sha256" in last


def test_ui_with_a_bad_address(tmp_path: Path) -> None:
    # Execute
    result = _run("ui", "--insecure", "--bind", "nowhere", cwd=tmp_path)

    # Assert
    line = _assert_one_error_line(result)
    assert "HOST:PORT" in line


def test_ui_prints_the_operator_link_once_and_keeps_the_token_private(tmp_path: Path) -> None:
    # Prepare
    command = [sys.executable, "-m", "fedps.cli", "ui", "--insecure", "--bind", "127.0.0.1:0"]

    # Execute
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = ""
        while "dashboard:" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr and proc.stderr.read()
        url = line.split("(operator: ")[1].rstrip(")\n")
        page = httpx.get(url, follow_redirects=True)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_S)

    # Assert
    token_file = tmp_path / "fedps-state" / "ui.token"
    token = token_file.read_text().strip()
    assert url.endswith(f"/?token={token}")
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert page.status_code == 200
    assert "fedps dashboard" in page.text
    assert token not in out + err  # printed once, in the line read above


def test_ui_view_only_prints_a_viewer_link_and_starts_no_run(tmp_path: Path) -> None:
    # Prepare: as Compose runs it beside roles it did not start
    command = [sys.executable, "-m", "fedps.cli", "ui", "--view-only", "--insecure"]
    command += ["--bind", "127.0.0.1:0"]

    # Execute
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = ""
        while "dashboard" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr and proc.stderr.read()
        url = re.findall(r"http://\S+", line)[0]
        with httpx.Client() as browser:
            opened = browser.get(url, follow_redirects=True)
            start = browser.post(url.split("?")[0] + "api/runs", json={"training.rounds": "1"})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=HANG_S)

    # Assert: one read-only link, no operator; the page opens, a run cannot be started
    assert "read-only" in line and "operator" not in line, line
    assert opened.status_code == 200
    assert start.status_code == 403
    assert proc.returncode == -signal.SIGTERM  # it ended by the signal it got
    assert not (tmp_path / "fedps-state" / "ui.token").exists()


def test_a_stopped_role_exits_0_after_its_exit_functions_its_output_flushed(
    tmp_path: Path,
) -> None:
    # Prepare: a process with an exit function and output still in its buffers
    done = tmp_path / "exit-function-ran"
    script = (
        "import atexit, pathlib, sys\n"
        "from fedps.cli.app import _end_now\n"
        f"atexit.register(pathlib.Path({str(done)!r}).touch)\n"
        "sys.stdout = open(sys.stdout.fileno(), 'w', buffering=1 << 16, closefd=False)\n"
        "print('the last line')\n"
        "_end_now()\n"
    )
    # Execute: it ends the way a role that stopped does (without the interpreter's teardown)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=_ENV,
        check=False,
    )
    # Assert
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the last line\n"
    assert done.exists()
