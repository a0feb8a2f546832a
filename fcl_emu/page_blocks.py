"""A Markdown page's generated blocks: a table written between the page's markers ``<!-- table: NAME -->`` and
``<!-- /table: NAME -->`` (:func:`write_table`), every other byte of the page kept. The experiment tables write
their results pages with it, ``fcl-emu compatibility --page`` the compatibility matrix."""

from __future__ import annotations

import os
import re
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
