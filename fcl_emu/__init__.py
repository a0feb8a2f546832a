"""fcl-emu: an emulator for federated class-incremental learning at the edge.

This package holds what spans the others: the command line, the
orchestration of a run, the edge-node launchers and the benchmarks. The
emulated system itself lives in ``coordinator``, ``edge_node``, ``wire``,
``secagg``, ``methods``, ``scenario``, ``runconfig`` and ``monitoring``
(docs/architecture.md).
"""

__version__ = "0.1.0"
