"""The experiment tables of docs/experiments.md and docs/reproduction.md (their results pages under docs/results/),
one module per table, each run from a checkout's root as ``python -m experiments.<module> ...``: one real
``fcl-emu up`` per row and seed (``runs.py``). They sit above the product and are not installed with it: they use
its command line (as processes) and its public surface only (tests/test_layers.py lists it).

Every table command writes ``--out/table.md``; with ``--page PATH`` it also writes the table into a results page,
between the page's markers ``<!-- table: NAME -->`` and ``<!-- /table: NAME -->`` (:func:`fcl_emu.page_blocks.write_table`), so the
page is written by its command and the text around the table stays as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fcl_emu.page_blocks import PageError, markers, write_table


def add_page_options(parser: argparse.ArgumentParser) -> None:
    """The tables' ``--page`` and ``--name`` options (see :func:`write_page`)."""
    parser.add_argument("--page", type=Path, default=None,
                        help="also write the table into this results page (docs/results/...), between its "
                             "<!-- table: NAME --> and <!-- /table: NAME --> markers; the page must exist")
    parser.add_argument("--name", default=None, help="the table's NAME in --page (default: the folder of --out)")


def table_name(args: argparse.Namespace, out: Path) -> str:
    """The table's name in ``--page``: ``--name``, or the folder of ``out``."""
    return args.name or Path(out).resolve().name


def check_page(args: argparse.Namespace, out: Path) -> None:
    """Refuse a ``--page`` that does not exist, or a table name markers cannot hold, before any run starts (one
    line naming it, exit status 1)."""
    if args.page is None:
        return
    try:
        markers(table_name(args, out))
        if not args.page.is_file():
            raise PageError(f"results page {args.page} does not exist (write the page first; a table is written "
                            "into it)")
    except PageError as e:
        raise SystemExit(f"error: --page: {e}") from None


def write_page(args: argparse.Namespace, out: Path, table: str) -> None:
    """With ``--page``: write ``table`` into that page under ``--name`` (default: ``out``'s folder name)."""
    if args.page is None:
        return
    name = table_name(args, out)
    try:
        write_table(args.page, name, table)
    except PageError as e:
        raise SystemExit(f"error: --page: {e}") from None
    print(f"table {name!r} written into {args.page}", file=sys.stderr)


def publish(args: argparse.Namespace, out: Path, table: str, data: Any = None) -> None:
    """A table's outputs: ``out/table.md``, the ``--page`` block (:func:`write_page`), every run's numbers
    ``data`` in ``out/table.json`` (where given), and the table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    write_page(args, out, table)
    if data is not None:
        (out / "table.json").write_text(json.dumps(data, indent=1))
    print(table)
