"""Aggregation owns its settings (aggregation/settings.py, aggregation/choice.py): the policy, the rule and the server
optimiser each a registered part chosen with its own typed options; an option the chosen part does not take refused
in one line naming the parts that take it; a base file's options of a part a flag replaced told as ignored; and the
layout from before (runconfig/legacy.py) read with a warning, with the run fingerprints of then unchanged."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import yaml

from fcl_emu.aggregation.choice import PartOptions
from fcl_emu.aggregation.combine import fedavg
from fcl_emu.aggregation.policies import POLICIES
from fcl_emu.aggregation.rules import RULES
from fcl_emu.aggregation.server_optimizers import OPTIMIZERS
from fcl_emu.coordinator.resume import run_fingerprint
from fcl_emu.runconfig import RunConfig, load_config
from fcl_emu.runconfig.legacy import as_legacy
from tests.test_config_cli import invoke

OLD_LAYOUT = pytest.mark.filterwarnings("ignore:this config uses the settings:FutureWarning")


@pytest.mark.parametrize("table", [RULES, POLICIES, OPTIMIZERS], ids=["rules", "policies", "optimisers"])
def test_every_part_declares_typed_options_with_defaults_and_descriptions(table):
    for name, part in table.items():
        assert issubclass(part.Options, PartOptions)
        for option, field in part.Options.model_fields.items():
            assert option == "name" or field.description, f"{name}.{option} has no description"
        part.Options()  # every option has a default


def test_the_config_holds_the_chosen_parts_options_only():
    config = RunConfig(aggregation={"rule": {"name": "multikrum", "keep": 3}, "server_optimizer": "fedadam"})
    dump = config.model_dump(mode="json")["aggregation"]
    assert dump["policy"] == {"name": "sync"} and dump["rule"] == {"name": "multikrum", "byzantine": 1, "keep": 3}
    assert RunConfig(aggregation={"policy": "fedbuff"}).model_dump(mode="json")["aggregation"]["policy"] == {
        "name": "fedbuff", "max_staleness": 4, "concurrency": None, "buffer": 10}
    assert dump["server_optimizer"] == {"name": "fedadam", "lr": 0.01, "beta1": 0.9, "tau": 0.001, "beta2": 0.99}
    assert RunConfig().model_dump(mode="json")["aggregation"]["rule"] == {"name": "mean"}
    assert RunConfig.model_validate(yaml.safe_load(config.to_yaml())) == config  # a run's config.yaml loads again


@pytest.mark.parametrize("flags, message", [
    (["--buffer", "5"], "--aggregation: round policy sync takes no option buffer (fedbuff takes it; sync takes "
                        "none)"),
    (["--aggregation", "fedasync", "--buffer", "5"], "round policy fedasync takes no option buffer"),
    (["--trim-fraction", "0.2"], "--aggregator: aggregation rule mean takes no option trim_fraction (trimmed_mean "
                                 "takes it; mean takes none)"),
    (["--aggregator", "krum", "--multikrum-keep", "3"], "aggregation rule krum takes no option keep (multikrum "
                                                        "takes it; krum takes byzantine)"),
    (["--aggregator", "bulyan", "--byzantine", "-1"], "--byzantine: must be at least 0 (got -1)"),
    (["--aggregation", "fedbuff", "--max-staleness", "-1"], "--max-staleness: must be at least 0 (got -1)"),
    (["--aggregator", "krm"], "--aggregator: unknown aggregation rule 'krm'; choose one of mean, median, "
                              "trimmed_mean, krum, multikrum, bulyan; did you mean krum?"),
])
def test_an_option_the_chosen_part_does_not_take_is_refused_in_one_line(flags, message):
    code, output = invoke("up", *flags)
    assert code == 2 and message in output, output


def test_a_flag_choosing_another_part_than_the_file_tells_the_files_options_ignored(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({"aggregation": {"rule": {"name": "trimmed_mean", "trim_fraction": 0.2},
                                                    "server_optimizer": "fedavgm"}}))
    config = load_config(path, {"aggregation": {"rule": {"name": "median"}, "server_optimizer": {"lr": 0.5}}})
    assert config.aggregation.rule.name == "median" and config.aggregation.server_optimizer.lr == 0.5
    assert [str(i) for i in config.ignored] == [
        "aggregation.rule.trim_fraction=0.2 ignored: an option of trimmed_mean, not of median"]
    same = load_config(path, {"aggregation": {"rule": {"name": "trimmed_mean"}}})  # the same part: kept
    assert same.aggregation.rule.trim_fraction == 0.2 and same.ignored == ()


# ------------------------------------------------------------------ the layout from before
# (config in the old layout, its run fingerprint as fcl-emu computed it before aggregation held its settings)
BEFORE = [
    ({}, "55d067baa770f87c"),
    ({"aggregation": {"kind": "fedbuff", "buffer": 5, "max_staleness": 2, "concurrency": 8}}, "7bfa96749f62d411"),
    ({"aggregation": {"kind": "fedasync", "async_alpha": 0.5}}, "7747d22a33ecfe73"),
    ({"security": {"aggregator": "multikrum", "byzantine": 2, "multikrum_keep": 3, "clip_norm": 5.0,
                   "adaptive_clip": "off"}}, "6f736b44eb529f0e"),
    ({"security": {"aggregator": "trimmed_mean", "trim_fraction": 0.2, "direction_check": 3.0,
                   "max_update_norm": 50.0}}, "00962e0b2115edce"),
    ({"aggregation": {"server_optimizer": "fedadam", "server_lr": 0.1}}, "2d7de8ef7259e638"),
    ({"aggregation": {"server_optimizer": "fedavgm"}}, "cd719105bec90d6c"),
]


@OLD_LAYOUT
@pytest.mark.parametrize("old, fingerprint", BEFORE)
def test_a_config_of_the_old_layout_keeps_its_run_fingerprint(old, fingerprint):
    """A checkpoint written before still resumes: the fingerprint it holds is the one its config gets now."""
    config = RunConfig.model_validate(old)
    assert run_fingerprint(config) == fingerprint
    full = {**config.model_dump(mode="json"), **as_legacy(config.model_dump(mode="json"))}  # a config.yaml of then
    assert RunConfig.model_validate(full) == config


def test_the_old_layout_is_read_with_a_warning_naming_each_move(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"aggregation": {"kind": "fedbuff", "buffer": 5, "async_alpha": 0.3},
                                    "security": {"byzantine": 2, "trim_fraction": 0.1, "max_update_norm": 9.0,
                                                 "transport": "plain"}}))
    with pytest.warns(FutureWarning) as caught:
        config = load_config(path, {})
    (warning,) = caught
    text = str(warning.message)
    for move in ("aggregation.kind -> aggregation.policy.name", "aggregation.buffer -> aggregation.policy.buffer",
                 "security.max_update_norm -> aggregation.max_update_norm"):
        assert move in text
    a = config.aggregation
    assert (a.policy.name, a.policy.buffer, a.rule.name, a.max_update_norm) == ("fedbuff", 5, "mean", 9.0)
    assert config.security.transport == "plain"
    # what did nothing then (FedAsync's alpha under FedBuff, Krum's f under the mean) is told as ignored; the trim
    # fraction at its default is not set
    assert [str(i) for i in config.ignored] == [
        "aggregation.async_alpha=0.3 ignored: not an option of policy fedbuff",
        "security.byzantine=2 ignored: not an option of rule mean"]


def test_todays_layout_reads_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RunConfig(aggregation={"policy": "fedbuff", "clip_norm": 1.0})
        RunConfig(aggregation={"rule": "median", "clip_norm": 1.0})
        load_config(None, {"aggregation": {"server_optimizer": {"name": "fedavgm", "lr": 0.5}}})


# ------------------------------------------------------------------ every policy through its runner
def _policy_cases():
    """Every registered policy with every server optimiser it takes (the rest are refused at configuration)."""
    return [(policy, optimizer) for policy, part in POLICIES.items() for optimizer in OPTIMIZERS
            if part.takes_server_step or optimizer == "none"]


@pytest.mark.parametrize("policy, optimizer", _policy_cases())
def test_every_registered_policy_aggregates_through_the_runner_the_coordinator_gives_it(policy, optimizer):
    """Fake clients on the emulated clock; the runner is the one the composition root picks for the policy (a
    synchronous round, or the asynchronous loop up to its next aggregation); each aggregates what the policy
    needs, as the policy weighs it, and the server optimiser steps from the model before along what the method's
    aggregate moved it. Every rule with every optimiser through a round: tests/test_server_optimizers.py."""
    from fcl_emu.aggregation.settings import AggregationSettings
    from fcl_emu.coordinator.async_rounds import AsyncRoundRunner
    from tests.test_coordinator_parts import join_all, make_state, runner
    from tests.test_server_optimizers import AggregatingServer

    state = make_state(clock="emulated")
    settings = AggregationSettings(policy={"name": policy, **({"buffer": 2} if policy == "fedbuff" else {})},
                                   server_optimizer=optimizer)
    state.config = state.config.model_copy(update={"aggregation": settings})
    state.policy, state.server = settings.round_policy(), AggregatingServer(settings.aggregator())
    join_all(state)
    run, fake = runner(state)
    if state.policy.asynchronous:
        run = AsyncRoundRunner(state, fake, fake.clock, run.collection, state.policy)
    before = {"w": state.server.global_state["w"].copy()}
    record = run.run_round(0, 0)
    (_, _, updates), = state.server.aggregated
    assert not record.skipped and len(updates) == (3 if policy == "sync" else state.policy.needed)
    aggregate = {"w": before["w"] + fedavg(updates, settings.aggregator())["w"]}
    expected = settings.server_step().step(before, aggregate, frozenset({"w"}))  # a fresh optimiser's first step
    np.testing.assert_array_equal(state.server.global_state["w"], expected["w"])
    assert not (state.server.global_state["w"] == before["w"]).all()
    assert sorted(state.policy.state_arrays()) == sorted(f"{slot}/w" for slot in settings.server_step().slots)
