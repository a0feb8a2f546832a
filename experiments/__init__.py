"""The experiment tables of docs/experiments.md and docs/reproduction.md (their results pages under docs/results/),
one module per table, each run from a checkout's root as ``python -m experiments.<module> ...``: one real
``fcl-emu up`` per row and seed (``runs.py``). They sit above the product and are not installed with it: they use
its command line (as processes) and its public surface only (tests/test_layers.py lists it).

Every table command writes ``--out/table.md``; with ``--page PATH`` it also writes the table into a results page,
between the page's markers ``<!-- table: NAME -->`` and ``<!-- /table: NAME -->`` (:func:`write_table`), so the
page is written by its command and the text around the table stays as it is.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

#: A table's name in its markers: letters, digits, ``.``, ``_`` and ``-``.
TABLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class PageError(Exception):
    """A results page that cannot take a table: missing, or with broken markers. The message says which and why."""


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of table ``name`` in a results page."""
    if not TABLE_NAME.fullmatch(name):
        raise PageError(f"table name {name!r}: use letters, digits, '.', '_' and '-'")
    return f"<!-- table: {name} -->", f"<!-- /table: {name} -->"


def write_table(page: Path, name: str, table: str) -> None:
    """Write ``table`` (Markdown) into results page ``page`` between the markers of table ``name``, replacing only
    what lies between them; every other byte of the page stays as it was. A page without the markers gets the
    block at its end. Raises :class:`PageError` if the page does not exist or holds the markers other than once
    each, start before end."""
    start, end = markers(name)
    page = Path(page)
    if not page.is_file():
        raise PageError(f"results page {page} does not exist (write the page first; a table is written into it)")
    text = page.read_bytes().decode("utf-8")
    newline = "\r\n" if "\r\n" in text else "\n"
    body = newline.join(table.strip("\r\n").splitlines())
    counts = text.count(start), text.count(end)
    if counts == (0, 0):  # a new block at the end, after a blank line
        before = "" if not text else text + newline if text.endswith(newline) else text + newline * 2
        text = f"{before}{start}{newline}{body}{newline}{end}{newline}"
    elif counts == (1, 1) and text.index(start) < text.index(end):
        i = text.index(start) + len(start)
        text = f"{text[:i]}{newline}{body}{newline}{text[text.index(end):]}"
    else:
        raise PageError(f"results page {page}: table {name!r} needs one {start} and, after it, one {end}; "
                        f"found {counts[0]} and {counts[1]}")
    tmp = page.with_name(f".{page.name}.tmp")
    tmp.write_bytes(text.encode("utf-8"))
    os.replace(tmp, page)


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
