"""A Flower app whose aggregation is fedps's secure aggregation."""
