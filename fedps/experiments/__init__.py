"""``fedps experiment``: privacy-accuracy grids, a real platform run per point, and a report.

Grids in :mod:`~fedps.experiments.grid`, one real platform run per point in
:mod:`~fedps.experiments.experiment`, and their report in :mod:`~fedps.experiments.report`.
"""

__all__: list[str] = []
