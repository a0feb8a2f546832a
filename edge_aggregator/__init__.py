"""The edge aggregator: a tier between edge nodes and the coordinator (hierarchical FL, docs/hierarchy.md)."""
