"""Machine learning shared by the roles.

Tasks, datasets, models, partitioners, the privacy accountant and the async staleness weights.

Its modules are imported one by one (the tasks and models need torch, the ``[client]`` extra;
a shard or key holder imports only :mod:`~fedps.learning.staleness` and
:mod:`~fedps.learning.accounting`).
"""

__all__: list[str] = []
