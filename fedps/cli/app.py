"""The ``fedps`` command: one face that starts every role.

This is the only module of ``fedps`` that imports ``clients`` and ``server``.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer

from crypto.python_child import watch_parent
from fedps.cli.measure import bench, experiment
from fedps.cli.options import (
    ConfigOpt,
    InsecureOpt,
    NewLedgerOpt,
    UiAllowedHostOpt,
    UiOpt,
    setup_logging,
    stop_as_ctrl_c,
    write_json,
)
from fedps.config import FedPSConfig, load_config
from fedps.errors import ConfigError, FedPSError
from fedps.extras import missing_extra
from fedps.startup import loading
from fedps.stop_signal import end_by_stop_signal

if TYPE_CHECKING:
    from fedps.runtime.demo import Watcher

__all__ = ["app", "main"]

app = typer.Typer(
    help="fedps: secure federated training (DP-SGD clients, CKKS-encrypted aggregation).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

_log = logging.getLogger("fedps")


def _end_now() -> NoReturn:
    """End this role or client at once: it stopped, or its training is over.

    By the signal that stopped it, if one did (:mod:`fedps.stop_signal`), else with exit 0.
    What it keeps is written already (atomically, synced); the interpreter's teardown of torch's
    and gRPC's modules would only keep whoever stops it waiting for seconds more on a loaded
    machine (10 s, then it is killed). The exit handlers still run (they flush the logs and
    remove this process's private SEAL folder).
    """
    end_by_stop_signal()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load(config: Path | None, *, insecure: bool = False) -> FedPSConfig:
    if insecure:  # the command line wins over the file's [tls] enabled
        return load_config(config, tls={"insecure": True, "enabled": False})
    return load_config(config)


def _setup_tls(cfg: FedPSConfig, name: str) -> None:
    """Load identity ``tls.name`` under mutual TLS, or warn that traffic is plaintext.

    Before anything connects. The identity defaults to ``name``; mutual TLS is the default,
    plaintext ``--insecure``.
    """
    from fedps.provisioning import setup_tls

    setup_tls(cfg.tls, name)


def _provision(cfg: FedPSConfig) -> None:
    """Create the certificates, enrolment key and tokens in ``tls.directory`` if there are none.

    For ``up`` and ``demo`` on first start.
    """
    from fedps.provisioning import provision_cluster

    try:
        written = provision_cluster(cfg)
    except OSError as exc:
        where = exc.filename or cfg.tls.directory
        raise FedPSError(f"cannot write certificates to {where}: {exc.strerror}") from None
    if written:
        typer.echo(f"created the certificates and enrolment tokens in {cfg.tls.directory}")


@app.command()
def keyholder(
    config: ConfigOpt = None,
    insecure: InsecureOpt = False,
    clear_detections: Annotated[
        bool,
        typer.Option(
            "--clear-detections",
            help="Forget the tampering detected so far (after replacing a quarantined shard).",
        ),
    ] = False,
    party: Annotated[
        int,
        typer.Option(
            "--party",
            help="Run key-holder party I of keyholder.parties (1..P) instead of the key holder.",
        ),
    ] = 0,
) -> None:
    """Run the key holder (generates the CKKS keys on first start), or one of its parties.

    With ``--party I``: party I of ``keyholder.parties``, with its own state folder, certificate
    (``party-I``) and port; on a first start the parties generate the joint key together.
    """
    from server.serve import serve_forever

    setup_logging(True)
    cfg = _load(config, insecure=insecure)
    role = "party" if party else "keyholder"
    _setup_tls(cfg, f"party-{party}" if party else role)
    serve_forever(role, cfg, index=party, clear_detections=clear_detections)
    _end_now()


@app.command()
def shard(
    config: ConfigOpt = None,
    index: Annotated[int, typer.Option(help="Which shard of [cluster] shards.")] = 0,
    insecure: InsecureOpt = False,
    remove: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--remove",
            metavar="SHARD_ID",
            help="Do not run a shard: have the coordinator remove SHARD_ID (shard-1...) from the "
            "ring for good, as the operator; its blocks move to the shards left.",
        ),
    ] = None,
    join: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--join",
            metavar="SHARD_ID",
            help="Do not run a shard: have the coordinator add SHARD_ID, running and empty, to "
            "the ring at the next round, as the operator; about 1/S of the blocks move to it.",
        ),
    ] = None,
    empty: Annotated[
        bool,
        typer.Option(
            "--empty",
            help="Set this shard's old rounds and model aside (in its state folder) and start "
            "empty: a shard declared gone that comes back, before --join.",
        ),
    ] = False,
) -> None:
    """Run one parameter-server shard (or, with --remove or --join, change the ring)."""
    from server.serve import serve_forever

    setup_logging(True)
    cfg = _load(config, insecure=insecure)
    if remove is not None or join is not None:
        _change_ring(cfg, remove=remove, join=join)
        return
    _setup_tls(cfg, f"shard-{index}")
    serve_forever("shard", cfg, index=index, empty=empty)
    _end_now()


def _change_ring(cfg: FedPSConfig, *, remove: str | None, join: str | None) -> None:
    """Have the coordinator remove ``remove`` from the ring, or add ``join``, as the operator."""
    from crypto.tls import OPERATOR_NAME
    from fedps.rpc.coordinator_stub import CoordinatorStub

    if remove is not None and join is not None:
        raise typer.BadParameter("give --remove or --join, not both")
    _setup_tls(cfg, OPERATOR_NAME)
    coordinator = CoordinatorStub(cfg.cluster.coordinator)
    try:
        if remove is not None:
            coordinator.remove_shard(remove)
            typer.echo(f"{remove} removed from the ring; its blocks move to the shards left")
        elif join is not None:
            coordinator.join_shard(join)
            typer.echo(f"{join} joins the ring at the next round; the blocks it takes move to it")
    finally:
        coordinator.close()


@app.command()
def coordinator(
    config: ConfigOpt = None, insecure: InsecureOpt = False, new_ledger: NewLedgerOpt = False
) -> None:
    """Run the coordinator (chief): rounds, evaluation, checkpoints, the privacy ledger."""
    from server.serve import serve_forever

    setup_logging(True)
    cfg = _load(config, insecure=insecure)
    _setup_tls(cfg, "coordinator")
    serve_forever("coordinator", cfg, new_ledger=new_ledger)
    _end_now()


@app.command()
def client(
    config: ConfigOpt = None,
    index: Annotated[
        int,
        typer.Option(
            help="The client's number (its identity client-INDEX, and a built-in "
            "dataset's partition)."
        ),
    ] = 0,
    data: Annotated[
        Optional[list[Path]],  # noqa: UP045 - typer needs Optional here
        typer.Option(
            help="This client's own data, given to the task's load_data. Repeated: the files "
            "are pooled, each loaded as client 0, 1, ... of as many would load it."
        ),
    ] = None,
    name: Annotated[str, typer.Option(help="A display name.")] = "",
    threads: Annotated[int, typer.Option(help="Torch CPU threads for local training.")] = 1,
    state_dir: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional here
        typer.Option(
            help="The client's signing key and privacy ledger, kept across restarts "
            "(default: clients/IDENTITY in cluster.state_dir).",
        ),
    ] = None,
    insecure: InsecureOpt = False,
) -> None:
    """Run one edge client until training is done.

    A restarted client resumes its privacy budget from its state folder.
    """
    # SIGTERM (from `fedps demo`/`up` or an operator) and SIGHUP (its terminal closed) unwind
    # normally, as Ctrl-C does, so helpers stop too; then it ends by the signal (_end_now).
    stop_as_ctrl_c()
    setup_logging(True)
    cfg = _load(config, insecure=insecure)
    if not 0 <= index < cfg.training.clients:
        raise ConfigError(
            f"--index {index} is out of range: training.clients is {cfg.training.clients}, "
            f"so a client's index is 0 to {cfg.training.clients - 1}"
        )
    _setup_tls(cfg, f"client-{index}")
    # No peer's answer ends a client (EdgeClient.run counts and survives them); only its own
    # faults do, each as one line and exit 2 (main): a FedPSError about its configuration,
    # identity, data or state folder, or an OSError of its own files (a full disk).
    try:
        with loading():  # torch, Opacus, the task and this client's data
            import torch

            from clients.edge_client import EdgeClient
            from clients.simulation import SimulatedDevice

            torch.set_num_threads(max(1, threads))
            # The configured slow devices and dropouts (training.slow_fraction, dropout), if any.
            device = SimulatedDevice(cfg.training, index=index)
            client = EdgeClient.open(
                cfg,
                index=index,
                name=name,
                state_dir=state_dir,
                mods=[device],
                data=data[0] if data and len(data) == 1 else data or None,
                on_round=lambda progress: typer.echo(progress.line()),  # one line per round
            )
        summary = client.run()
    except OSError as exc:
        raise FedPSError(f"client-{index}: {exc}") from None
    except (SystemExit, KeyboardInterrupt):  # SIGTERM, SIGHUP, Ctrl-C: its helpers stopped
        _end_now()
    _log.info(
        "client %s done: %d rounds, epsilon %.3f (delta %g), %d bytes pushed",
        summary.client_id,
        summary.rounds_trained,
        summary.epsilon,
        summary.delta,
        summary.bytes_pushed,
    )
    _end_now()


@app.command("replay-clients", hidden=True)
def replay_clients(
    config: ConfigOpt = None,
    first: Annotated[int, typer.Option(help="The first client's number.")] = 0,
    count: Annotated[int, typer.Option(help="How many clients, numbered from --first.")] = 1,
    insecure: InsecureOpt = False,
) -> None:
    """Run clients FIRST..FIRST+COUNT-1 in this process, replaying one update (no training).

    Each is a real edge client on its own thread, under its own certificate
    (:mod:`clients.replay`); ``fedps bench --scale`` starts a few of these processes.
    """
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    setup_logging(False)
    cfg = _load(config, insecure=insecure)
    if first < 0 or count < 1 or first + count > cfg.training.clients:
        raise ConfigError(
            f"--first {first} --count {count}: clients are numbered 0 to "
            f"{cfg.training.clients - 1} (training.clients)"
        )
    if not cfg.tls.enabled:  # under TLS each client presents its own; the process none
        _setup_tls(cfg, "replay-clients")  # warns that traffic is plaintext
    try:
        with loading():  # torch, Opacus and the task
            import torch

            from clients.replay import run_replaying_clients

            torch.set_num_threads(1)
        run_replaying_clients(cfg, range(first, first + count))
    except (SystemExit, KeyboardInterrupt):
        _end_now()
    _end_now()


@app.command()
def certs(
    config: ConfigOpt = None,
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--out", "-o", help="Directory to write to (default: tls.directory)."),
    ] = None,
) -> None:
    """Create the deployment's CA (or reuse the one in DIR) and a certificate per party.

    And an enrolment token per client (for runs without TLS).
    """
    from crypto.enrolment import issue_tokens
    from fedps.provisioning import client_identities, issue_cluster_certificates

    cfg = _load(config)
    directory = out if out is not None else cfg.tls.directory
    try:
        written = issue_cluster_certificates(cfg, directory)
        tokens = issue_tokens(directory, client_identities(cfg))
    except OSError as exc:
        where = exc.filename or directory
        raise FedPSError(f"cannot write certificates to {where}: {exc.strerror}") from None
    for paths in written:
        typer.echo(f"{paths.cert}  {paths.key} (private, mode 600)")
    for token in tokens:
        typer.echo(f"{token} (private, mode 600)")
    typer.echo(
        f"{len(written) - 1} identities signed by {written[0].cert}; copy each party's NAME.crt, "
        f"NAME.key and ca.crt (never ca.key or enrolment.key) to its machine, with "
        f'[tls] directory = "{directory}". Without TLS (--insecure) a client proves its '
        "identity with NAME.token instead, and the coordinator needs enrolment.key."
    )


@app.command()
def up(
    config: Annotated[Path, typer.Argument(help="Cluster configuration (TOML).")],
    insecure: InsecureOpt = False,
    ui: UiOpt = None,
    ui_allowed_host: UiAllowedHostOpt = None,
    new_ledger: NewLedgerOpt = False,
) -> None:
    """Start key holder, shards and coordinator as processes and keep them up until training ends.

    A role that dies is restarted, one line per round is printed, and Ctrl-C or SIGTERM stops every
    role cleanly.

    Creates the certificates and enrolment tokens in ``tls.directory`` on first start.
    """
    from crypto.tls import OPERATOR_NAME
    from fedps.runtime.deployment import Deployment
    from fedps.runtime.preflight import check_names

    setup_logging(True)
    cfg = _load(config, insecure=insecure)
    check_names(cfg)  # before a role starts, not when a client builds its data
    _provision(cfg)
    _setup_tls(cfg, OPERATOR_NAME)  # to read the coordinator's status (and warn if no TLS)
    stop_as_ctrl_c()
    if new_ledger:  # here, once: a coordinator restarted later keeps the new ledger
        _start_new_ledger(cfg.cluster.state_dir / "coordinator")
    deployment = Deployment(config, cfg)
    try:
        with _dashboard(cfg, ui, ui_allowed_host or []):
            deployment.start_servers()
            if finished := deployment.finished_before():
                typer.echo(finished)
            typer.echo(
                f"fedps cluster up; coordinator at {cfg.cluster.coordinator}. Ctrl-C to stop."
            )
            deployment.supervise(echo=typer.echo)
    except KeyboardInterrupt:
        typer.echo("stopping...")
    finally:
        deployment.stop()


def _start_new_ledger(state_dir: Path) -> None:
    """Set the coordinator's privacy ledger in ``state_dir`` aside (between runs only)."""
    from fedps.errors import FedPSError
    from server.coordinator.privacy_ledger import start_new_ledger

    try:
        start_new_ledger(state_dir)
    except FedPSError as exc:
        typer.echo(f"--new-ledger ignored: {exc}", err=True)


def _dashboard(
    cfg: FedPSConfig, ui: str | None, allowed_hosts: list[str]
) -> AbstractContextManager[object]:
    """``--ui HOST:PORT``: the read-only dashboard of ``cfg``'s cluster inside the block."""
    if ui is None:
        return nullcontext()
    from fedps.dashboard import serve_dashboard

    return serve_dashboard(cfg, ui, echo=typer.echo, allowed_hosts=allowed_hosts)


def _demo_dashboard(ui: str | None, allowed_hosts: list[str]) -> Watcher | None:
    """``fedps demo --ui HOST:PORT``: the run's dashboard, its link printed by the demo."""
    if ui is None:
        return None
    from fedps.dashboard import serve_dashboard

    def watch(cfg: FedPSConfig, echo: Callable[[str], None]) -> AbstractContextManager[object]:
        return serve_dashboard(cfg, ui, echo=echo, allowed_hosts=allowed_hosts)

    return watch


@app.command()
def demo(
    config: ConfigOpt = None,
    json_out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--json", help="Write a JSON summary to this file."),
    ] = None,
    rounds: Annotated[Optional[int], typer.Option(help="Override training.rounds.")] = None,  # noqa: UP045
    clients: Annotated[Optional[int], typer.Option(help="Override training.clients.")] = None,  # noqa: UP045
    mode: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(help="Override training.mode: sync (rounds) or async (FedBuff buffers)."),
    ] = None,
    insecure: InsecureOpt = False,
    ui: UiOpt = None,
    ui_allowed_host: UiAllowedHostOpt = None,
    keyholder_parties: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Override keyholder.parties: P key-holder party processes."),
    ] = None,
    keyholder_threshold: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(help="Override keyholder.threshold: how many parties decrypt (T of P)."),
    ] = None,
) -> None:
    """Train on digits with a key holder, 2 shards, a coordinator and 4 clients, locally.

    Under mutual TLS, with certificates made for the run.
    """
    from fedps.runtime.demo import DEMO_LOGS, run_demo
    from fedps.runtime.sweeper import temporary_folder

    setup_logging(False)
    stop_as_ctrl_c()
    overrides: dict[str, dict[str, object]] = {}
    if insecure:
        overrides["tls"] = {"insecure": True, "enabled": False}
    training: dict[str, object] = {}
    if rounds is not None:
        training["rounds"] = rounds
    if clients is not None:
        training["clients"] = clients
    if mode is not None:
        training["mode"] = mode
    if training:
        overrides["training"] = training
    keys = {"parties": keyholder_parties, "threshold": keyholder_threshold}
    if any(v is not None for v in keys.values()):
        overrides["keyholder"] = {k: v for k, v in keys.items() if v is not None}
    # removed at the end (after SIGKILL too); on an error, only the run's logs are kept
    with temporary_folder("fedps-demo-", keep_on_error=DEMO_LOGS) as tmp:
        try:
            summary = run_demo(
                config, tmp, overrides, watch=_demo_dashboard(ui, ui_allowed_host or [])
            )
        except FedPSError:
            if (tmp / DEMO_LOGS).is_dir():
                typer.echo(f"the run's logs are kept in {tmp / DEMO_LOGS}")
            raise
    write_json(json_out, summary.to_json(), "summary")


app.command()(bench)
app.command()(experiment)


@app.command()
def ui(
    config: ConfigOpt = None,
    bind: Annotated[
        str, typer.Option(metavar="HOST:PORT", help="Where the dashboard listens (port 0: any).")
    ] = "127.0.0.1:8765",
    token_file: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            help="Read the operator token from this file (default: a new random token, "
            "written to STATE_DIR/ui.token, mode 600)."
        ),
    ] = None,
    remote_clients: Annotated[
        bool,
        typer.Option(
            "--remote-clients",
            help="A run started from the page starts only the servers; the deployment's "
            "clients join it (default: its clients run as processes here).",
        ),
    ] = False,
    public: Annotated[
        bool,
        typer.Option(
            "--public",
            help="Anyone who can reach the port reads the run without a token: its "
            "configuration, client ids with their epsilon, detections (warns). Default: the "
            "printed viewer or operator link is needed.",
        ),
    ] = False,
    allowed_host: Annotated[
        Optional[list[str]],  # noqa: UP045 - typer needs Optional here
        typer.Option(
            "--allowed-host",
            metavar="NAME",
            help="Serve the dashboard under this name too, as NAME or NAME:PORT (a proxy's; "
            "repeatable): requests for any other name than its address are refused (421).",
        ),
    ] = None,
    view_only: Annotated[
        bool,
        typer.Option(
            "--view-only",
            help="Only show the configured cluster: no operator link, nobody starts or stops "
            "a run from the page (roles started elsewhere, e.g. by Compose).",
        ),
    ] = False,
    insecure: InsecureOpt = False,
) -> None:
    """Serve the web dashboard of the configured cluster to the holders of the printed links.

    It shows live rounds, privacy, participation and the roles' health; the operator (who holds the
    operator's link) starts and stops runs, unless ``--view-only``.
    """
    from crypto.tls import OPERATOR_NAME
    from fedps.dashboard import (
        RunLauncher,
        new_token,
        parse_bind,
        serve_dashboard,
        write_token,
    )

    setup_logging(False)
    parse_bind(bind)  # a bad address fails before anything is written
    cfg = _load(config, insecure=insecure)
    _provision(cfg)
    _setup_tls(cfg, OPERATOR_NAME)  # to read the roles' status
    state_root = cfg.cluster.state_dir
    if view_only:
        stop_as_ctrl_c()
        try:
            with serve_dashboard(
                cfg, bind, echo=typer.echo, public=public, allowed_hosts=allowed_host or ()
            ):
                signal.pause()
        except KeyboardInterrupt:
            typer.echo("stopping...")
        return
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise FedPSError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        if len(token) < 16:
            raise FedPSError(f"the token in {token_file} is shorter than 16 characters")
    else:
        token = new_token()
        write_token(state_root / "ui.token", token)
    base = {"tls": {"insecure": True, "enabled": False}} if insecure else {}
    launcher = RunLauncher(
        config, base_overrides=base, state_root=state_root, local_clients=not remote_clients
    )
    stop_as_ctrl_c()
    try:
        with serve_dashboard(
            cfg,
            bind,
            echo=typer.echo,
            token=token,
            launcher=launcher,
            public=public,
            allowed_hosts=allowed_host or (),
        ):
            signal.pause()
    except KeyboardInterrupt:
        typer.echo("stopping...")
    finally:
        launcher.stop()


@app.command()
def status(
    config: ConfigOpt = None,
    insecure: InsecureOpt = False,
    json_out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--json",
            help="Also write the coordinator's status (each round with its phases) as JSON.",
        ),
    ] = None,
) -> None:
    """Print the cluster's health as the coordinator sees it (as the operator identity)."""
    from crypto.tls import OPERATOR_NAME
    from fedps.runtime.cluster_status import print_status, status_json

    cfg = _load(config, insecure=insecure)
    _setup_tls(cfg, OPERATOR_NAME)
    status = print_status(cfg)
    write_json(json_out, status_json(status), "status")


@app.command()
def export(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Where to write the model's state_dict (.pt).")
    ],
    config: ConfigOpt = None,
    insecure: InsecureOpt = False,
) -> None:
    """Write the trained global model as a PyTorch state_dict.

    It is pulled from the shards with the key holder's signature checked (as the operator identity);
    it loads into the task's model with model.load_state_dict(torch.load(PATH)).
    """
    from crypto.tls import OPERATOR_NAME
    from fedps.runtime.export import export_model

    setup_logging(False)
    cfg = _load(config, insecure=insecure)
    _setup_tls(cfg, OPERATOR_NAME)
    version = export_model(cfg, out)
    typer.echo(f"model version {version} written to {out}")


def main() -> None:
    """Console-script entry point: expected errors become one line on stderr, exit 2.

    A command stopped by SIGTERM, SIGHUP or SIGINT ends by that signal once it has cleaned up
    (:mod:`fedps.stop_signal`).
    """
    watch_parent()  # started by another fedps process: stop once it is gone
    try:
        _run()
    finally:
        # The interpreter's exit collects garbage across every object left, the hundreds of
        # thousands of torch's and Opacus's modules included: seconds of CPU (a client's exit
        # took 2 s of CPU, 15 s on a loaded machine) to free memory the process gives back
        # anyway. Frozen objects are left out of that collection (fedps.startup); atexit
        # handlers still run.
        gc.freeze()
        end_by_stop_signal()


def _run() -> None:
    """The command; expected errors become one line on stderr, exit 2."""
    try:
        app()
    except FedPSError as exc:
        print(f"fedps: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ModuleNotFoundError as exc:  # an optional dependency (pip extra) not installed
        missing = missing_extra(exc)
        if missing is None:
            raise
        print(f"fedps: error: {missing}", file=sys.stderr)
        sys.exit(2)
