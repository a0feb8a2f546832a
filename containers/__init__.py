"""Container images and the container runtime (Docker SDK) for edge nodes.

Scope (not built yet; see the project's issues): images for the coordinator
and edge nodes, and launching nodes as containers instead of processes.
"""
