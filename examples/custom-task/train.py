"""Train the wine classifier from one Python script, through fedps's API (docs/api.md).

    python train.py [CONFIG]    # default: fedps.toml beside this file, its run in state-script/

The key holder, the shards and the coordinator are processes (as with ``fedps up``), and so is
each client (``cluster.start_client``, with its own file): a script speaks as one TLS identity,
the operator's. No ``if __name__ == "__main__":`` guard is needed: fedps never re-runs it.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from prepare_data import write_client_files
from wine_task.classify import model, read_csv

import fedps
from fedps.config import load_config

HERE = Path(__file__).resolve().parent
CLIENTS = 3

if len(sys.argv) > 1:
    config = load_config(Path(sys.argv[1]))
else:
    # fedps.toml with a state folder of its own: the one of `fedps up` (state/) holds that
    # run, finished, and a cluster started on it would resume it rather than train again.
    config = load_config(HERE / "fedps.toml", cluster={"state_dir": str(HERE / "state-script")})
files = write_client_files(HERE / "data", CLIENTS)
with fedps.LocalCluster(config) as cluster:
    for index, path in enumerate(files):
        cluster.start_client(index, data=path)
    history = cluster.wait_finished()
    cluster.export_model(HERE / "wine.pt")  # the global model, its signature checked

final = history.rounds[-1]
print(
    f"{len(history.rounds)} rounds: accuracy {final.metrics['accuracy']:.4f}, "
    f"epsilon {history.max_epsilon:.2f} (delta {history.delta:g}, the maximum over the clients)"
)

# The exported state_dict loads into the task's own model, here, without fedps.
net = model()
net.load_state_dict(torch.load(HERE / "wine.pt"))
x, y = read_csv(HERE / "data" / "test.csv")
with torch.no_grad():
    predicted = net(torch.from_numpy(x)).argmax(dim=1).numpy()
print(f"exported model: accuracy {float(np.mean(predicted == y)):.4f} on data/test.csv")
