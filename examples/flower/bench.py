"""Flower at scale: round time, bytes and shard memory at 100, 500 and 1,000 virtual nodes.

Usage (from the repository root, with Flower installed as docs/flower.md describes)::

    python examples/flower/bench.py --json flower-bench.json
    python examples/flower/bench.py --sizes 100 --rounds 2     # a quick look

Each node runs :func:`clients.flower.flower_client.create_client_app` (DP-SGD with Opacus, CKKS
encryption, signed pushes to the shards) and the server runs
:class:`server.flower.flower_strategy.FlowerStrategy` through Flower's ``Strategy.start`` loop; see
:mod:`fedps.bench.flower_bench` for what is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from torch import nn

from clients.flower.flower_client import FlowerClient, create_client_app
from crypto.signing import BlockSigner
from fedps.bench.flower_bench import RUNTIMES, run_flower_bench
from fedps.config import FedPSConfig
from fedps.learning import models

_MODEL = "mlp128"


def _register_mlp128() -> None:
    """A 101,770-parameter MLP on 784 features (784-128-10), the issue's 100k model.

    Temporary: fedps.learning.models has no ~100k-parameter model yet; once it registers one, pass
    its name with --model and delete this function.
    """
    if _MODEL not in models.model_names():
        models._MODELS[_MODEL] = lambda features, classes: nn.Sequential(
            nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, classes)
        )


def _client(config: FedPSConfig, *, index: int, signer: BlockSigner) -> FlowerClient:
    """A node's client; registers the model first (Ray actors import only what they run)."""
    _register_mlp128()
    return FlowerClient(config, index=index, signer=signer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=_MODEL)
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--workers", type=int, default=2, help="threads or Ray actors")
    parser.add_argument("--runtime", choices=sorted(RUNTIMES), default="pool")
    parser.add_argument("--max-clients", type=int, default=1000, help="sizes the CKKS params")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("flwr").setLevel(logging.WARNING)  # no per-round summaries
    torch.set_num_threads(1)
    _register_mlp128()
    largest = max(args.sizes)
    results = run_flower_bench(
        # Every node's client stays built between rounds, as one process per node would.
        lambda config: create_client_app(config, client_factory=_client, cache_size=largest),
        sizes=args.sizes,
        rounds=args.rounds,
        model=args.model,
        dataset=args.dataset,
        workers=args.workers,
        runtime=args.runtime,
        max_clients=args.max_clients,
    )
    print(
        f"{'clients':>8} {'params':>8} {'round s':>8} {'setup s':>8} {'MB/client':>9} "
        f"{'shard peak MiB':>14} {'shard idle MiB':>14}"
    )
    for size in results["sizes"]:
        idle = max(m["rss_mib"] for m in size["shards_idle"].values())
        print(
            f"{size['clients']:>8} {size['num_params']:>8} {size['median_round_s']:>8.1f} "
            f"{size['setup_s']:>8.1f} {size['bytes_per_client'] / 1e6:>9.2f} "
            f"{size['shard_peak_rss_mib']:>14.1f} {idle:>14.1f}"
        )
    print(f"shard peak memory, largest / smallest cohort: {results['shard_memory_ratio']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
