"""How client updates become a global model: pure functions and small objects, no sockets and no processes
(below ``methods/`` and ``coordinator/``, as ``secagg/`` is).

Three things are called aggregation in a federated run; each has its place here or names it:

- the **round policy** (``--aggregation``: ``sync``, ``fedbuff``, ``fedasync``; :mod:`.policies`): when the server
  aggregates, and what an update's staleness weighs. One file per policy under ``policies/``;
- the **rule** (``--aggregator``: ``mean``, ``median``, ``trimmed_mean``, ``krum``, ``multikrum``, ``bulyan``;
  :mod:`.rules`): how a set of deltas becomes one delta. One file per rule (family) under ``rules/``;
- a **method's own aggregate** (``ServerPart.aggregate`` in ``methods/``): what the server does with the rule's
  result (most methods: add it to the global model; LANDER and AF-FCL also to the modules riding with it).

Beside them: what a client's update is as the server sees it (:mod:`.update`), the norm bound and clipping of
updates before the rule (:mod:`.clipping`) and every setting of the three, declared once (:mod:`.settings`).
"""
