"""fcl-emu: an emulator for federated class-incremental learning at the edge.

This package holds what spans the others: the command line, the run
configuration and the launcher. The emulated system itself lives in
``coordinator``, ``edge_node``, ``wire``, ``methods`` and ``scenario``.
"""

__version__ = "0.1.0"
