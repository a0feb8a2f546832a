"""Results pages written by their commands: a table command's ``--page`` replaces one table's block in a page
(between ``<!-- table: NAME -->`` and ``<!-- /table: NAME -->``) and nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fcl_emu.page_blocks import PageError, write_table

ROOT = Path(__file__).resolve().parents[1]
PAGE = """# Results: a page

Some prose with trailing spaces   \nand a measured number, 12.34 %, left as it is.

```
python -m experiments.glfc_table --out runs/glfc
```

<!-- table: glfc -->
| run | avg. accuracy % |
| --- | ---: |
| fedavg | 19.64 |
<!-- /table: glfc -->

Between the tables.

<!-- table: glfc-entropy -->
| run | avg. accuracy % |
| --- | ---: |
| glfc-entropy | 94.17 |
<!-- /table: glfc-entropy -->

The end, without a final newline."""
NEW = "| run | avg. accuracy % |\n| --- | ---: |\n| fedavg | 20.00 |\n| glfc-oracle | 93.01 |\n"


def block(text: str, name: str) -> str:
    return re.search(rf"<!-- table: {re.escape(name)} -->\n(.*?)\n<!-- /table: {re.escape(name)} -->", text, re.S)[1]


def test_a_table_replaces_only_its_block_and_keeps_the_rest_byte_for_byte(tmp_path):
    page = tmp_path / "page.md"
    page.write_bytes(PAGE.encode())
    write_table(page, "glfc", NEW)
    text = page.read_bytes().decode()
    assert block(text, "glfc") == NEW.rstrip("\n")
    before, after = PAGE.split("<!-- table: glfc -->")[0], PAGE.split("<!-- /table: glfc -->")[1]
    assert text.startswith(before + "<!-- table: glfc -->\n") and text.endswith("<!-- /table: glfc -->" + after)
    write_table(page, "glfc", NEW)  # again: the same bytes
    assert page.read_bytes().decode() == text


def test_a_second_table_in_the_same_page_is_untouched(tmp_path):
    page = tmp_path / "page.md"
    page.write_bytes(PAGE.encode())
    write_table(page, "glfc", NEW)
    assert block(page.read_text(), "glfc-entropy") == block(PAGE, "glfc-entropy")
    write_table(page, "glfc-entropy", "| run |\n| --- |\n| glfc-entropy |")
    text = page.read_text()
    assert block(text, "glfc") == NEW.rstrip("\n") and block(text, "glfc-entropy").endswith("| glfc-entropy |")


def test_a_missing_page_is_a_clear_error_and_nothing_is_written(tmp_path):
    page = tmp_path / "docs" / "results" / "nowhere.md"
    with pytest.raises(PageError, match=r"results page .*nowhere\.md does not exist"):
        write_table(page, "glfc", NEW)
    assert not page.exists() and not page.parent.exists()


def test_a_page_without_the_block_gets_it_at_its_end(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Results\n\nProse.\n")
    write_table(page, "many-class", "| a |\n| --- |\n| 1 |")
    assert page.read_text() == "# Results\n\nProse.\n\n<!-- table: many-class -->\n| a |\n| --- |\n| 1 |\n" \
                               "<!-- /table: many-class -->\n"


def test_broken_markers_and_bad_names_are_refused_and_the_page_kept(tmp_path):
    page = tmp_path / "page.md"
    for text in (PAGE + "\n<!-- table: glfc -->\n",  # two starts
                 "<!-- /table: glfc -->\n| x |\n<!-- table: glfc -->\n",  # end before start
                 "<!-- table: glfc -->\n| x |\n"):  # no end
        page.write_text(text)
        with pytest.raises(PageError, match="table 'glfc' needs one"):
            write_table(page, "glfc", NEW)
        assert page.read_text() == text
    with pytest.raises(PageError, match="table name"):
        write_table(page, "a name -->", NEW)


def test_a_crlf_page_keeps_its_line_ends(tmp_path):
    page = tmp_path / "page.md"
    page.write_bytes(PAGE.replace("\n", "\r\n").encode())
    write_table(page, "glfc", NEW)
    data = page.read_bytes()
    assert b"\n" not in data.replace(b"\r\n", b"")
    assert data.replace(b"\r\n", b"\n").decode() == PAGE.replace(block(PAGE, "glfc"), NEW.rstrip("\n"))


def test_a_table_command_writes_its_page_and_refuses_a_missing_one_before_any_run(tmp_path):
    out = tmp_path / "generative"
    out.mkdir()
    page = tmp_path / "page.md"
    page.write_bytes(PAGE.encode())
    done = subprocess.run([sys.executable, "-m", "experiments.generative_table", "--report-only",
                           "--methods", "fedavg", "--seeds", "0", "--out", str(out), "--page", str(page)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert block(text, "generative") == (out / "table.md").read_text().rstrip("\n")  # named by --out's folder
    assert text.startswith(PAGE)  # the page's own blocks untouched, the new one at its end
    missing = tmp_path / "missing.md"
    done = subprocess.run([sys.executable, "-m", "experiments.secagg_table", "--out", str(tmp_path / "s"),
                           "--page", str(missing)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0 and f"results page {missing} does not exist" in done.stderr
    assert not (tmp_path / "s").exists()  # refused before the first point ran


def test_every_table_block_of_the_results_pages_is_well_formed():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    names = {}
    for page in pages:
        text = page.read_text()
        for name in re.findall(r"<!-- table: ([^ ]+) -->", text):
            assert text.count(f"<!-- table: {name} -->") == 1 == text.count(f"<!-- /table: {name} -->"), (page, name)
            assert text.index(f"<!-- table: {name} -->") < text.index(f"<!-- /table: {name} -->"), (page, name)
            assert block(text, name).startswith("| "), (page, name)  # a Markdown table, as the commands write
            names.setdefault(page.relative_to(ROOT).as_posix(), []).append(name)
        assert len(re.findall(r"<!-- /table: ([^ ]+) -->", text)) == len(names.get(page.relative_to(ROOT).as_posix(),
                                                                                   [])), page
    assert "docs/results/secagg.md" in names and "docs/results/reproduction-data-free.md" in names
