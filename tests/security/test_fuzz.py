"""Fuzzing every RPC and every deserialisation path, in a subprocess so that a crash shows.

The fuzz itself is the package ``tests/security/fuzz/`` (its ``__main__`` describes the inputs;
one module per service holds that service's oracles). Acceptance: at least 10,000 malformed
messages to each RPC of the ``Shard``, ``KeyHolder`` and ``Coordinator`` services and 10,000
inputs to each deserialisation path, with zero crashes, zero unexpected statuses (INTERNAL, UNKNOWN,
DEADLINE_EXCEEDED, ...), zero malformed requests accepted, zero genuine requests (a repeated
commitment, the open round's challenge) refused, zero malformed blocks added to a shard's
sums, and no change to the published model or the key holder's commitments. The full runs
are ``slow``; the smoke runs (200 per RPC or path, tighter time limits) are part of the
default quick run.

On 2 cores the full runs take about 5 minutes (RPCs, one test per service so that test
workers share them) and 1.5 minutes (deserialisation) when nothing is wrong; an RPC that hangs
or is slow to fail stops early and fails the test.

``FEDPS_FUZZ_N`` overrides the full count, ``FEDPS_FUZZ_SEED`` the seed (default 0) and
``FEDPS_FUZZ_RPC_BUDGET_S`` the time allowed per RPC or path (default 180 s). To reproduce
a failure, run the command printed in the failure message from the repository root.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FULL_N = int(os.environ.get("FEDPS_FUZZ_N", "10000"))
SEED = os.environ.get("FEDPS_FUZZ_SEED", "0")
BUDGET_S = float(os.environ.get("FEDPS_FUZZ_RPC_BUDGET_S", "180"))
SMOKE_N = 200
#: Options of the smoke runs: fail fast on a hang instead of waiting for the full budget.
SMOKE_OPTIONS = ["--rpc-budget", "30", "--path-budget", "30", "--call-timeout", "5"]


SERVICES = ("Shard", "KeyHolder", "Coordinator")


def _services(only: str | None = None) -> list[str]:
    """Every RPC of the three services (or of service ``only``), as ``Service.Method``."""
    from fedps.proto import coordinator_pb2, keyholder_pb2, shard_pb2

    names = []
    for module, service in zip((shard_pb2, keyholder_pb2, coordinator_pb2), SERVICES, strict=True):
        if only in (None, service):
            for method in module.DESCRIPTOR.services_by_name[service].methods:
                names.append(f"{service}.{method.name}")
    return names


def _run(
    mode: str, n: int, tmp_path: Path, *, timeout: float, options: list[str]
) -> tuple[dict[str, Any], str, str]:
    """Run the fuzz target; returns its JSON report, stderr tail and command line."""
    crumb = tmp_path / f"fuzz-{mode}.breadcrumb"
    command = [
        sys.executable,
        "-m",
        "tests.security.fuzz",
        mode,
        str(n),
        SEED,
        *options,
    ]
    shown = "python " + shlex.join(command[1:])
    try:
        proc = subprocess.run(
            [*command, "--breadcrumb", str(crumb)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        where = crumb.read_text().strip() if crumb.exists() else "?"
        stderr = (
            exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        )
        pytest.fail(f"`{shown}` did not finish in {timeout:.0f} s (last: {where})\n{stderr}")
    tail = proc.stderr[-8000:]
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        where = crumb.read_text().strip() if crumb.exists() else "?"
        pytest.fail(
            f"CRASH: the fuzz target died of {name} during {where!r}. Reproduce with "
            f"`{shown} --only ...` from the repository root.\n{tail}"
        )
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not reports:
        pytest.fail(f"`{shown}` exited {proc.returncode} without a report\n{tail}")
    report: dict[str, Any] = json.loads(reports[-1])
    if "error" in report:
        pytest.fail(f"`{shown}` failed before fuzzing:\n{report['error']}")
    report["_returncode"] = proc.returncode
    return report, tail, shown


def _examples(entry: dict[str, Any]) -> list[str]:
    lines = []
    for category, examples in entry.get("examples", {}).items():
        if examples:
            lines.append(f"    {category}: {json.dumps(examples[0], default=str)[:700]}")
    return lines


def _print_table(report: dict[str, Any], key: str) -> None:
    """Calls and seconds per RPC or path (shown by pytest with the failure, or with -rP)."""
    print(f"{_shown_name(key):<58} {'calls':>7} {'seconds':>8}")
    for name, r in report[key].items():
        print(f"{name:<58} {r['calls']:>7} {r['seconds']:>8}")
    print(f"total {report['seconds']} s")


def _shown_name(key: str) -> str:
    return "RPC" if key == "rpcs" else "deserialisation path"


def _check_rpc(report: dict[str, Any], n: int, shown: str, service: str | None = None) -> None:
    _print_table(report, "rpcs")
    problems = []
    rpcs: dict[str, Any] = report["rpcs"]
    missing = sorted(set(_services(service)) - set(rpcs))
    if missing:
        problems.append(f"RPCs not fuzzed: {missing}")
    for name, r in rpcs.items():
        issues = []
        if r["calls"] < n:
            issues.append(f"only {r['calls']} of {n} calls ({r['stopped'] or 'no reason'})")
        if r["unexpected"]:
            issues.append(f"{r['unexpected']} unexpected statuses")
        if r["accepted_malformed"]:
            reasons = r.get("accepted_malformed_reasons", {})
            issues.append(f"{r['accepted_malformed']} malformed requests accepted {reasons}")
        if r["refused_genuine"]:
            issues.append(f"{r['refused_genuine']} genuine requests refused")
        if issues:
            problems.append(f"{name}: " + "; ".join(issues) + f"; codes {r['codes']}")
            problems += _examples(r)
    if report["accepted_malformed_blocks"]:
        problems.append(f"{report['accepted_malformed_blocks']} malformed blocks accepted")
    for change in report["state_changes_after_push"] + report["state_changes"]:
        problems.append(f"state changed by malformed requests: {change}")
    for phase, failed in report["liveness_failures"].items():
        problems.append(f"liveness check failed after {phase}: {failed}")
    if problems or report["_returncode"] != 0:
        pytest.fail(
            f"`{shown}` found problems (exit {report['_returncode']}):\n" + "\n".join(problems)
        )


def _check_deser(report: dict[str, Any], n: int, shown: str) -> None:
    _print_table(report, "paths")
    problems = []
    for name, r in report["paths"].items():
        issues = []
        if r["calls"] < n:
            issues.append(f"only {r['calls']} of {n} inputs ({r['stopped'] or 'no reason'})")
        if r["failures"]:
            issues.append(f"{r['failures']} inputs neither refused (FedPSError) nor validated")
        if issues:
            problems.append(f"{name}: " + "; ".join(issues))
            problems += [
                f"    input {e['input']}: {e['problem']} ({e['data']})" for e in r["examples"]
            ]
    if problems or report["_returncode"] != 0:
        pytest.fail(
            f"`{shown}` found problems (exit {report['_returncode']}):\n" + "\n".join(problems)
        )


@pytest.mark.integration
def test_rpc_fuzz_smoke(tmp_path: Path) -> None:
    # Execute
    report, _, shown = _run("rpc", SMOKE_N, tmp_path, timeout=900, options=SMOKE_OPTIONS)
    # Assert
    _check_rpc(report, SMOKE_N, shown)


def test_deser_fuzz_smoke(tmp_path: Path) -> None:
    # Execute
    report, _, shown = _run("deser", SMOKE_N, tmp_path, timeout=600, options=SMOKE_OPTIONS)
    # Assert
    _check_deser(report, SMOKE_N, shown)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("service", SERVICES)
def test_rpc_fuzz(tmp_path: Path, service: str) -> None:
    # Prepare: one service's RPCs (three runs that test workers can share), each RPC at most
    # BUDGET_S, plus start-up and the final checks
    rpcs = _services(service)
    options = ["--rpc-budget", f"{BUDGET_S:g}", *(f"--only={rpc}" for rpc in rpcs)]
    timeout = len(rpcs) * (BUDGET_S + 30) + 300
    # Execute
    report, _, shown = _run("rpc", FULL_N, tmp_path, timeout=timeout, options=options)
    # Assert
    _check_rpc(report, FULL_N, shown, service)


@pytest.mark.slow
@pytest.mark.integration
def test_deser_fuzz(tmp_path: Path) -> None:
    # Prepare
    options = ["--path-budget", f"{BUDGET_S:g}"]
    # Execute
    report, _, shown = _run("deser", FULL_N, tmp_path, timeout=12 * BUDGET_S + 300, options=options)
    # Assert
    _check_deser(report, FULL_N, shown)
