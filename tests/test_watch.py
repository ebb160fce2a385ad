"""Tests of what a run prints and reports (machinery/watch.py): the start line, the progress bar, the judge's
alarms, the budget banner and --report-to (TensorBoard, W&B)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import stratagem as S
from machinery import distributed, watch
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    SMALL,
    JudgeServer,
    error_of,
    files_contain,
    good_judge,
    judge_server_fixture,
    no_process_left_behind,
    on_a_terminal,
    only_the_vllm_tests,
    python,
    read_jsonl,
    run,
    secret_key_fixture,
)


# ---- What a run prints: the start line, the progress bar, the closing advice
def test_start_line_names_the_run_and_logs_stay_clean_lines(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    threads, why = distributed.pick_threads(torch.device("cpu"))
    assert lines[0] == (
        f"stratagem: new run in {out} | mode stratagem, beta 0.2 | model tiny (a random tiny Qwen3, built "
        f"offline), hf on cpu (auto: cpu, not a GPU), torch threads {threads} ({why}) | judge heuristic stand-in "
        f"(offline, NOT the paper's judge) "
        f"on 25% of "
        f"trajectories | steps 1, batch 12 transitions | logs metrics.jsonl"
    )
    assert lines[1] == "loading the policy: a random tiny Qwen3, built offline ..."
    assert (
        lines[2].startswith("loaded in ") and lines[3].startswith("step 1/1 | ") and len(lines) == 5
    )
    assert lines[4] == (
        f"done: 1 step in {out} (metrics.jsonl, trajectories.jsonl, checkpoints/). Next: "
        f"python stratagem.py plot {out} --out {out / 'plots'}  |  python stratagem.py show {out} "
        f"--judged  |  python stratagem.py eval {out} --games TicTacToe-v0,KuhnPoker-v1,SimpleNegotiation-v1 --n 20"
    )
    assert printed.err == ""  # stderr is not a terminal here: no progress bar, no alarm


def test_start_line_names_the_ranks_under_torchrun():
    args = S.resolve_args({"tiny": True, "out": "r", "backend": "hf"})
    line = watch.start_line(
        args, Path("r"), torch.device("cpu"), "auto: cpu, not a GPU", (1, "OMP_NUM_THREADS"), 2
    )
    assert (
        "hf on cpu (auto: cpu, not a GPU), torch threads 1 (OMP_NUM_THREADS), 2 ranks (torchrun), each "
        in line
    )


def test_Progress_and_Games_bars_on_a_terminal(tmp_path):
    argv = SMALL + ["--steps", "1", "--out", str(tmp_path / "run"), "--judge-sample-rate", "1"]
    argv += ["--eval-every", "1", "--eval-n", "2", "--keep-best", "--best-eval-n", "2"]
    code, frames, stdout = on_a_terminal([str(HERE / "stratagem.py"), *argv], HERE)
    assert code == 0
    assert any(
        re.search(r"^step 1/1 .* \d+/\d+ transitions, \d+ games finished \[", f) for f in frames
    )
    assert any(re.search(r"games finished, judge \d+/\d+ requests", f) for f in frames)
    assert any("games finished, learning" in f for f in frames)
    for when in ("step 0/1: eval vs random", "step 1/1: eval vs random", "best/: fresh games"):
        assert any(re.search(rf"^{re.escape(when)} .* \d+/\d+ games \[", f) for f in frames), when
    assert "\r" not in stdout and stdout.splitlines()[-3].startswith(
        "step 1/1 | "
    )  # the step line stays clean
    assert stdout.splitlines()[-2].startswith("best/ (step ")
    assert stdout.splitlines()[-1].startswith("done: 1 step in ")


# ---- The judge's alarms and the budget banner
def test_judge_alarm_when_every_request_fails(tmp_path, secret_key, capsys):
    server = JudgeServer(lambda body: (500, {"error": {"message": "boom"}}))
    out = tmp_path / "run"
    try:
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
                    "--judge-base-url",
                    server.url,
                    "--judge-sample-rate",
                    "1",
                    "--judge-retries",
                    "0",
                ]
            )
            == 0
        )
    finally:
        server.close()
    metrics = read_jsonl(out / "metrics.jsonl")
    n = [m["judge_judged"] for m in metrics]
    assert capsys.readouterr().err.splitlines() == [
        *(
            f"!!! JUDGE ALARM at step {s}: {k} of {k} judged trajectories failed ({k} server_error); ran unmodulated "
            f"(phi = 1, psi = 0: A_mod = A_game, plain SPIRAL)"
            for s, k in zip((1, 2), n)
        ),
        f"!!! JUDGE ALARM over the whole run (steps 1-2), no valid verdict: {sum(n)} of {sum(n)} judged trajectories "
        f"failed ({sum(n)} server_error); ran unmodulated (phi = 1, psi = 0: A_mod = A_game, plain SPIRAL)",
    ]


def test_judge_alarm_when_half_or_more_fail_names_the_verdicts_left(tmp_path, secret_key, capsys):
    answered, lock = [], threading.Lock()

    def first_request_only(body):
        with lock:
            answered.append(1)
            first = len(answered) == 1
        return good_judge(body) if first else (500, {"error": {"message": "boom"}})

    server = JudgeServer(first_request_only)
    out = tmp_path / "run"
    try:
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
                    server.url,
                    "--judge-sample-rate",
                    "1",
                    "--judge-retries",
                    "0",
                    "--no-psi",
                ]
            )
            == 0
        )
    finally:
        server.close()
    [m] = read_jsonl(out / "metrics.jsonl")
    k = m["judge_judged"]
    assert k >= 2 and m["judge_failed"] == k - 1 and m["modulated"]
    assert capsys.readouterr().err == (
        f"!!! JUDGE ALARM at step 1: {k - 1} of {k} judged trajectories failed "
        f"({k - 1} server_error); phi and psi batch means rest on 1 verdict(s) only\n"
    )


@pytest.mark.slow
def test_announce_budget_says_the_banner_once_when_stdout_and_stderr_share_a_log(
    tmp_path, judge_server
):
    flags = ["--judge", "openai", "--judge-base-url", judge_server.url, "--judge-sample-rate", "1"]
    flags += [
        "--judge-price-in",
        "10",
        "--judge-budget",
        "0.001",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "run"),
    ]
    proc = python(
        ["stratagem.py"] + SMALL + flags,
        HERE,
        stderr=subprocess.STDOUT,
        env={"OPENAI_API_KEY": "x"},
    )
    assert proc.returncode == 0 and proc.stdout.count("JUDGE BUDGET REACHED") == 1, proc.stdout[
        -3000:
    ]
    assert "so A_mod keeps its scale" in proc.stdout
    assert (
        "phi 0.525 psi 0.000 (recent judged steps' mean: budget spent)"
        in proc.stdout.splitlines()[-2]
    )


# ---- --report-to: TensorBoard and W&B
def test_report_to_imports_only_when_asked_and_rejects_unknown_values(
    tmp_path, capsys, monkeypatch
):
    for module in ("wandb", "tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)  # importing any of them now fails
    assert "pip install wandb" in error_of(
        capsys, SMALL + ["--report-to", "wandb", "--out", str(tmp_path / "w")]
    )
    assert "pip install tensorboard" in error_of(
        capsys, SMALL + ["--report-to", "tensorboard", "--out", str(tmp_path / "t")]
    )
    assert "argument --report-to: invalid choice: 'mlflow'" in error_of(
        capsys, SMALL + ["--report-to", "mlflow"]
    )
    assert not (tmp_path / "w").exists() and not (tmp_path / "t").exists()
    assert (
        run(SMALL + ["--steps", "1", "--out", str(tmp_path / "none")]) == 0
    )  # the default imports neither


def scalar_leaves(x) -> int:
    """Numbers (booleans included) in a metrics.jsonl line, counted independently of stratagem.scalars."""
    if isinstance(x, dict):
        return sum(scalar_leaves(v) for v in x.values())
    if isinstance(x, list):
        return sum(scalar_leaves(v) for v in x)
    return isinstance(x, (bool, int, float))


def check_logged(m: dict, logged: dict[str, float]) -> None:
    """`logged`: the tags stored for step m['step'] by TensorBoard or W&B."""
    assert len(logged) == scalar_leaves(m) - 1  # every number of the line but the step itself
    assert (
        logged["judge/judged"] == m["judge_judged"]
        and logged["judge/requests"] == m["judge_requests"]
    )
    assert (
        logged["judge/modulated"] == float(m["modulated"])
        and logged["game/transitions"] == m["transitions"]
    )
    assert logged["update/loss"] == pytest.approx(m["loss"], rel=1e-6)
    assert logged["adv/a_mod_std"] == pytest.approx(m["a_mod_std"], rel=1e-6)
    assert logged["time/time_split_s/generate"] == pytest.approx(
        m["time_split_s"]["generate"], rel=1e-6
    )
    for game, seats in m["games"].items():
        assert logged[f"game/games/{game}/player1/loss"] == seats["player1"]["loss"]
    for key, b in m["baselines"].items():
        assert logged[f"adv/baselines/{key}"] == pytest.approx(b, rel=1e-6, abs=1e-7)


def test_report_to_tensorboard_logs_every_scalar_at_its_step(tmp_path, judge_server, secret_key):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "2",
                "--out",
                str(out),
                "--report-to",
                "tensorboard",
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
                "--judge-sample-rate",
                "0.5",
            ]
        )
        == 0
    )
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {
        tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]
    }
    metrics = read_jsonl(out / "metrics.jsonl")
    assert len(metrics) == 2 and all(set(steps) <= {1, 2} for steps in logged.values())
    for m in metrics:  # a spot of the coverage guard is logged at the steps that met it
        check_logged(m, {tag: at[m["step"]] for tag, at in logged.items() if m["step"] in at})
    assert not files_contain(out / "tensorboard", secret_key)


def test_report_to_tensorboard_resume_after_a_crash_keeps_one_value_per_step(tmp_path):
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--out", str(out), "--report-to", "tensorboard"]) == 0
    shutil.copytree(out / "checkpoints", tmp_path / "ckpt-1")
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    shutil.rmtree(
        out / "checkpoints"
    )  # as if it crashed after logging step 2, before its checkpoint
    shutil.copytree(tmp_path / "ckpt-1", out / "checkpoints")
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    metrics = read_jsonl(out / "metrics.jsonl")
    for tag in (
        "time/time_s",
        "update/loss",
    ):  # time_s differs between the two step-2 runs; the last one stays
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [
            (m["step"], pytest.approx(m[tag.split("/")[1]], rel=1e-6)) for m in metrics
        ]


def wandb_records(path: Path):
    """The records of a W&B offline run file: LevelDB's log format (32 KiB blocks of 7-byte-headed chunks)
    after a 7-byte W&B header, each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_report_to_wandb_offline_gets_config_and_every_scalar(
    tmp_path, judge_server, secret_key, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + [
                "--steps",
                "2",
                "--out",
                str(out),
                "--report-to",
                "wandb",
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
                "--judge-sample-rate",
                "0.5",
            ]
        )
        == 0
    )
    import wandb

    wandb.teardown()  # finish() may return before W&B's service has written the file out; this waits
    [path] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert path.name == f"run-{(out / 'wandb_run_id').read_text()}.wandb"
    records = list(wandb_records(path))
    [start] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in start.config.update}
    assert {k: config[k] for k in ("beta", "report_to", "out", "judge_base_url")} == {
        "beta": 0.2,
        "report_to": "wandb",
        "out": str(out),
        "judge_base_url": judge_server.url,
    }
    history = {
        r.history.step.num: {
            tag: json.loads(i.value_json)
            for i in r.history.item
            if not (tag := i.key or "/".join(i.nested_key)).startswith("_")
        }  # not W&B's _step etc.
        for r in records
        if r.WhichOneof("record_type") == "history"
    }
    metrics = read_jsonl(out / "metrics.jsonl")
    assert sorted(history) == [1, 2]
    for m in metrics:
        check_logged(m, history[m["step"]])
    assert not files_contain(out / "wandb", secret_key)


def test_report_to_wandb_that_cannot_start_is_one_line_and_leaves_no_folder(
    tmp_path, capsys, monkeypatch
):
    import wandb

    wandb.teardown()  # W&B keeps its settings per process: forget the offline run of an earlier test
    for name in ("WANDB_API_KEY", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no saved W&B login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home"))
    err = error_of(
        capsys, SMALL + ["--steps", "1", "--out", str(tmp_path / "run"), "--report-to", "wandb"]
    )
    assert "--report-to wandb: No API key configured" in err and "WANDB_MODE=offline" in err
    assert not (tmp_path / "run").exists()


def test_results_text_counts_self_play_from_the_first_seat_each_opponent_from_the_learner_and_invalid_losses():
    cell = lambda w, d, l_, bad: {"win": w, "draw": d, "loss": l_, "invalid": bad}  # noqa: E731
    m = {
        "games": {
            "KuhnPoker-v1": {"player0": cell(2, 0, 1, 1), "player1": cell(1, 0, 2, 0)},
            "TicTacToe-v0": {"player0": cell(0, 1, 1, 0), "player1": cell(1, 1, 0, 1)},
        },
        "opponents": {"random": {"KuhnPoker-v1": cell(3, 0, 1, 1)}, "past": {}},
    }
    assert watch.results_text(m) == (
        "won-drawn-lost 2-1-2 by the first seat, 3-0-1 vs random; 3 lost on an invalid move"
    )
    assert watch.results_text({"games": {}, "opponents": {}}) == "0 lost on an invalid move"
