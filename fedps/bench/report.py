"""Render ``fedps bench`` results as markdown tables (ratios against same-run baselines).

The default suite (:func:`render_table`), a comparison with Flower (:func:`render_comparison`)
and the phase profile of a job's rounds (:func:`render_profile`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fedps.bench.round_profile import SERVER_PHASES
from fedps.round_timer import CRITICAL_PATH

__all__ = ["render_comparison", "render_profile", "render_table"]


def _m(value: float) -> str:
    return f"{value / 1e6:.2f} M/s"


def render_table(results: dict[str, Any]) -> str:
    """Markdown tables of the crypto paths, the end-to-end rounds and shard memory."""
    m = results["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Python {m['python']}",
        f"Scheme: {results['params']}",
        f"Decryption error after summing 100 updates: {results['sum_of_100_error_relative']:.2e}"
        " of the update scale",
        "",
        "| params | path | encrypt (1 core) | vs TenSEAL | bytes/param | vs TenSEAL |"
        " shard ingest | decrypt |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size, paths in results["crypto"].items():
        base = paths["tenseal"]
        for name, r in paths.items():
            enc_ratio = r["encrypt_values_per_s"] / base["encrypt_values_per_s"]
            size_ratio = base["bytes_per_param"] / r["bytes_per_param"]
            decrypt = _m(r["decrypt_values_per_s"]) if "decrypt_values_per_s" in r else "-"
            lines.append(
                f"| {int(size):,} | {name} | {_m(r['encrypt_values_per_s'])} | "
                f"{enc_ratio:.1f}x | {r['bytes_per_param']:.2f} | {size_ratio:.1f}x smaller | "
                f"{_m(r['shard_ingest_values_per_s'])} | {decrypt} |"
            )
            if name == "packed":
                extra = (
                    f"|  | packed: offline {_m(r['encrypt_offline_values_per_s'])}, "
                    f"online {_m(r['encrypt_online_values_per_s'])}"
                )
                if "encrypt_all_cores_values_per_s" in r:
                    extra += (
                        f", all {int(r['cores'])} cores {_m(r['encrypt_all_cores_values_per_s'])}"
                    )
                lines.append(extra + " |  |  |  |  |  |  |")
    if "noise" in results:
        n = results["noise"]
        lines.append(
            f"\nDP noise, {int(n['size']):,} values: CSPRNG hardened draw "
            f"{_m(n['secure_values_per_s'])} ({n['slowdown']:.1f}x torch.normal's time), "
            f"{_m(n['secure_float32_values_per_s'])} as float32 "
            f"({n['slowdown_float32']:.1f}x); torch.normal {_m(n['torch_values_per_s'])}"
        )
    if "noise_ahead" in results:
        a = results["noise_ahead"]
        lines.append(
            f"One client's DP-SGD round, {int(a['values']):,} noise values: "
            f"{a['round_s_ahead']:.2f} s with its noise drawn ahead (noise "
            f"{a['noise_s_ahead'] * 1000:.0f} ms) vs {a['round_s_on_demand']:.2f} s on demand "
            f"({a['noise_s_on_demand'] * 1000:.0f} ms): {a['ratio']:.2f}x; drawn ahead in "
            f"{a['fill_s']:.2f} s at low priority"
        )
    if "clipping" in results:
        c = results["clipping"]
        lines.append(
            f"One client's DP-SGD round, ghost clipping {c['ghost']['round_s']:.2f} s vs "
            f"per-sample gradients {c['per_sample']['round_s']:.2f} s: {c['ratio']:.2f}x "
            f"({c['train_ratio']:.2f}x without the noise)"
        )
    lines += ["", "| model | secure round | plaintext round | ratio |", "|---|---:|---:|---:|"]
    for model, r in results["e2e"].items():
        lines.append(
            f"| {model} | {r['secure']['median_round_s']:.2f} s | "
            f"{r['plaintext']['median_round_s']:.2f} s | {r['ratio']:.2f}x |"
        )
    for model, r in results["e2e"].items():
        if "profile" in r:
            lines += ["", f"Where a round of {model} goes:", "", render_profile(r["profile"])]
    lines += ["", "| clients | shard peak RSS |", "|---:|---:|"]
    for clients, r in results["shard_memory"].items():
        lines.append(f"| {clients} | {r['peak_rss_mib']:.0f} MiB |")
    mem = results["shard_memory"]
    if len(mem) >= 2:
        values = [r["peak_rss_mib"] for r in mem.values()]
        lines.append(f"\nShard memory, most clients vs fewest: {values[-1] / values[0]:.2f}x")
    if "verification" in results:
        v = results["verification"]
        lines += [
            "",
            f"Whole-aggregate verification, {int(v['num_params']):,} parameters, "
            f"{int(v['clients'])} clients:",
            "",
            "| | time | vs secure round | bytes per client | vs its update |",
            "|---|---:|---:|---:|---:|",
            f"| client sketch + key holder check + canaries | {v['client_sketch_s'] * 1e3:.0f}"
            f" + {v['keyholder_check_s'] * 1e3:.0f} + {v.get('canary_check_s', 0) * 1e3:.0f} ms"
            f" | {v['time_fraction']:.2%} of {v['round_s']:.2f} s | "
            f"{int(v['commit_bytes'] + v.get('canary_bytes', 0)):,} | "
            f"{v['bytes_fraction']:.2%} of {int(v['push_bytes']):,} |",
        ]
        if "push_phase_s" in v:
            lines.append(
                f"\nPush phase (after every commitment is fixed): median {v['push_phase_s']:.2f} s,"
                f" {v['push_phase_fraction']:.1%} of the secure round: at most what the commit "
                "barrier costs a round (pushes no longer overlap other clients' training)."
            )
    if "rotation" in results:
        lines += _rotation_lines(results["rotation"])
    if "async_vs_sync" in results:
        r = results["async_vs_sync"]
        lines += [
            "",
            f"Time to {r['target']:.0%} accuracy on digits, one client in four 5x slower:",
            "",
            "| mode | seconds to target | final accuracy | updates applied |",
            "|---|---:|---:|---:|",
        ]
        for mode in ("sync", "async"):
            m = r[mode]
            reached = (
                "not reached"
                if m["seconds_to_target"] is None
                else (f"{m['seconds_to_target']:.1f}")
            )
            lines.append(f"| {mode} | {reached} | {m['final_accuracy']} | {m['updates_applied']} |")
        if r["speedup"]:
            lines.append(f"\nasync reaches the target {r['speedup']:.2f}x sooner")
    return "\n".join(lines)


def _rotation_lines(r: dict[str, Any]) -> list[str]:
    """The cost of one key rotation (``measure_rotation``)."""
    every = int(r["every"])
    return [
        "",
        f"Key rotation, {int(r['num_params']):,} parameters ({int(r['blocks'])} blocks):",
        "",
        "| | measured | share |",
        "|---|---:|---:|",
        f"| key holder: new key pair, written | {r['keyholder_rotate_s'] * 1e3:.0f} ms"
        f" + {r['keyholder_publish_s'] * 1e3:.1f} ms to sign the context | |",
        f"| signed public context each client fetches again | {int(r['context_bytes']):,} bytes"
        f" | {r['bytes_fraction']:.2%} of its {int(r['push_bytes']):,}-byte update |",
        f"| client: verify, load, encryptions of zero for every block | "
        f"{r['client_adopt_s']:.2f} s | |",
        f"| secure round after a rotation (every {every} rounds) vs the others | "
        f"{r['round_after_rotation_s']:.2f} s vs {r['round_other_s']:.2f} s"
        f" | {r['round_after_rotation_extra']:+.1%} |",
    ]


def _s(value: float | None) -> str:
    """Seconds, to the millisecond (``-``: none)."""
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def render_profile(profiles: Mapping[str, Mapping[str, Any]]) -> str:
    """The phase table of a job's rounds (:func:`fedps.bench.round_profile.phase_profile`).

    Each phase's median seconds over rounds 2..R: the critical path of each system profiled
    (``secure``, ``plaintext``), then each client of the first; then the servers' own phases.
    Medians of phases do not add up to the median round exactly.
    """
    systems = [s for s in profiles if profiles[s]["critical"]]
    if not systems:
        return "(no phases recorded)"
    first = profiles[systems[0]]
    clients = list(first["clients"])
    head = [f"critical path ({s})" for s in systems] + [f"{c} ({systems[0]})" for c in clients]
    lines = [
        "| phase | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(head),
    ]
    for phase in CRITICAL_PATH:
        row = [profiles[s]["critical"].get(phase) for s in systems]
        row += [first["clients"][c].get(phase) for c in clients]
        if any(v is not None for v in row):
            lines.append(f"| {phase} | " + " | ".join(_s(v) for v in row) + " |")
    round_row = [profiles[s]["round_s"] for s in systems] + [None] * len(clients)
    lines.append("| **round (median)** | " + " | ".join(_s(v) for v in round_row) + " |")
    lines += [
        "",
        "| server phase | " + " | ".join(systems) + " |",
        "|---|" + "---:|" * len(systems),
    ]
    for phase in SERVER_PHASES:
        row = [profiles[s]["server"].get(phase) for s in systems]
        if any(v is not None for v in row):
            lines.append(f"| {phase} | " + " | ".join(_s(v) for v in row) + " |")
    return "\n".join(lines)


def _accuracy(values: list[float | None]) -> str:
    shown = [f"{v:.1%}" for v in values if v is not None and not math.isnan(v)]
    return ", ".join(shown) or "-"


def render_comparison(results: Mapping[str, Any]) -> str:
    """The comparison of each job on each system (:func:`fedps.bench.flower_comparison.compare`).

    The median round (rounds 2..R), fedps over Flower, the accuracy and epsilon of each repeat
    and the bytes per parameter a client sends per round; then each job's phase profile.
    """
    jobs = results["jobs"]
    systems = ("flower", "flower-ghost", "plaintext", "secure")
    names = {
        "flower": "Flower plain",
        "flower-ghost": "Flower + Opacus ghost",
        "plaintext": "fedps plaintext",
        "secure": "fedps secure",
    }
    lines = [
        "| job | system | s/round (median r2..R) | vs Flower | accuracy | epsilon |"
        " bytes/param (up) | load (1 min) |",
        "|---|---|---:|---:|---|---|---:|---|",
    ]
    for name, job in jobs.items():
        j = job["job"]
        ran = [s for s in systems if s in job]
        params = f"{job[ran[0]]['num_params']:,} params, " if ran else ""
        title = f"{name} ({j['model']}, {params}{j['clients']} clients, {j['rounds']} rounds, "
        title += f"sigma {j['noise_multiplier']})"
        for failure in job.get("failed", ()):
            lines.append(
                f"| {title} | {names[failure['system']]} | failed (repeat {failure['repeat']}) "
                "| | | | | |"
            )
            title = ""
        for system in ran:
            r = job[system]
            ratio = f"**{r['vs_flower']:.2f}x**" if "vs_flower" in r else "1.00x"
            if system != "flower" and "vs_flower" not in r:
                ratio = "-"
            epsilon = ", ".join(f"{e:.2f}" for e in r["max_epsilon"])
            loads = ", ".join(
                f"{run['load']['min']:.1f}-{run['load']['max']:.1f}" for run in r["runs"]
            )
            lines.append(
                f"| {title} | {names[system]} | {r['median_round_s']:.3f} | {ratio} | "
                f"{_accuracy(r['final_accuracy'])} | {epsilon} | "
                f"{r['bytes_per_param']:.2f} | {loads} |"
            )
            title = ""
    for name, job in jobs.items():
        if job.get("profile"):
            lines += ["", f"Where a round of {name} goes (median seconds, rounds 2..R):", ""]
            lines.append(render_profile(job["profile"]))
    return "\n".join(lines)
