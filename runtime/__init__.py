"""What every fcl-emu process sets up first, whichever package starts it (the command line, ``python -m
edge_node``, ``python -m coordinator.gpu_worker``): glibc's malloc thresholds (:mod:`runtime.allocator`), stack
dumps on SIGUSR1, ending with its parent, and the errors of its arguments (:mod:`runtime.process`)."""
