"""``fedps bench``: the costs of encryption, verification, rotation and whole rounds.

Encryption, verification, rotation and end-to-end round costs against TenSEAL's default and
plaintext (:mod:`~fedps.bench.benchmark`); the same job on Flower's plain FedAvg with Opacus
and on fedps, alternating (:mod:`~fedps.bench.flower_comparison`, Flower's side in
:mod:`~fedps.bench.flower_baseline`), and where fedps's rounds go, phase by phase
(:mod:`~fedps.bench.round_profile`); fedps's own nodes under Flower at scale
(:mod:`~fedps.bench.flower_bench`); and the results as Markdown (:mod:`~fedps.bench.report`).
"""

__all__: list[str] = []
