"""``python -m edge_node FLAGS``: one edge node (the flags of ``fcl-emu node``, edge_node/args.py)."""

from edge_node.args import main

raise SystemExit(main())
