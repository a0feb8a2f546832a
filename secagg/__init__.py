"""SecAgg+ (Bell et al., CCS 2020) as a pure protocol library: shared primitives, client, server, and an
in-process driver. Both the edge node and the coordinator import it; neither imports the other (docs/secagg.md)."""
