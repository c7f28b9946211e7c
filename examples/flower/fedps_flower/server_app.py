"""ServerApp: fedps's coordinator as a Flower strategy.

The strategy opens each round on the fedps shards, sends the nodes their tasks, and has the
fedps key holder decrypt and apply the aggregate; ``result.arrays`` is the model the key
holder published, so this app trains exactly what ``fedps demo`` would.
"""

from __future__ import annotations

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedps_flower.settings import fedps_config
from server.flower.flower_strategy import FlowerStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train ``num-server-rounds`` rounds and save the final model."""
    config = fedps_config(context)
    strategy = FlowerStrategy(config, fraction_train=float(context.run_config["fraction-train"]))
    result = strategy.start(
        grid=grid,
        initial_arrays=strategy.initial_arrays(),
        num_rounds=int(context.run_config["num-server-rounds"]),
    )
    path = config.cluster.state_dir / "final_model.pt"
    torch.save(result.arrays.to_torch_state_dict(), path)
    print(f"final model (the key holder's last published version) saved to {path}")
