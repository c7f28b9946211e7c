"""Flower interop on the client side.

A ClientApp whose clients train and push the fedps way (:mod:`.flower_client`), and a mod that adds
fedps's DP, encryption and secure aggregation to an app's own ``train`` (:mod:`.fedps_mod`).

Flower is not a dependency of fedps (docs/flower.md); import this package only where Flower is
installed.
"""
