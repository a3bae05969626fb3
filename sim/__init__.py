"""Cluster simulator: the real router and engine scheduler code on a virtual clock; only the
model forward and the network are cost models (docs/simulator.md)."""
