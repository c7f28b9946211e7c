"""Fuzzing every RPC and every deserialisation path, in a subprocess so that a crash shows.

The fuzz itself is the package ``tests/security/fuzz/`` (its ``__main__`` describes the inputs;
one module per service holds that service's oracles). Acceptance: malformed messages to each
RPC of the ``Shard``, ``KeyHolder`` and ``Coordinator`` services and inputs to each
deserialisation path (2,000 each in the suite, whose time is bounded; 10,000 each with
``FEDPS_FUZZ_N=10000``, as when the fuzz was accepted), with zero crashes, zero unexpected
statuses (INTERNAL, UNKNOWN, DEADLINE_EXCEEDED, ...), zero malformed requests accepted, zero
genuine requests (a repeated commitment, the open round's challenge) refused, zero malformed
blocks added to a shard's sums, and no change to the published model or the key holder's
commitments. The full runs are ``slow``; the smoke runs (200 per RPC or path) are part of
the default quick run.

Why 2,000: the inputs come from a fixed seed, so the suite sends the same ones every run; what
they can find is the code they reach. Measured with coverage.py (the branches of ``fedps``,
``server``, ``crypto`` and ``clients``), 2,000 inputs reach every branch that 4,000 reach for
each RPC of the ``KeyHolder`` and ``Coordinator`` services and each deserialisation path. For
``Shard``, 4,000 reached two paths more, each once, both in ``Publish``: blocks of the right
layout that the key holder did not sign (the oracle skipped every publish of the right layout;
it now judges the signatures, so such publishes are sent, and must be refused, dozens of times
in 2,000), and a stream that gRPC cut at a message over the servers' 8 MiB limit (now 1 in 50
of the mutated publishes). More inputs, and other seeds, are for runs by hand
(``FEDPS_FUZZ_N``, ``FEDPS_FUZZ_SEED``).

The work is bounded by counts, not clocks: every run sends exactly its N inputs however long
a loaded machine takes. On 2 cores the full runs of 10,000 take about 5 minutes (RPCs, one
test per service so that test workers share them) and 1.5 minutes (deserialisation) when
nothing is wrong; the suite's 2,000 a fifth of that. The only clocks are hang guards: a
call's deadline (60 s; an RPC whose calls hang stops early and fails the test) and
:data:`HANG_S` for the whole subprocess.

``FEDPS_FUZZ_N`` overrides the full count and ``FEDPS_FUZZ_SEED`` the seed (default 0). To
reproduce a failure, run the command printed in the failure message from the repository
root.
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
#: Inputs per RPC of a full run: 2,000 in the suite (the branches 4,000 reach: see above),
#: more by hand.
FULL_N = int(os.environ.get("FEDPS_FUZZ_N", "2000"))
SEED = os.environ.get("FEDPS_FUZZ_SEED", "0")
SMOKE_N = 200
#: Hang guard of one fuzz subprocess (its start-up included): more than ten times the few
#: minutes a full run takes on 2 cores; only a run that is really stuck reaches it.
HANG_S = 1800.0


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
    mode: str, n: int, tmp_path: Path, *, options: list[str] | None = None
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
        *(options or []),
    ]
    shown = "python " + shlex.join(command[1:])
    try:
        proc = subprocess.run(
            [*command, "--breadcrumb", str(crumb)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        where = crumb.read_text().strip() if crumb.exists() else "?"
        stderr = (
            exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        )
        pytest.fail(
            f"hang guard: `{shown}` did not finish in {HANG_S:g} s (last: {where})\n{stderr}"
        )
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
            issues.append(f"only {r['calls']} of {n} inputs")
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
    report, _, shown = _run("rpc", SMOKE_N, tmp_path)
    # Assert
    _check_rpc(report, SMOKE_N, shown)


def test_deser_fuzz_smoke(tmp_path: Path) -> None:
    # Execute
    report, _, shown = _run("deser", SMOKE_N, tmp_path)
    # Assert
    _check_deser(report, SMOKE_N, shown)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("service", SERVICES)
def test_rpc_fuzz(tmp_path: Path, service: str) -> None:
    # Prepare: one service's RPCs (three runs that test workers can share)
    options = [f"--only={rpc}" for rpc in _services(service)]
    # Execute
    report, _, shown = _run("rpc", FULL_N, tmp_path, options=options)
    # Assert
    _check_rpc(report, FULL_N, shown, service)


@pytest.mark.slow
@pytest.mark.integration
def test_deser_fuzz(tmp_path: Path) -> None:
    # Execute
    report, _, shown = _run("deser", FULL_N, tmp_path)
    # Assert
    _check_deser(report, FULL_N, shown)
