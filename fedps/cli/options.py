"""What the ``fedps`` commands share: their common options, logging, stopping and output."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedps.stop_signal import interrupt_on_stop_signals

__all__ = [
    "ConfigOpt",
    "InsecureOpt",
    "NewLedgerOpt",
    "UiAllowedHostOpt",
    "UiOpt",
    "setup_logging",
    "stop_as_ctrl_c",
    "write_json",
]

ConfigOpt = Annotated[
    Optional[Path],  # noqa: UP045 - typer needs Optional here
    typer.Option("--config", "-c", help="TOML configuration (default: built-in defaults)."),
]
InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Turn mutual TLS off: plaintext gRPC, clients admitted by enrolment token (warns).",
    ),
]
NewLedgerOpt = Annotated[
    bool,
    typer.Option(
        "--new-ledger",
        help="Start a new server-side privacy ledger with a new run: every client's epsilon "
        "starts again from 0 (warns; the old ledger is kept aside). Ignored while a run is in "
        "progress.",
    ),
]
UiOpt = Annotated[
    Optional[str],  # noqa: UP045 - typer needs Optional here
    typer.Option(
        "--ui",
        metavar="HOST:PORT",
        help="Serve the read-only web dashboard on HOST:PORT beside the run (port 0: any); "
        "it prints the link that opens it, with a viewer token.",
    ),
]
UiAllowedHostOpt = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer needs Optional here
    typer.Option(
        "--ui-allowed-host",
        metavar="NAME",
        help="Serve the --ui dashboard under this name too (a proxy's; repeatable): requests "
        "for any other name than its address are refused.",
    ),
]


def setup_logging(verbose: bool) -> None:
    """Log to stderr: INFO and above with ``verbose``, else warnings and errors only."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,  # a dependency may have configured the root logger on import
    )


def stop_as_ctrl_c() -> None:
    """SIGTERM and SIGHUP stop this command as Ctrl-C does, and it then ends by the signal.

    The roles it started are stopped in order and its temporary folders removed (``timeout``,
    CI, systemd and a closed terminal stop a command with these); :func:`main` then ends it by
    the signal it got (:mod:`fedps.stop_signal`).
    """
    interrupt_on_stop_signals()


def write_json(path: Path | None, text: str, what: str) -> None:
    """``--json``: write ``text`` (``what``, JSON) to ``path``, if one was given."""
    if path is not None:
        path.write_text(text)
        typer.echo(f"{what} written to {path}")
