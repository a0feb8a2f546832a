"""``python -m fcl_emu.edge_node FLAGS``: one edge node (the flags of ``fcl-emu node``, edge_node/args.py)."""

from fcl_emu.edge_node.args import main

raise SystemExit(main())
