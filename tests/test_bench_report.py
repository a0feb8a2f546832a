"""The benchmarks' shared table printer (fcl_emu/bench/report.py): no ``None`` printed, headers whole at 80 columns."""

from __future__ import annotations

from rich.console import Console

from fcl_emu.bench.report import emit

# bench energy's columns, one case that never reached the target accuracy
ROWS = [{"case": "fedavg", "average accuracy (%)": 49.2, "energy (kJ)": 1.6, "compute share (%)": 24.1,
         "kJ to 60 %": None, "pays most (J per job)": "phone-low 12.3", "sat out (client-rounds)": 0,
         "energy ratio": 1.0, "to-target ratio": None},
        {"case": "fedavg-low-battery", "average accuracy (%)": 45.0, "energy (kJ)": 1.1, "compute share (%)": 22.0,
         "kJ to 60 %": 0.8, "pays most (J per job)": "laptop 30.1", "sat out (client-rounds)": 14,
         "energy ratio": 0.69, "to-target ratio": None}]


def printed(width: int) -> tuple[str, dict]:
    console = Console(record=True, width=width)
    result = emit("energy", ROWS, {"seed": 0}, None, console, notes=["-: never reached 60 %"])
    return console.export_text(), result


def test_a_table_too_wide_for_80_columns_is_turned_over_with_whole_headers_and_no_none():
    out, result = printed(80)
    assert max(map(len, out.splitlines())) <= 80 and "None" not in out and "…" not in out
    for key in ROWS[0]:
        assert key in out  # each header whole, on one line
    assert "fedavg-low-battery" in out and "phone-low 12.3" in out
    lines = out.splitlines()
    assert lines.index("-: never reached 60 %") < lines.index("seed: 0")  # the notes under the table
    assert result["rows"][0]["kJ to 60 %"] is None and "notes" not in result  # the JSON keeps null


def test_a_table_that_fits_keeps_a_column_per_key():
    out, _ = printed(250)
    header = next(line for line in out.splitlines() if "average accuracy (%)" in line)
    assert all(key in header for key in ROWS[0]) and "None" not in out
    assert "│ fedavg-low-battery │" in out
