"""``python -m fcl_emu.edge_aggregator FLAGS``: one edge aggregator (edge_aggregator/args.py)."""

from fcl_emu.edge_aggregator.args import main

raise SystemExit(main())
