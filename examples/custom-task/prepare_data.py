"""Write scikit-learn's wine data (178 wines, shipped offline) as one CSV file per client and a
held-out file for the operator: ``data/client0.csv`` ... and ``data/test.csv``.

    python prepare_data.py --clients 3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split


def write_client_files(out: Path, clients: int, seed: int = 0) -> list[Path]:
    """Split the wines 80/20 (stratified), the 80% into ``clients`` files; return them."""
    wine = load_wine()
    x, y = np.asarray(wine.data), np.asarray(wine.target)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=seed
    )
    out.mkdir(parents=True, exist_ok=True)
    header = ",".join([*wine.feature_names, "label"])

    def write(path: Path, rows: np.ndarray, labels: np.ndarray) -> Path:
        np.savetxt(
            path,
            np.column_stack([rows, labels]),
            delimiter=",",
            header=header,
            comments="",
            fmt="%.6g",
        )
        return path

    write(out / "test.csv", x_test, y_test)
    order = np.random.default_rng(seed).permutation(len(y_train))
    return [
        write(out / f"client{k}.csv", x_train[part], y_train[part])
        for k, part in enumerate(np.array_split(order, clients))
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args()
    for path in write_client_files(args.out, args.clients):
        print(path)
