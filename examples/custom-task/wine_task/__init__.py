"""A fedps task project: a model of the user's own, trained on wine data kept per client."""
