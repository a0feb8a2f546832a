"""No setting that does nothing (runconfig/ignored.py): a flag that the configuration ignores is refused with what
it needs, a config file's value that it ignores goes back to its default and is told as ignored, and what can be
checked before the start (a SecAgg+ threshold no round can reach) is."""

from __future__ import annotations

from operator import attrgetter

import pydantic
import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from fcl_emu import options
from fcl_emu.cli import app
from fcl_emu.monitoring.results import RunSummary
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.runconfig.adjustments import adjustments
from fcl_emu.runconfig.ignored import DEPENDENT

# Each table row: a value of its setting other than the default, and (where the defaults enable it) what turns its
# enabler off.
REAL_CLOCK = {"rounds": {"clock": "real"}}
CASES: dict[str, tuple[object, dict]] = {
    "privacy.noise_multiplier": (2.0, {}),
    "privacy.clip": (0.5, {}),
    "privacy.delta": (1e-6, {}),
    "privacy.on_divergence": ("continue", {}),
    "privacy.noise_seed": (7, {}),
    "privacy.adaptive.enabled": (True, {}),
    "privacy.adaptive.target_quantile": (0.3, {"privacy": {"mode": "central"}}),
    "privacy.adaptive.learning_rate": (0.1, {}),
    "privacy.adaptive.count_stddev": (2.0, {}),
    "secagg.neighbors": (6, {}),
    "secagg.threshold": (4, {}),
    "secagg.ring_bits": (24, {}),
    "secagg.phase_timeout_s": (5.0, {}),
    "secagg.clip": (2.0, {}),
    "secagg.max_weight": (100, {}),
    "aggregation.adaptive_clip": (5.0, {"secagg": {"enabled": True}}),
    "aggregation.direction_check": (None, {"secagg": {"enabled": True}}),
    "security.keys": ("keys", {"security": {"transport": "plain"}}),
    "topology.edge_rounds": (2, {}),
    "topology.uplink_mbps": (10.0, {}),
    "topology.downlink_mbps": (10.0, {}),
    "topology.latency_ms": (20.0, {"topology": {"edge_aggregators": 1}, **REAL_CLOCK}),
    "edge.availability_slot_s": (5.0, {"edge": {"availability": "onoff:60:30"}}),
    "edge.trace_time_scale": (2.0, {}),
    "edge.crash_downtime_s": (1.0, {}),
    "edge.compute": ("measured", REAL_CLOCK),
    "edge.min_battery": (0.5, REAL_CLOCK),
    "edge.charging": ("available", REAL_CLOCK),
    "rounds.skip_late": (False, REAL_CLOCK),
    "rounds.host_timeout_s": (60.0, REAL_CLOCK),
    "edge.charge_w": (5.0, {}),
    "training.momentum": (0.5, {"training": {"optimizer": "adam"}}),
    "metrics.host": ("0.0.0.0", {}),
    "metrics.prometheus_port": (9191, {}),
    "metrics.keep_prometheus": (True, {}),
    "containers.network": ("net", {}),
    "containers.gpus": (True, {}),
    "containers.advertise": ("10.0.0.1", {"containers": {"backend": "docker"}}),
    "gpu.job_timeout_s": (60.0, {}),
    "gpu.threads": (2, {}),
}


def merged(base: dict, setting: str, value: object) -> dict:
    """``base`` with the dotted ``setting`` set to ``value``."""
    out = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    node = out
    *parents, key = setting.split(".")
    for parent in parents:
        node = node.setdefault(parent, {})
    node[key] = value
    return out


def test_every_row_of_the_table_has_a_case():
    assert sorted(CASES) == sorted(row.setting for row in DEPENDENT)


@pytest.mark.parametrize("row", DEPENDENT, ids=lambda row: row.setting)
def test_a_flag_the_config_ignores_is_refused_naming_it_and_what_it_needs(row):
    value, base = CASES[row.setting]
    with pytest.raises(pydantic.ValidationError) as info:
        load_config(None, merged(base, row.setting, value))
    (error,) = info.value.errors()
    assert error["loc"] == row.path and error["msg"] == row.reason and row.needs in error["msg"]


@pytest.mark.parametrize("row", DEPENDENT, ids=lambda row: row.setting)
def test_a_config_file_value_the_config_ignores_is_listed_and_back_at_its_default(row, tmp_path):
    value, base = CASES[row.setting]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(merged(base, row.setting, value)))
    config = load_config(path, {})
    given = attrgetter(row.setting)(RunConfig.model_validate(merged(base, row.setting, value)))
    assert [(i.setting, i.value, i.reason) for i in config.ignored] == [(row.setting, given, row.reason)]
    assert config == load_config(None, base)  # as if the file had not set it: no record shows it applied
    assert f"config file: {row.setting}=" in " ".join(a.message for a in adjustments(config))


def test_the_command_line_refuses_each_ignored_flag_on_a_line_of_its_own():
    result = CliRunner().invoke(app, ["up", "--dp-noise-multiplier", "2", "--secagg-threshold", "4",
                                      "--edge-rounds", "2"])
    assert result.exit_code == 2, result.output
    lines = [line.removeprefix("error: ") for line in result.output.splitlines() if line.strip()]
    assert lines == [f"{options.FLAG_OF[row.path]}: {row.reason}" for row in DEPENDENT if row.setting in (
        "privacy.noise_multiplier", "secagg.threshold", "topology.edge_rounds")]
    assert lines[0] == ("--dp-noise-multiplier: needs --privacy central or distributed (differential privacy is "
                        "off)")


def test_a_dependent_setting_counts_where_its_enabler_is_on_from_a_file_or_a_flag(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"aggregation": {"policy": "fedbuff"}, "edge": {"availability": "bernoulli:0.5"}}))
    config = load_config(path, {"aggregation": {"policy": {"buffer": 5}}, "edge": {"availability_slot_s": 2.0}})
    assert (config.aggregation.policy.buffer, config.edge.availability_slot_s, config.ignored) == (5, 2.0, ())


def test_a_file_value_at_its_default_is_not_set_and_a_flag_that_turns_the_enabler_off_keeps_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"privacy": {"delta": 1e-5}, "secagg": {"enabled": True, "threshold": 4}}))
    off = load_config(path, {"secagg": {"enabled": False}})  # --no-secagg over a base file
    assert [i.setting for i in off.ignored] == ["secagg.threshold"] and off.secagg.threshold is None
    # a method's own training values are the run's defaults: glfc's SGD has no momentum
    path.write_text(yaml.safe_dump({"method": "glfc", "training": {"optimizer": "adam", "momentum": 0.0}}))
    assert load_config(path, {}).ignored == ()


def test_a_valid_config_is_unaffected_and_a_written_config_loads_again(tmp_path):
    assert load_config(None, {}) == RunConfig() and load_config(None, {}).ignored == ()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"privacy": {"noise_multiplier": 3.0}, "seed": 2}))
    config = load_config(path, {})
    path.write_text(config.to_yaml())  # a run's config.yaml: every key, the ignored one at its default
    again = load_config(path, {})
    assert again == config and again.ignored == () and "noise_multiplier: 3.0" not in config.to_yaml()


def test_the_closing_table_lists_the_ignored_settings_apart_from_the_applied(tmp_path):
    from fcl_emu.run import summary_table
    from tests.test_report import summary

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"seed": 3, "privacy": {"noise_multiplier": 2.0}}))
    console = Console(record=True, width=300)
    console.print(summary_table(RunSummary.from_dict(summary()), load_config(path, {})))
    out = console.export_text()
    assert "scenario: seed=3" in out and "privacy.noise_multiplier=2" in out.split("ignored (config file)")[1]
    assert "noise_multiplier" not in out.split("settings (not default)")[1].split("ignored (config file)")[0]


def test_a_secagg_threshold_no_round_can_reach_is_refused_before_the_start():
    small = {"scenario": {"num_clients": 10}, "rounds": {"clients_per_round": 5}}
    with pytest.raises(ValueError, match="a round of 5 sampled clients gives each client 4 neighbours .* at most 4"):
        load_config(None, {**small, "secagg": {"enabled": True, "threshold": 6}})
    with pytest.raises(ValueError, match="gives each client 4 neighbours"):  # more neighbours set than n - 1
        load_config(None, {**small, "secagg": {"enabled": True, "neighbors": 8, "threshold": 6}})
    assert load_config(None, {**small, "secagg": {"enabled": True, "threshold": 4}}).secagg.threshold == 4
    result = CliRunner().invoke(app, ["up", "--clients", "10", "--clients-per-round", "5", "--secagg",
                                      "--secagg-threshold", "6"])
    assert result.exit_code == 2 and "every round would be skipped" in result.output, result.output
    over = {**small, "rounds": {"clients_per_round": 5, "overcommit": 1.4}}  # 7 sampled: 6 neighbours
    assert load_config(None, {**over, "secagg": {"enabled": True, "threshold": 6}}).secagg.threshold == 6
