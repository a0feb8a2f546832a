"""What every fcl-emu process sets up first, whichever package starts it (the command line,
``python -m fcl_emu.edge_node``, ``python -m fcl_emu.gpu_worker``): glibc's malloc thresholds
(:mod:`fcl_emu.runtime.allocator`), stack dumps on SIGUSR1, ending with its parent, and the errors of its arguments
(:mod:`fcl_emu.runtime.process`)."""
