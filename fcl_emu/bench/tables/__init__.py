"""The experiment tables of docs/experiments.md and docs/reproduction.md, one module per table, each run as
``python -m fcl_emu.bench.tables.<module> ...``: one real ``fcl-emu up`` per row and seed (``runs.py``)."""
