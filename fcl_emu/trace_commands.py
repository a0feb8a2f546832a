"""``fcl-emu trace behaviour|stats``: write a population behaviour trace in FedScale's format, or measure one
(scenario/behaviour_trace.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from fcl_emu.command_line import fail, folder, writable

trace_app = typer.Typer(no_args_is_help=True, help="Population behaviour traces in FedScale's format, for "
                                                   "`--availability trace:PATH` (docs/edge.md).")


def _say(text: str) -> None:
    Console(width=1000).print(text, markup=False, highlight=False)


@trace_app.command("behaviour")
def trace_behaviour(
    out: Annotated[Path, typer.Option("--out", help="the file to write: JSON if it ends in .json, otherwise a "
                                                    "pickle, as FedScale ships its trace")],
    clients: Annotated[int, typer.Option("--clients", min=1, help="how many clients (ids 0 to N-1)")] = 100_000,
    seed: Annotated[int, typer.Option("--seed", help="the same seed writes the same trace")] = 0,
    days: Annotated[int, typer.Option("--days", min=1, help="the period the pattern repeats with (finish_time), "
                                                            "in days")] = 6,
) -> None:
    """Write a synthetic trace of when each client is available (charging, locked, on Wi-Fi: mostly overnight,
    the daily pattern of the smartphone data FedScale's own trace comes from) and print its statistics."""
    from fcl_emu.scenario.behaviour_trace import behaviour_trace, stats_of, write_trace

    writable(folder(out))
    began = time.perf_counter()
    trace = behaviour_trace(clients, seed, days)
    write_trace(trace, out)
    took = time.perf_counter() - began
    _say(f"wrote {out} ({out.stat().st_size / 1e6:,.1f} MB, {took:.1f} s): {stats_of(trace).line()}")
    _say(f"replay it with --availability trace:{out}; edge.trace_time_scale converts its seconds to the run's "
         f"(0.001: a day in 86 s)")


@trace_app.command("stats")
def trace_stats(
    path: Annotated[Path, typer.Argument(help="a FedScale-format trace: pickle (FedScale's client_behave_trace), "
                                              "JSON or YAML")],
) -> None:
    """Print a trace's statistics as `trace behaviour` does: the fraction of clients online by hour of the day
    (time 0 taken as midnight) and sessions a client a day."""
    from fcl_emu.scenario.availability import load_trace
    from fcl_emu.scenario.behaviour_trace import trace_stats as measure

    try:
        stats = measure(load_trace(path))
    except ValueError as exc:
        fail(str(exc), 1)
    _say(f"{path}: {stats.line()}")
