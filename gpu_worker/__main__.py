"""``python -m fcl_emu.gpu_worker FLAGS``: one GPU worker of the coordinator's pool (gpu_worker/args.py)."""

from fcl_emu.gpu_worker.worker import main

raise SystemExit(main())
