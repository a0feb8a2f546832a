"""What a run varied: its settings not at their defaults (monitoring/settings_diff.py) in the summary table,
report.md and `compare`, compare's warnings on differing system settings, and the clocks the plots are drawn on;
on run directories written by hand (tests/test_report.py's)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from fcl_emu.monitoring import compare as compare_module
from fcl_emu.monitoring import plots
from fcl_emu.monitoring.compare import compare_runs, format_table
from fcl_emu.monitoring.report import write_report
from fcl_emu.monitoring.results import RunSummary
from fcl_emu.monitoring.settings_diff import non_default_settings, settings_text
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.runconfig.defaults import defaults_for
from tests.test_report import events, make_run, summary

CHANGED = {"method": "fedprox", "method_options": {"mu": 0.1}, "aggregation": {"policy": {"name": "fedbuff", "buffer": 5}},
           "edge": {"availability": "onoff:60:30"}, "scenario": {"num_clients": 10}, "seed": 3,
           # where the run was, not what it varied: never listed
           "run_dir": "runs/x", "metrics": {"port": 9100}, "network": {"bind": "tcp://0.0.0.0:5555"}}
PRIVACY = {"mode": "central", "noise_multiplier": 1.0, "clip": 1.0, "adaptive": False, "sampling_rate": 0.1,
           "steps": 30, "delta": 1e-5, "epsilon": 2.345, "epsilon_sampled": 4.5}


def config_dict(**changes) -> dict:
    return load_config(None, changes).model_dump(mode="json")


def with_config(run_dir: Path, **changes) -> Path:
    (run_dir / "config.yaml").write_text(load_config(None, changes).to_yaml())
    return run_dir


def emulated_events() -> list[dict]:
    """tests/test_report.py's events of a run on the emulated clock: 10 emulated seconds a round."""
    return [{**e, "emulated_s": 10.0, "emulated_clock_s": 10.0 * e["round"]} if e["event"] == "round" else e
            for e in events()]


def test_the_settings_not_default_are_listed_by_group():
    config = config_dict(**CHANGED)
    settings = non_default_settings(config, defaults_for(config))
    assert [(s.group, str(s)) for s in settings] == [
        ("scenario", "scenario.num_clients=10"), ("scenario", "seed=3"),
        ("method", "method=fedprox"), ("method", "method_options.mu=0.1"),
        ("rounds & aggregation", "aggregation.policy.name=fedbuff"),
        ("rounds & aggregation", "aggregation.policy.buffer=5"),  # its policy's options apart from its defaults
        ("churn & devices", "edge.availability=onoff:60:30")]  # clients per round capped at 10: not a choice
    assert settings_text(settings) == (
        "scenario: scenario.num_clients=10, seed=3; method: method=fedprox, method_options.mu=0.1; "
        "rounds & aggregation: aggregation.policy.name=fedbuff, aggregation.policy.buffer=5; churn & devices: "
        "edge.availability=onoff:60:30")
    robust = config_dict(aggregation={"rule": {"name": "trimmed_mean", "trim_fraction": 0.2}}, nodes=4)
    assert settings_text(non_default_settings(robust, defaults_for(robust))) == (
        "rounds & aggregation: aggregation.rule.name=trimmed_mean, aggregation.rule.trim_fraction=0.2; "
        "deployment: nodes=4")
    at_defaults = config_dict(aggregation={"rule": "trimmed_mean"})  # the rule's options at its defaults
    assert settings_text(non_default_settings(at_defaults, defaults_for(at_defaults))) == (
        "rounds & aggregation: aggregation.rule.name=trimmed_mean")

    default = RunConfig().model_dump(mode="json")
    assert non_default_settings(default, defaults_for(default)) == []
    assert settings_text([]) == "none"
    glfc = config_dict(method="glfc")  # its own local optimiser is its default
    assert [str(s) for s in non_default_settings(glfc, defaults_for(glfc))] == ["method=glfc"]
    cifar = config_dict(scenario={"dataset": "cifar10"})  # its data set's lr (0.01) is its default
    assert [str(s) for s in non_default_settings(cifar, defaults_for(cifar))] == ["scenario.dataset=cifar10"]
    # a partial or older config.yaml: only the keys both sides have
    assert [str(s) for s in non_default_settings({"rounds": {"rounds_per_task": 2}, "gone": 1}, default)] == [
        "rounds.rounds_per_task=2"]


def test_the_summary_table_names_the_settings_and_the_epsilon():
    from fcl_emu.run import summary_table

    def text(table) -> str:
        console = Console(record=True, width=200)
        console.print(table)
        return console.export_text()

    dp = RunSummary.from_dict({**summary(), "privacy": PRIVACY})
    out = text(summary_table(dp, load_config(None, {"aggregation": {"policy": "fedbuff"}, "seed": 3})))
    assert "epsilon (delta)" in out and "4.50 as sampled; 2.35 if Poisson-sampled (1e-05)" in out
    assert "settings (not default)" in out and "scenario: seed=3" in out
    assert "rounds & aggregation: aggregation.policy.name=fedbuff" in out
    assert "none" in text(summary_table(dp, RunConfig()))
    plain = text(summary_table(RunSummary.from_dict(summary())))
    assert "epsilon" not in plain and "settings" not in plain


def test_report_lists_the_settings_and_the_epsilon(tmp_path):
    run_dir = with_config(make_run(tmp_path / "run", {**summary(), "privacy": {**PRIVACY, "epsilon": None}}),
                          edge={"crash_rate": 0.05})
    text = write_report(run_dir, defaults=defaults_for).read_text()
    assert "| settings (not default) | churn & devices: edge.crash_rate=0.05 |" in text
    assert "| epsilon (delta) | inf (no noise: no guarantee) (1e-05) |" in text
    assert "settings (not default)" not in write_report(run_dir).read_text()  # no defaults given


def test_compare_names_each_runs_settings_and_warns_when_system_settings_differ(tmp_path):
    a = make_run(tmp_path / "a")
    with_config(a)
    b = with_config(make_run(tmp_path / "b"), method="fedprox", method_options={"mu": 0.1})
    c = with_config(make_run(tmp_path / "c"), aggregation={"policy": "fedbuff"}, edge={"availability": "onoff:60:30"})
    assert compare_runs([a, b], tmp_path / "cmp").warnings == []  # the method is what a comparison varies
    found = compare_runs([a, b, c], tmp_path / "cmp", defaults=defaults_for)
    assert found.warnings == [
        "the runs differ in rounds & aggregation: aggregation.policy.name: 'sync' (a, b); 'fedbuff' (c)",
        "the runs differ in churn & devices: edge.availability: 'always' (a, b); 'onoff:60:30' (c)"]
    assert [r.settings for r in found.rows] == [
        "none", "method: method=fedprox, method_options.mu=0.1",
        "rounds & aggregation: aggregation.policy.name=fedbuff; churn & devices: edge.availability=onoff:60:30"]
    console = Console(record=True, width=300)
    console.print(format_table(found.rows))
    assert "settings (not default)" in console.export_text()


def capture_figures(monkeypatch) -> dict:
    figures = {}

    def save(fig, path):
        figures[path.name] = fig
        return path

    monkeypatch.setattr(plots, "save_figure", save)
    monkeypatch.setattr(compare_module, "save_figure", save)
    return figures


def test_plots_say_which_clock_they_show(tmp_path, monkeypatch):
    figures = capture_figures(monkeypatch)
    real = make_run(tmp_path / "real")
    emulated = make_run(tmp_path / "emulated", {**summary(), "clock": "emulated", "emulated_s": 60.0},
                        emulated_events())
    write_report(real, tmp_path / "report-real")
    assert figures["round_phases.png"].axes[0].get_ylabel() == "wall clock (s)"
    assert figures["online_clients.png"].axes[0].get_xlabel().startswith("host time since start (s)")
    text = write_report(emulated, tmp_path / "report-emulated").read_text()
    assert figures["round_phases.png"].axes[0].get_ylabel() == "host seconds (the run's clock: emulated)"
    online = figures["online_clients.png"].axes[0]
    assert online.get_xlabel().startswith("emulated time since start (s)")
    assert max(online.lines[0].get_xdata()) == 60.0  # the step line of online clients, on the emulated clock
    assert "Online clients over emulated time" in text and "these are the host's seconds" in text

    found = compare_runs([real, emulated], tmp_path / "cmp")
    by_label = {ax.get_xlabel(): ax for sub in figures["compare.png"].subfigs for ax in sub.axes}
    host, emulated_axis = by_label["host time since start (s, wall clock)"], by_label["emulated time since start (s)"]
    assert len(host.lines) == 2 and len(emulated_axis.lines) == 1  # the real-clock run has no emulated time
    assert found.rows[1].emulated_curve[-1] == (60.0, 50.0)  # the last task's end, at its last round's close
    assert "emulated time (s)" in [ax.get_title() for ax in figures["compare.png"].subfigs[0].axes]
