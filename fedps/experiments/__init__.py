"""``fedps experiment``: privacy-accuracy grids (:mod:`~fedps.experiments.grid`), one real
platform run per point (:mod:`~fedps.experiments.experiment`), and their report
(:mod:`~fedps.experiments.report`)."""

__all__: list[str] = []
