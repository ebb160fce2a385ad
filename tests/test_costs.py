"""Tests of the judge's money (machinery/costs.py, the ledger): projected before it is spent, by the dry run and
at the start of a run, then counted step by step and bounded by --judge-budget, a crash included."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch

import stratagem as S
from machinery import judge as J
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    SMALL,
    check_run,
    dry_run,
    judge_server_fixture,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    secret_key_fixture,
)


# ---- The money: projected before it is spent, counted, bounded by the budget
def test_project_arithmetic():
    from machinery import costs

    p = costs.project(
        steps=400,
        batch_size=128,
        sample_rate=0.25,
        rubrics=["transferability", "evolution"],
        samples=1,
        turns=4.0,
        one_turn=0.25,
        chars={"transferability": 4000, "evolution": 4800},
        response_tokens=1000,
        reply_tokens=200,
        prices=(2.5, 10.0),
    )
    # 128 / 4 = 32 trajectories a step, ceil(0.25 * 32) = 8 judged, 8 transferability + 6 evolution requests
    # prompt tokens a step: 8 * (4000/4 + 4 * 1000) + 6 * (4800/4 + 4 * 1000) = 40,000 + 31,200
    assert p == {
        "trajectories": 32.0,
        "judged": 8,
        "requests": 5600.0,
        "prompt_tokens": 28_480_000.0,
        "completion_tokens": 1_120_000.0,
        "money": pytest.approx(28.48 * 2.5 + 1.12 * 10),
    }
    assert (
        costs.project(
            1, 10, 0.1, ["transferability"], 3, 2.0, 0.0, {"transferability": 400}, 0, 0, (1, 1)
        )["requests"]
        == 3
    )


def test_judge_price_in_and_out_come_from_the_dated_table_unless_given():
    from machinery import costs

    assert (S.Args().judge_price_in, S.Args().judge_price_out) == J.PRICES["gpt-4o"] == (2.5, 10.0)
    assert (
        S.Args(judge_price_in=3.0).judge_price_in,
        S.Args(judge_price_in=3.0).judge_price_out,
    ) == (3.0, 10.0)
    assert (
        S.Args(judge_model="my-local-judge").judge_price_in == 0.0
        and S.Args(judge="heuristic").judge_price_out == 0.0
    )
    state = random.getstate()
    projection = costs.judge_projection(
        S.Args(judge_model="my-local-judge"), ["TicTacToe-v0"], S.make_env, 400
    )
    assert random.getstate() == state  # the dry render leaves training's draws alone
    assert costs.projection_lines(S.Args(judge_model="my-local-judge"), projection)[-1] == (
        "judge money: my-local-judge is not in the price table of 2025-06; pass --judge-price-in/out to see money"
    )


def test_judge_projection_example_never_exceeds_the_bound():
    """--tiny caps responses at 48 tokens: the plan's example (1,000-token responses) must not cost more
    than the bound it illustrates."""
    from machinery import costs

    args = S.resolve_args({"tiny": True, "judge": "openai", "judge_model": "gpt-4o"})
    p = costs.judge_projection(args, ["TicTacToe-v0"], S.make_env, 10)
    assert p["example_tokens"] == (48, 200) and p["example"]["money"] <= p["bound"]["money"]
    money = costs.projection_lines(args, p)[-1]
    assert (
        money.startswith(f"judge money: at most {costs.dollars(p['bound']['money'])}, ~")
        and "48-token responses" in money
    )


def test_judge_projection_uses_the_runs_own_counts_after_step_1_and_on_resume(
    tmp_path, judge_server, secret_key, capsys
):
    """A random tiny policy loses every game on its first move: many more one-turn trajectories a step than the
    random players of the dry render play. After step 1, and on --resume, the projection uses what it played."""
    out = tmp_path / "run"
    flags = ["--judge-base-url", judge_server.url]
    assert (
        run(
            SMALL
            + [
                "--steps",
                "2",
                "--out",
                str(out),
                "--judge",
                "openai",
                "--judge-model",
                "judge-test",
            ]
            + flags
        )
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    estimates = [x for x in printed if x.startswith("judge requests: ")]
    assert len(estimates) == 2 and estimates[0].endswith(
        "a random player's games (the dry render): an estimate until this policy has played a step)"
    )
    metrics = read_jsonl(out / "metrics.jsonl")
    assert (
        printed.index(estimates[1])
        == printed.index(next(x for x in printed if x.startswith("step 1/2"))) + 1
    )
    n = metrics[0]["trajectories"]
    assert estimates[1].startswith(
        f"judge requests: ~{math.ceil(0.25 * n)} over 1 step (~{n:.1f} trajectories a step"
    )
    assert estimates[1].endswith(
        "one-turn ones skip evolution: 100%; measured on this run's policy over 1 step)"
    )
    assert run(["--resume", "--out", str(out), "--steps", "4"] + flags) == 0
    [resumed] = [
        x for x in capsys.readouterr().out.splitlines() if x.startswith("judge requests: ")
    ]
    n = (metrics[0]["trajectories"] + metrics[1]["trajectories"]) / 2
    assert resumed.startswith(
        f"judge requests: ~{2 * math.ceil(0.25 * n)} over 2 steps (~{n:.1f} trajectories a step"
    )
    assert resumed.endswith("measured on this run's policy over 2 steps)")


def test_dry_run_prints_the_plan_and_the_money_and_writes_nothing(tmp_path):
    """On this CPU machine, offline: nothing is downloaded or loaded (Qwen3-4B-Base is not here), nothing is
    written, and docs/judge.md quotes what it prints."""
    before = set(os.listdir(HERE))
    proc = subprocess.run(
        [sys.executable, str(HERE / "stratagem.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert (
        proc.returncode == 0
        and proc.stderr == ""
        and os.listdir(tmp_path) == []
        and set(os.listdir(HERE)) == before
    )
    lines = proc.stdout.splitlines()
    assert (
        lines[1].startswith("run directory: runs/stratagem-s1-")
        and "model: Qwen/Qwen3-4B-Base" in lines
    )
    assert "engine: hf on cpu (auto: cpu, not a GPU)" in lines or torch.cuda.is_available()
    money = next(x for x in lines if x.startswith("judge money: at most $"))
    assert (
        "USD 2.50 in / 10.00 out per 1M tokens, list prices of 2025-06; the paper: ~$100 a run"
        in money
    )
    readme = (HERE / "docs" / "judge.md").read_text()
    free = re.compile(r" of [\d.]+ GiB free now\)")  # this machine's free memory, said once
    said = [
        free.sub(" of X GiB free now)", x) for x in lines if not x.startswith(("run dir", "engine"))
    ]
    assert all(line in free.sub(" of X GiB free now)", readme) for line in said)
    assert any(x.startswith("this CPU: does NOT fit (the learner's peak 69.6 GiB") for x in said)
    assert (
        "pass --judge-price-in/out to see money"
        in dry_run("--judge-model", "my-local-judge").stdout
    )


def test_judge_sample_rate_0_projects_no_request_and_trains_unmodulated(
    tmp_path, judge_server, secret_key, capsys
):
    dry = dry_run("--judge-sample-rate", "0", "--out", str(tmp_path / "dry"))
    assert dry.returncode == 0, dry.stderr
    assert (
        "judge requests: none (--judge-sample-rate 0)" in dry.stdout
        and "judge money: $0" in dry.stdout
    )
    out = tmp_path / "run"
    judge = ["--judge", "openai", "--judge-base-url", judge_server.url, "--judge-sample-rate", "0"]
    assert run(SMALL + judge + ["--steps", "1", "--out", str(out)]) == 0
    assert "judge requests: none (--judge-sample-rate 0)" in capsys.readouterr().out
    check_run(out, 1, beta=0.2)
    [m] = read_jsonl(out / "metrics.jsonl")
    assert (
        m["judge_requests"] == m["judge_judged"] == 0
        and not judge_server.requests
        and not m["modulated"]
    )
    rows = read_jsonl(out / "trajectories.jsonl")
    assert all(t["phi"] == 1.0 and t["psi"] == 0.0 and t["a_mod"] == t["a_game"] for t in rows)


def test_judge_budget_stops_judging_for_good_and_the_cost_is_logged(
    tmp_path, judge_server, secret_key, capsys
):
    """100 prompt + 10 completion tokens a request at 10 and 20 per million: 0.0012 a request. With one
    request at a time a budget of 0.005 stops judging after the 5th request, for good."""
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "3",
                "--out",
                str(out),
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
                "--judge-sample-rate",
                "1",
                "--judge-concurrency",
                "1",
                "--judge-price-in",
                "10",
                "--judge-price-out",
                "20",
                "--judge-budget",
                "0.005",
            ]
        )
        == 0
    )
    metrics, _ = check_run(out, 3, beta=0.2)
    assert len(judge_server.requests) == 5
    assert sum(m["judge_requests"] for m in metrics) == 5
    for m in metrics:
        assert m["judge_cost"] == pytest.approx(0.0012 * m["judge_requests"])
    assert (
        metrics[-1]["judge_cost_total"] == pytest.approx(0.006)
        and metrics[-1]["judge_budget_exhausted"]
    )
    assert (
        metrics[0]["judge_skipped_budget"] > 0
        and metrics[-1]["judge_judged"] == 0
        and not metrics[-1]["modulated"]
    )
    captured = capsys.readouterr()
    assert (
        captured.out.count("JUDGE BUDGET REACHED") == 1
        and captured.err.count("JUDGE BUDGET REACHED") == 1
    )
    spent = metrics[0][
        "judge_cost_total"
    ]  # the step line: the money so far, and the whole run at that rate
    assert f") ${spent:.4f} (run at this rate: ${spent / 1 * 3:.2f}) | phi" in captured.out


def test_ledger_totals_keep_the_money_of_a_step_lost_to_a_crash_in_the_total_and_the_budget(
    tmp_path, judge_server, secret_key, capsys
):
    """0.0012 a request (see test_judge_budget_stops_judging_for_good_and_the_cost_is_logged). Step 2 is
    paid for, then lost to a crash: its replay comes from the cache for free, but its money was spent, so
    the total and the budget keep it."""
    import shutil

    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "1",
                "--out",
                str(out),
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
                "--judge-sample-rate",
                "1",
                "--judge-price-in",
                "10",
                "--judge-price-out",
                "20",
            ]
        )
        == 0
    )
    shutil.copytree(out / "checkpoints", tmp_path / "ckpt-1")
    resume = ["--resume", "--out", str(out), "--steps", "2", "--judge-base-url", judge_server.url]
    assert run(resume) == 0
    paid = len(judge_server.requests)
    assert read_jsonl(out / "metrics.jsonl")[-1]["judge_cost_total"] == pytest.approx(0.0012 * paid)
    shutil.rmtree(
        out / "checkpoints"
    )  # crash after step 2 was judged and logged, before its checkpoint
    shutil.copytree(tmp_path / "ckpt-1", out / "checkpoints")
    assert run(resume) == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    assert (
        len(judge_server.requests) == paid and metrics[-1]["judge_requests"] == 0
    )  # replayed from the cache
    assert metrics[-1]["judge_cost_total"] == pytest.approx(
        0.0012 * paid
    )  # ... but the money is not forgotten
    assert len(read_jsonl(out / "judge_ledger.jsonl")) == paid
    shutil.rmtree(out / "checkpoints")
    shutil.copytree(tmp_path / "ckpt-1", out / "checkpoints")
    capsys.readouterr()
    assert (
        run(resume + ["--judge-budget", f"{0.0012 * paid - 1e-9}"]) == 0
    )  # spent: no more requests
    assert "JUDGE BUDGET REACHED at step 1" in capsys.readouterr().out
    assert (
        len(judge_server.requests) == paid
        and read_jsonl(out / "metrics.jsonl")[-1]["judge_judged"] == 0
    )
