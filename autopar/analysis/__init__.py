"""Analyses of a captured graph that both deciding and doing read: its repeated layers
and where it can be cut into pipeline stages."""
