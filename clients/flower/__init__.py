"""Flower interop on the client side: a ClientApp whose clients train and push the fedps way.

Flower is not a dependency of fedps (docs/flower.md); import this package only where Flower is
installed.
"""
