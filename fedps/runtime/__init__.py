"""The runtime: what the commands and the Python API both use to run fedps.

The API (:mod:`~fedps.runtime.api`: clients, the trained model;
:mod:`~fedps.runtime.api_base`: what every entry point sets up first), a local cluster
(:mod:`~fedps.runtime.local_cluster`), the supervisor of role processes
(:mod:`~fedps.runtime.deployment`), the demo run (:mod:`~fedps.runtime.demo`), a run's history
(:mod:`~fedps.runtime.history`), a running cluster's status
(:mod:`~fedps.runtime.cluster_status`) and model export (:mod:`~fedps.runtime.export`).
It starts every role, so it may import ``clients/`` and ``server/``; nothing below it imports
it. Its modules are imported one by one (:mod:`fedps` names its API lazily).
"""

__all__: list[str] = []
