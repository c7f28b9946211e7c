"""The measuring commands: ``fedps bench`` and ``fedps experiment``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedps.cli.options import setup_logging, stop_as_ctrl_c, write_json
from fedps.errors import FedPSError

__all__ = ["bench", "experiment"]


def bench(
    json_out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--json", help="Write the results as JSON to this file."),
    ] = None,
    sizes: Annotated[
        str, typer.Option(help="Model sizes (parameters) for the crypto paths, comma-separated.")
    ] = "100000,1000000,10000000",
    models: Annotated[
        str, typer.Option(help="Models for the end-to-end secure vs plaintext rounds.")
    ] = "mlp,mlp1m",
    memory_clients: Annotated[
        str, typer.Option(help="Client counts for the shard memory measurement.")
    ] = "10,200",
    rounds: Annotated[int, typer.Option(help="Rounds per end-to-end run.")] = 6,
    async_target: Annotated[
        float,
        typer.Option(help="Also time sync vs async to this digits accuracy (0: skip)."),
    ] = 0.0,
    against: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--against",
            metavar="flower",
            help="Run --jobs on Flower's plain FedAvg with Opacus too (per-sample gradients, "
            "and ghost clipping), alternating with fedps secure and plaintext; report the "
            "ratio per round (instead of the default suite).",
        ),
    ] = None,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Run --jobs on fedps secure and plaintext and print where their rounds go, "
            "phase by phase (instead of the default suite).",
        ),
    ] = False,
    jobs: Annotated[
        str, typer.Option(help="Jobs for --against and --profile, comma-separated.")
    ] = "digits,mlp1m",
    job_rounds: Annotated[
        int, typer.Option(help="Rounds of each job (0: its own: digits 40, mlp1m 10).")
    ] = 0,
    repeats: Annotated[
        int,
        typer.Option(
            help="Runs of each system (or setting) for each job (--against, --profile, "
            "--compression)."
        ),
    ] = 1,
    scale: Annotated[
        str,
        typer.Option(
            help="Client counts for the scale runs, comma-separated: each runs that many "
            "clients that replay one update through the real protocol, and measures every "
            "role (instead of the default suite).",
        ),
    ] = "",
    scale_model: Annotated[str, typer.Option(help="The model of the --scale runs.")] = "mlp1m",
    scale_rounds: Annotated[int, typer.Option(help="Rounds of each --scale run.")] = 4,
    scale_hosts: Annotated[
        int, typer.Option(help="Processes the clients of a --scale run are spread over.")
    ] = 2,
    compression: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--compression",
            metavar="1,0.1+ef,8bit,0.1+ef+8bit",
            help="Run --jobs secure at these compression settings (DENSITY, +ef: error "
            "feedback, +Bbit: values quantized to B bits and packed), alternating: bytes per "
            "parameter and accuracy (instead of the default suite).",
        ),
    ] = None,
    parties: Annotated[
        int,
        typer.Option(
            help="Time key generation and one round's decryption with this many key-holder "
            "parties against one key holder, alternating, on a --parties-size model, then "
            "secure rounds of --parties-job with parties and with one key holder, alternating "
            "(--repeats, --job-rounds) (instead of the default suite; 0: not).",
        ),
    ] = 0,
    parties_threshold: Annotated[
        int, typer.Option(help="How many of the --parties decrypt together (T).")
    ] = 2,
    parties_size: Annotated[
        int, typer.Option(help="The model's parameters for --parties.")
    ] = 1_000_000,
    parties_job: Annotated[
        str, typer.Option(help="The job whose secure rounds --parties times (empty: none).")
    ] = "mlp1m",
) -> None:
    """Measure encryption cost against TenSEAL's default and plaintext, in one run.

    With --against flower or --profile: the same job on Flower and fedps, and where its rounds
    go. With --scale: many clients through the real protocol, and what each role costs.
    With --compression: the same job at several compression settings. With --parties P:
    key generation and one round's decryption, P key-holder parties against one key holder.
    """
    from rich.console import Console

    setup_logging(False)
    stop_as_ctrl_c()
    console = Console()
    if parties:
        from fedps.bench.parties_bench import render_parties, run_parties_bench

        result = run_parties_bench(
            parties=parties,
            threshold=parties_threshold,
            size=parties_size,
            repeats=repeats,
            console=console,
        )
        console.print(render_parties(result), markup=False, highlight=False, soft_wrap=True)
        if parties_job:
            from fedps.bench.flower_comparison import job_named
            from fedps.bench.party_rounds import compare_party_rounds, render_party_rounds

            result["rounds"] = compare_party_rounds(
                job_named(parties_job, job_rounds),
                parties=parties,
                threshold=parties_threshold,
                repeats=repeats,
                console=console,
            )
            text = render_party_rounds(result["rounds"])
            console.print(text, markup=False, highlight=False, soft_wrap=True)
        write_json(json_out, json.dumps(result, indent=2) + "\n", "results")
        return
    if scale:
        from fedps.bench.scale_bench import render_scale, run_scale_bench

        runs = [
            run_scale_bench(
                clients=int(n),
                model=scale_model,
                rounds=scale_rounds,
                hosts=scale_hosts,
                console=console,
            )
            for n in scale.split(",")
            if n
        ]
        console.print(render_scale(runs), markup=False, highlight=False, soft_wrap=True)
        write_json(json_out, json.dumps(runs, indent=2) + "\n", "results")
        return
    if compression is not None:
        from fedps.bench.compression_bench import (
            compare_compression,
            parse_settings,
            render_compression,
        )
        from fedps.bench.flower_comparison import job_named

        chosen_jobs = [job_named(name, job_rounds) for name in jobs.split(",") if name]
        measured = compare_compression(
            chosen_jobs, parse_settings(compression), repeats=repeats, console=console
        )
        console.print(render_compression(measured), markup=False, highlight=False, soft_wrap=True)
        write_json(json_out, json.dumps(measured, indent=2) + "\n", "results")
        return
    if against is not None or profile:
        from fedps.bench.flower_comparison import compare, job_named
        from fedps.bench.report import render_comparison

        if against not in (None, "flower"):
            raise FedPSError(f"--against {against}: only flower is supported")
        chosen = [job_named(name, job_rounds) for name in jobs.split(",") if name]

        def save(so_far: dict[str, object]) -> None:  # after each job: a failure keeps the rest
            if json_out is not None:
                json_out.write_text(json.dumps(so_far, indent=2) + "\n")

        compared = compare(
            chosen, flower=against is not None, repeats=repeats, console=console, on_job=save
        )
        console.print(render_comparison(compared), markup=False, highlight=False, soft_wrap=True)
        write_json(json_out, json.dumps(compared, indent=2) + "\n", "results")
        return
    from fedps.bench.benchmark import run_bench, time_to_accuracy
    from fedps.bench.report import render_table

    results = run_bench(
        sizes=[int(s) for s in sizes.split(",") if s],
        e2e_models=[m for m in models.split(",") if m],
        memory_clients=[int(c) for c in memory_clients.split(",") if c],
        rounds=rounds,
        console=console,
    )
    if async_target > 0:
        console.print("sync vs async with one client in four 5x slower ...")
        results["async_vs_sync"] = time_to_accuracy(
            target=async_target, slow_fraction=0.25, slow_factor=5.0, rounds=20
        )
    console.print(render_table(results))
    write_json(json_out, json.dumps(results, indent=2) + "\n", "results")


def experiment(
    args: Annotated[
        list[str],
        typer.Argument(
            help="GRID.toml to run a sweep, or `report RESULTS.jsonl` to render its report.",
            metavar="GRID.toml | report RESULTS.jsonl",
        ),
    ],
    results: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--results", "-r", help="Results file (JSON lines; default GRID-results.jsonl)."
        ),
    ] = None,
    out: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--out", "-o", help="Report directory (default RESULTS-report)."),
    ] = None,
    workdir: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Keep each point's state and logs here (default: a temporary dir)."),
    ] = None,
) -> None:
    """Privacy-accuracy sweep: one real platform run per grid point, resumable."""
    setup_logging(False)
    stop_as_ctrl_c()
    if args[0] == "report":
        from fedps.experiments.report import render_report

        if len(args) != 2 or results is not None or workdir is not None:
            raise FedPSError("usage: fedps experiment report RESULTS.jsonl [--out DIR]")
        path = Path(args[1])
        report = render_report(path, out or path.with_name(f"{path.stem}-report"))
        typer.echo(f"report written to {report}")
        return
    from fedps.experiments.experiment import run_experiment

    if len(args) != 1 or out is not None:
        raise FedPSError("usage: fedps experiment GRID.toml [--results FILE] [--workdir DIR]")
    grid = Path(args[0])
    results = results or Path(f"{grid.stem}-results.jsonl")
    records = run_experiment(grid, results, workdir=workdir)
    failed = sum(1 for r in records if "error" in r)
    typer.echo(f"{len(records)} points in {results} (and {results.with_suffix('.csv')})")
    if failed:
        raise FedPSError(
            f"{failed} of {len(records)} points failed (see their error in {results}); "
            "run the same command again to retry them"
        )
    typer.echo(f"report: fedps experiment report {results}")
