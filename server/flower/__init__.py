"""Flower interop on the server side: a strategy whose aggregation is fedps's.

Flower is not a dependency of fedps (docs/flower.md); import this package only where Flower is
installed.
"""
