"""The experiment tables (``python -m experiments.<table>``): a run directory is read, not run again;
``--report-only`` and another process's lock leave a run out; a table row from a run's summary."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import claims, feature_replay_table, generative_table, glfc_table, many_class_table, runs
from fcl_emu.monitoring.results import RunSummary

ROOT = Path(__file__).resolve().parents[1]  # the tables run from a checkout: python -m experiments.<table>

SUMMARY = {
    "status": "completed", "method": "glfc", "dataset": "mnist", "scenario": {"num_tasks": 2},
    "accuracy_matrix": [[90.0, None], [60.0, 80.0]], "accuracy_all": [45.0, 70.0], "average_accuracy": 70.0,
    "average_forgetting": 30.0, "knowledge_retention": {"temporal": 66.7, "spatial": 71.0, "private": None},
    "bytes": {"old_model": {"sent": 2_000_000}, "train_request": {"sent": 3_000_000}, "job": {"sent": 500_000}},
    "messages": {"prototype_gradients/received": 4}, "bytes_total": 5_500_000, "rounds": 4, "wall_clock_s": 12.0,
    "gpu_jobs": {"workers": 1, "device": "cpu", "by_kind": {"glfc.proxy": {"jobs": 2, "run_s": 3.5},
                                                              "device.matmul": {"jobs": 1, "run_s": 0.5}}},
}


def test_a_finished_run_is_read_and_a_missing_one_left_out_with_report_only(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps(SUMMARY))
    summary = runs.run_up("a", {}, "unused", tmp_path)
    assert isinstance(summary, RunSummary) and summary.average_accuracy == 70.0
    assert runs.run_up("b", {}, "unused", tmp_path, report_only=True) is None
    assert not (tmp_path / "b").exists()


def test_a_run_started_keeps_the_cpu_time_of_its_processes_and_their_children(tmp_path):
    grandchild = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'sum(range(20_000_000))'])"
    cpu = runs.run_timed([sys.executable, "-c", grandchild])
    assert cpu["user_s"] > 0.2  # the grandchild's loop, about a second
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / runs.HOST_CPU).write_text(json.dumps({"user_s": 2.0, "system_s": 0.5}))
    assert runs.host_cpu_s(tmp_path, "a") == 2.5 and runs.host_cpu_s(tmp_path, "b") is None


def test_a_run_locked_by_another_process_is_left_out(tmp_path, capsys):
    with open(tmp_path / ".b.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert runs.run_up("b", {"seed": 0}, "unused", tmp_path) is None
    assert "being run by another process" in capsys.readouterr().err
    assert not (tmp_path / "b.yaml").exists()


def test_rows_read_the_summary_record():
    summary = RunSummary.from_dict(SUMMARY)
    events = [{"event": "round", "task": t, "bytes_by_type": {"prototype_gradients": {"received": 1000}},
               "client_metrics": None} for t in (0, 1)]
    glfc = glfc_table.row("glfc-oracle", 0, summary, events)
    assert (glfc["mb_old_model"], glfc["proxy_s"], glfc["prototype_gradient_messages"]) == (2.0, 3.5, 4)
    assert glfc["kb_prototype_gradients_per_task"] == [1.0, 1.0] and glfc["final_row"] == [60.0, 80.0]
    replay = feature_replay_table.row("glfc", 0, summary, {"glfc": 55.58})
    assert (replay["ga_mean"], replay["kr_t"], replay["server_jobs_s"]) == (57.5, 66.7, 3.5)
    generative = generative_table.run_row("glfc", 0, summary, events)
    assert generative["old_accuracy"] == [60.0] and generative["server_job_s"] == 3.5


@pytest.mark.slow
def test_every_table_runs_as_a_module():
    for table in ("glfc_table", "feature_replay_table", "generative_table", "secagg_table", "many_class_table"):
        done = subprocess.run([sys.executable, "-m", f"experiments.{table}", "--help"], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0 and "--out" in done.stdout, done.stderr


def test_noisy_affcl_rows_take_the_code_readmes_noisy_client_settings():
    base, rows, _ = feature_replay_table.TABLES["affcl"]
    readme = {"flow_lr": 1e-3, "k_loss_flow": 0.5, "k_flow_last": 0.1, "theta": 0.5}  # its EMNIST-noisy command
    method, options = rows["affcl-noisy"]
    assert method == "affcl" and options == readme
    assert feature_replay_table.config(base, "affcl-noisy", method, options)["scenario"]["noisy_client_fraction"] > 0
    assert rows["affcl"] == ("affcl", {})  # the clean rows keep the defaults (its EMNIST-Letters command)
    assert rows["affcl-strong-noisy"][1] == {**readme, **feature_replay_table.STRONG}
    assert rows["fedavg-noisy"] == ("fedavg", {})


def test_paired_verdict_needs_every_seed_in_the_claimed_direction_and_two_standard_errors():
    # differences 5, 4, 6: mean 5, sd 1, se 1/sqrt(3) = 0.577; 5 > 1.15
    assert claims.paired_verdict([30, 31, 32], [25, 27, 26])[0] == claims.REPRODUCED
    # differences 5, 4, -1: one seed reversed
    assert claims.paired_verdict([30, 31, 25], [25, 27, 26])[0] == claims.INCONCLUSIVE
    # differences 1, 9, 2: all positive, mean 4, sd 4.36, se 2.52; 4 < 5.03
    assert claims.paired_verdict([11, 19, 12], [10, 10, 10])[0] == claims.INCONCLUSIVE
    verdict, text = claims.paired_verdict([20, 21, 22], [25, 27, 26])  # -5, -6, -4
    assert verdict == claims.NOT_REPRODUCED
    assert "paired difference -5.00 ± 0.58" in text and "-5.00, -6.00, -4.00" in text
    # forgetting: lower is better
    assert claims.paired_verdict([10, 11, 12], [20, 22, 21], lower_is_better=True)[0] == claims.REPRODUCED
    assert claims.paired_verdict([30, 31], [25, 27])[0].startswith("not judged: 2 paired seeds")
    # identical differences (deterministic runs): se 0, any mean above the least effect (1 point) holds
    assert claims.paired_verdict([2.0, 2.0, 2.0], [0.5, 0.5, 0.5])[0] == claims.REPRODUCED
    # hundredths of a point in every seed: inconclusive however small the spread
    assert claims.paired_verdict([19.99, 20.01, 20.0], [19.97, 19.97, 19.98])[0] == claims.INCONCLUSIVE


def test_the_learnability_gate_wants_every_task_learned_and_forgetting_to_prevent():
    pilot = {"status": "completed", "learned_accuracy": [55.0, 63.6, 64.4], "final_row": [0.0, 10.0, 64.4]}
    gate = claims.learnability_gate(pilot, 50)  # need max(40, 4 x 2) = 40
    assert gate.passed and "need 40.0" in gate.reason and "old tasks at the end 5.0 of 59.3 %" in gate.reason
    assert not claims.learnability_gate({**pilot, "learned_accuracy": [55.0, 39.9, 64.4]}, 50).passed
    few = claims.learnability_gate(pilot, 6)  # 4 x chance = 4 x 1/6 = 66.7 %, above the floor
    assert not few.passed and "need 66.7" in few.reason
    kept = claims.learnability_gate({**pilot, "final_row": [30.0, 30.0, 64.4]}, 50)  # 30 of 59.3 > a third
    assert not kept.passed and "little forgetting to prevent" in kept.reason
    assert not claims.learnability_gate(None, 50).passed
    assert not claims.learnability_gate({**pilot, "status": "failed"}, 50).passed


def test_verdicts_below_the_gate_are_uninformative_and_above_it_paired():
    rows = [{"method": m, "seed": s, "status": "completed", "time_avg": v}
            for m, vals in (("mfcl", (40, 42, 41)), ("fedavg", (20, 21, 19))) for s, v in enumerate(vals)]
    claim = claims.Claim("mfcl", "fedavg", "MFCL Table 4", "time_avg", (44.98, 22.27))
    passed, failed = claims.Gate(True, "numbers"), claims.Gate(False, "numbers")
    lines = claims.verdicts(rows, (claim,), passed)
    assert lines[0] == "Learnability gate: passed (numbers)."
    assert lines[1].startswith("- mfcl above fedavg in time-averaged accuracy (MFCL Table 4; paper: 44.98 vs 22.27): "
                               "**reproduced in direction** (ours: 41.00 vs 20.00, seeds 0, 1, 2; paired difference")
    assert claims.verdicts(rows, (claim,), failed)[1].endswith(claims.UNINFORMATIVE)
    with pytest.raises(ValueError, match="claim metric"):
        claims.Claim("a", "b", "x", "accuracy")


def many_class_row(method: str, seed: int, accuracy: float, status: str = "completed") -> dict:
    return {"method": method, "seed": seed, "status": status, "avg_accuracy": accuracy, "avg_forgetting": 50.0,
            "time_avg": accuracy + 10, "learned_accuracy": [50.0, 45.0], "final_row": [5.0, 45.0],
            "old_accuracy": [10.0, 5.0], "wall_s": 1800.0, "cpu_s": 3600.0 if seed == 0 else None}


def test_many_class_markdown_gives_the_published_column_the_cpu_hours_and_a_verdict_per_claim():
    rows = [many_class_row("fedavg", s, a) for s, a in enumerate((10.0, 11.0, 12.0))]
    rows += [many_class_row("target", s, a) for s, a in enumerate((20.0, 21.5, 22.0))]
    rows += [many_class_row("mfcl", s, a) for s, a in enumerate((21.0, 23.0))]
    rows.append(many_class_row("lander", 0, 0.0, status="failed"))
    table = many_class_table.markdown(rows, list(many_class_table.METHODS))
    lines = table.splitlines()
    assert "| fedavg | 3 | 11.00 ± 1.00 | 21.00 ± 1.00 | 50.00 ± 0.00 | 50.0, 45.0" \
           " | 5.0 ± 0.0 | 6.40 ± 0.50 | 1800 ± 0 |" in lines
    assert any(line.startswith("| mfcl | 2 | 22.00 ± 1.41 |") for line in lines)
    assert "| lander | 0 | failed | | | | | 16.36 ± 1.00 | |" in lines
    assert "| fedewc | 0 | not run yet | | | | | 7.36 ± 0.60 | |" in lines
    assert any(line.startswith("| mfcl | 2 |") and "| none read |" in line for line in lines)
    assert "Published: Qi et al., FedCBDR (arXiv 2507.07712), Table 2" in table
    assert ("CPU hours of these 9 runs: 6.50 (the CPU time of all their processes; 5 of them without it, counted as "
            "wall clock x 1 thread).") in table
    assert "Learnability gate: passed (pilot's tasks right after each: 50.0, 45.0 % (need 40.0)" in table
    target = ("- target above fedavg in final average accuracy (LANDER Table 1 (TARGET's rows); paper: 24.76 vs 7.83): "
              "**reproduced in direction** (ours: 21.17 vs 11.00")
    assert any(line.startswith(target) for line in lines)
    assert any(line.startswith("- mfcl above fedavg in time-averaged accuracy") and "not judged: 2 paired seeds" in line
               for line in lines)
    assert any(line.startswith("- target above fedlwf2t") and line.endswith("not measured yet") for line in lines)
    below = [dict(r, learned_accuracy=[50.0, 20.0]) if r["method"] == "fedavg" else r for r in rows]
    uninformative = [line for line in many_class_table.markdown(below, list(many_class_table.METHODS)).splitlines()
                     if line.startswith("- ")]
    assert len(uninformative) == len(many_class_table.TEN_TASKS.claims)
    assert all(claims.UNINFORMATIVE in line for line in uninformative)


def test_many_class_markdown_in_five_tasks_judges_against_the_papers_five_task_tables():
    rows = [many_class_row(m, s, a + s) for m, a in (("fedavg", 10.0), ("fedlwf2t", 12.0), ("lander", 20.0))
            for s in range(3)]
    rows = [dict(r, avg_forgetting=30.0, bounding_mean=0.02, bounding_rounds=[10, 10], coverage_min=0.6 + r["seed"])
            if r["method"] == "lander" else r for r in rows]
    lines = many_class_table.markdown(rows, ["fedavg", "fedlwf2t", "lander"], classes=50, tasks=5).splitlines()
    assert "LANDER's Bounding term (clients' mean per round): 0.0200 ± 0.0000 over the seeds, non-zero in 30 of 30 " \
           "rounds." in lines
    assert any(line.startswith("Synthetic images") and line.endswith(": lander 0.60.") for line in lines)
    assert "| lander | 3 | 21.00 ± 1.00 | 31.00 ± 1.00 | 30.00 ± 0.00 | 50.0, 45.0" \
           " | 5.0 ± 0.0 | 30.29 | 1800 ± 0 |" in lines
    assert "| fedavg | 3 | 11.00 ± 1.00 | 21.00 ± 1.00 | 50.00 ± 0.00 | 50.0, 45.0" \
           " | 5.0 ± 0.0 | none read | 1800 ± 0 |" in lines
    assert any(line.startswith("Published: LANDER Table 2, Tiny-ImageNet") for line in lines)
    forgets = ("- lander forgets less than fedlwf2t in average forgetting (LANDER Table 2; paper: 21.65 vs 34.57): "
               "**reproduced in direction**")
    assert any(line.startswith(forgets) for line in lines)
    assert not any(line.startswith("- glfc") or line.startswith("- mfcl") for line in lines)  # rows not run
    assert lines[-1].startswith("Not judged here (a row it needs is not in this table's methods): mfcl above fedavg")
    assert "glfc above fedavg in final average accuracy (FedCBC Table 3" in lines[-1]
    assert many_class_table.paper_numbers(10) is many_class_table.TEN_TASKS


def test_many_class_runs_are_tiny_imagenet_in_ten_tasks_at_the_stated_cpu_budget():
    cfg = many_class_table.config("lander", 0.04, 1)
    assert cfg["scenario"]["dataset"] == "tiny-imagenet-32" and cfg["scenario"]["num_tasks"] == 10
    assert cfg["seed"] == cfg["scenario"]["seed"] == 1 and cfg["gpu"]["threads"] == 1 and cfg["model"] == "cnn_bn"
    assert cfg["method_options"] == {"generator_width": 32, "synthetic_batch": 32, "synthesis_batch": 64,
                                     "synthesis_rounds": 2, "warmup": 1}
    assert many_class_table.config("mfcl", 0.04, 0)["method_options"]["generator_iterations"] == 4
    glfc = many_class_table.config("glfc", 0.04, 0)["method_options"]
    assert (glfc["memory_size"], glfc["perturb_steps"], glfc["proxy_iterations"]) == (200, 2, 10)
    gpu = many_class_table.config("glfc", 1.0, 0, {**many_class_table.BASE, "device": "cuda"})["method_options"]
    assert "perturb_steps" not in gpu and gpu["proxy_iterations"] == 250  # the code's on a GPU
    # the generative table keeps its half-width generators
    assert generative_table.config("lander", "mnist", 0.125, 0)["method_options"]["generator_width"] == 64


def test_option_sets_one_methods_option_in_every_run_of_it():
    import argparse
    options = [runs.method_option("mfcl:generator_iterations=200"), runs.method_option("lander:warmup=2")]
    assert options[0] == ("mfcl", "generator_iterations", 200)
    mfcl = runs.with_options(many_class_table.config("mfcl", 0.04, 0), options)
    assert mfcl["method_options"]["generator_iterations"] == 200 and mfcl["method_options"]["generator_width"] == 32
    assert runs.with_options(many_class_table.config("fedavg", 0.04, 0), options)["method_options"] == {}
    with pytest.raises(argparse.ArgumentTypeError, match="METHOD:KEY=VALUE"):
        runs.method_option("generator_iterations=200")


def test_synthetic_coverage_is_the_rarest_class_share_against_its_even_share_at_the_worst_job():
    evs = [{"event": "job", "metrics": {"classes": 4.0, "class_share_min": 0.2}},  # 0.2 x 4 = 0.8
           {"event": "job", "metrics": {"classes": 2.0, "class_coverage_min": 0.15}},  # MFCL's name: 0.3
           {"event": "job", "metrics": {"class_share_min": 0.0}},  # no classes reported: left out
           {"event": "round", "metrics": {}}]
    assert generative_table.synthetic_coverage(evs) == pytest.approx(0.3)
    assert generative_table.synthetic_coverage(evs[2:]) is None


def test_flow_diagnostics_take_the_last_nll_and_the_worst_old_flow_nll():
    evs = [{"event": "round", "client_metrics": {"flow_nll": 500.0, "flow_nll_old": 0.0}},
           {"event": "round", "client_metrics": {"flow_nll": 480.0, "flow_nll_old": 9e15}},
           {"event": "round", "client_metrics": {"flow_nll": 470.0, "flow_nll_old": 850.0,
                                                 "generated_agreement": 0.25}},
           {"event": "task_end"}]
    evs.append({"event": "round", "client_metrics": {"flow_nll": 460.0, "credibility_local": 0.3, "p_bar": 0.2}})
    assert feature_replay_table.flow_diagnostics(evs) == {"flow_nll": 460.0, "flow_nll_old_max": 9e15,
                                                          "generated_agreement": 0.25, "credibility_local": 0.3,
                                                          "p_bar": 0.2}
    assert feature_replay_table.flow_diagnostics(evs[:2])["generated_agreement"] is None  # runs before the metric
    assert feature_replay_table.flow_diagnostics([{"event": "round", "client_metrics": None}]) == {}


def test_every_feature_replay_row_is_a_valid_run_config():
    """Each table's rows make run configs the emulator accepts (method options included); affcl-mixed trains every
    row with Adam, and the FedCBC tables sweep GLFC's memory."""
    from fcl_emu.runconfig import RunConfig

    for name, (base, rows, _) in feature_replay_table.TABLES.items():
        for row_name, (method, options) in rows.items():
            cfg = RunConfig(**runs.seeded(feature_replay_table.config(base, row_name, method, options), 1))
            assert cfg.method == method and cfg.seed == 1, (name, row_name)
            if name == "affcl-mixed":
                assert (cfg.training.optimizer, cfg.training.lr, cfg.scenario.dataset) == ("adam", 1e-3,
                                                                                            "mnist-fashion")
    _, rows, _ = feature_replay_table.TABLES["affcl-mixed"]  # the code's mixed-pool command, replay at the lr
    assert rows["affcl"][1] == {"flow_lr": 1e-3, "k_loss_flow": 0.1, "k_flow_last": 0.0, "theta": 0.0,
                                "replay_lr": 1e-3}
    assert rows["affcl-noisy"][1]["theta"] == 0.5 and rows["fedlwf2t-noisy"] == ("fedlwf2t", {})
    _, rows, _ = feature_replay_table.TABLES["fedcbc-cifar10-incremental"]
    assert sorted(o["memory_size"] for m, o in rows.values() if m == "glfc") == [200, 500, 1000, 2000]
    assert {c.other for c in feature_replay_table.CLAIMS["fedcbc-cifar10-incremental"]} >= {"glfc-m200", "fedavg"}


def test_proxy_picks_count_tasks_that_kept_their_last_model_and_perfect_scores():
    def proxy(task, rnd, score):
        return [{"event": "job", "job_kind": "glfc.proxy", "ok": True, "metrics": {"score": score}},
                {"event": "server_job", "kind": "proxy", "task": task, "round": rnd, "ok": True}]
    # task 0: best at round 1 (0.9 > 0.8): not the last; task 1: a tie at 1.0, the later (round 4, the last) kept
    evs = [*proxy(0, 1, 0.9), *proxy(0, 2, 0.8), *proxy(1, 3, 1.0), *proxy(1, 4, 1.0),
           {"event": "job", "job_kind": "device.matmul", "ok": True, "metrics": {}}]
    assert glfc_table.proxy_picks(evs) == {"last_picked": 1, "tasks": 2, "perfect": 2, "scored": 4}
    assert glfc_table.proxy_picks([{"event": "round"}]) is None
