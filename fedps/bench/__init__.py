"""``fedps bench``: the costs of encryption, verification, rotation and whole rounds.

Encryption, verification, rotation and end-to-end round costs against TenSEAL's default and
plaintext (:mod:`~fedps.bench.benchmark`), Flower's plain FedAvg on the same job
(:mod:`~fedps.bench.flower_bench`), and the results as Markdown (:mod:`~fedps.bench.report`).
"""

__all__: list[str] = []
