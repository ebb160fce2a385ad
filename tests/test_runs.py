"""Tests of run folders (machinery/runfiles.py, lifecycle.py): a new run and a resumed one, the files after a
crash, a full disk, stop signals, and the lock that gives a run folder one job at a time."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stratagem as S
from machinery import runfiles
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    DISTILL,
    HERE,
    SMALL,
    JudgeServer,
    RawJudgeServer,
    assert_resumed_exactly,
    by_game,
    check_run,
    endless_body,
    error_of,
    no_process_left_behind,
    one_step_run_fixture,
    only_the_vllm_tests,
    read_jsonl,
    run,
    spawn,
    spawn_quiet,
    wait_for,
)


# ---- Run folders: a new run, a resumed one, what resume refuses
def test_start_run_refuses_an_existing_out_and_leaves_it_untouched(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("precious\n")
    err = error_of(capsys, ["--tiny", "--out", str(out)])
    assert "already exists" in err and (out / "metrics.jsonl").read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_resolve_args_on_resume_refuses_a_flag_that_changes_the_algorithm(capsys, tmp_path):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    assert "--beta" in error_of(capsys, ["--resume", "--out", str(out), "--beta", "0.5"])


def test_write_config_on_resume_with_changed_flags_keeps_a_history_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert (
        run(
            [
                "--resume",
                "--out",
                str(out),
                "--steps",
                "2",
                "--judge-timeout",
                "30",
                "--save-every",
                "50",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert (
        "config changed on resume (kept in config_history.jsonl): --steps 1 -> 2, --judge-timeout 60.0 -> 30.0\n"
        in said
    )
    assert read_jsonl(out / "config_history.jsonl") == [
        {"step": 1, "changed": {"steps": [1, 2], "judge_timeout": [60.0, 30.0]}}
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 2 and config["judge_timeout"] == 30.0
    assert run(["--resume", "--out", str(out), "--steps", "3", "--judge-timeout", "30"]) == 0
    assert read_jsonl(out / "config_history.jsonl")[1] == {"step": 2, "changed": {"steps": [2, 3]}}


def test_read_config_of_a_run_whose_config_predates_a_flag_resumes_with_its_default(
    one_step_run, tmp_path, capsys
):
    """A run saved before a flag existed resumes with the flag's default, and that is no change to record."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    config = json.loads((out / "config.json").read_text())
    for later in ("distill_lr", "rejected_rewards", "kl_coef"):
        del config[later]
    (out / "config.json").write_text(json.dumps(config))
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    assert read_jsonl(out / "config_history.jsonl") == [{"step": 1, "changed": {"steps": [1, 2]}}]
    assert json.loads((out / "config.json").read_text())["distill_lr"] == S.Args().distill_lr


def test_resume_checkpoint_refuses_fewer_steps_and_a_finished_run_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "2", "--save-every", "1", "--out", str(out)]) == 0

    def snapshot():
        return sorted(
            (p, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
            for p in out.rglob("*")
        )

    before = snapshot()
    capsys.readouterr()
    assert "has already done 2 steps; --steps 1 cannot undo them" in error_of(
        capsys, ["--resume", "--out", str(out), "--steps", "1"]
    )
    assert run(["--resume", "--out", str(out)]) == 0
    assert "is already finished (2 of 2 steps); nothing to do" in capsys.readouterr().out
    assert snapshot() == before
    assert json.loads((out / "config.json").read_text())["steps"] == 2


def test_start_run_resumes_a_run_without_a_checkpoint_from_step_0_with_the_saved_config(
    tmp_path, capsys
):
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert run(SMALL + ["--steps", "2", "--beta", "0.3", "--out", str(whole)]) == 0
    assert run(SMALL + ["--steps", "2", "--beta", "0.3", "--out", str(out)]) == 0
    import shutil

    shutil.rmtree(
        out / "checkpoints"
    )  # as if stopped (--save-every 50) after logging step 2, before any save
    assert run(["--resume", "--out", str(out)]) == 0
    assert "no checkpoint yet, so it starts again from step 0" in capsys.readouterr().out
    check_run(out, 2, beta=0.3)
    assert read_jsonl(out / "trajectories.jsonl") == read_jsonl(whole / "trajectories.jsonl")
    assert json.loads((out / "config.json").read_text())["beta"] == 0.3


def test_resume_of_a_tiny_heuristic_run_is_exact_and_its_checkpoint_a_plain_hf_model(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    evaluation = [
        "--eval-every",
        "3",
        "--eval-games",
        "TicTacToe-v0",
        "--eval-n",
        "2",
    ]  # must not disturb training; step 3's carries the judged means of steps 1-3, two replayed
    assert run(SMALL + evaluation + ["--steps", "3", "--out", str(whole)]) == 0
    check_run(whole, 3, beta=0.2)
    assert run(SMALL + evaluation + ["--steps", "2", "--save-every", "1", "--out", str(part)]) == 0
    assert run(["--resume", "--out", str(part), "--steps", "3"]) == 0
    check_run(part, 3, beta=0.2)
    assert_resumed_exactly(whole, part, 3)
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step-000003"]
    from transformers import AutoModelForCausalLM, AutoTokenizer  # a checkpoint is a plain HF model

    model = AutoModelForCausalLM.from_pretrained(whole / "checkpoints/step-000003")
    tok = AutoTokenizer.from_pretrained(whole / "checkpoints/step-000003")
    ids = tok("Observation: [4]", return_tensors="pt").input_ids
    assert (
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id).shape[
            1
        ]
        > ids.shape[1]
    )


# ---- The files after a crash: torn lines, lines logged after the checkpoint, damaged checkpoints
def test_truncate_jsonl_drops_the_lines_logged_after_the_checkpoint_on_resume(tmp_path):
    import shutil

    whole, out = tmp_path / "whole", tmp_path / "run"
    assert run(SMALL + ["--steps", "2", "--out", str(whole)]) == 0
    assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    shutil.copytree(out / "checkpoints", tmp_path / "ckpt-1")
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    shutil.rmtree(
        out / "checkpoints"
    )  # as if it crashed after logging step 2, before its checkpoint
    shutil.copytree(tmp_path / "ckpt-1", out / "checkpoints")
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert read_jsonl(out / "trajectories.jsonl") == read_jsonl(whole / "trajectories.jsonl")


def test_iter_jsonl_skips_torn_last_lines_and_resume_drops_them(tmp_path, capsys):
    whole, out = tmp_path / "whole", tmp_path / "run"
    assert run(SMALL + ["--steps", "2", "--out", str(whole)]) == 0
    assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    clean = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "trajectories.jsonl")}
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(
            b'{"step": 2, "time_s": 1.2, "gam'
        )  # a crash (or a full disk) in the middle of an append
    with open(out / "trajectories.jsonl", "ab") as f:
        f.write(
            b'{"step": 2, "game": "Kuhn\xff\xfe'
        )  # ... cut inside a multi-byte character: not UTF-8
    capsys.readouterr()
    assert run(["show", str(out), "--index", "0"]) == 0
    assert run(["plot", str(out), "--out", str(tmp_path / "plots")]) == 0
    assert run(["agree", str(out), "--judges", "heuristic", "heuristic", "--sample", "4"]) == 0
    err = capsys.readouterr().err
    assert (
        err.count("stratagem: warning: skipped 1 unreadable line(s) of") == 3
        and "Traceback" not in err
    )
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    err = capsys.readouterr().err
    assert err.count("stratagem: warning: skipped 1 unreadable line(s)") == 2
    for (
        name,
        before,
    ) in clean.items():  # the torn lines are gone, the rest is byte for byte the same
        assert (out / name).read_bytes().startswith(before)
    assert read_jsonl(out / "trajectories.jsonl") == read_jsonl(whole / "trajectories.jsonl")
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_truncate_jsonl_streams_a_large_log_in_flat_memory(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    line = {
        "step": 0,
        "turns": [{"observation": "o" * 20_000, "response": "r" * 20_000, "action": "[4]"}],
    }
    with open(path, "w") as f:
        for step in range(1, 3001):  # 120 MB
            f.write(json.dumps({**line, "step": 1 + step // 20}) + "\n")
        f.write('{"step": 151, "turns": [{"obs')  # and a torn last line
    import tracemalloc

    tracemalloc.start()
    try:
        runfiles.truncate_jsonl(path, 100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5e6, (
        peak
    )  # a line at a time, not the file's 120 MB (read whole, it took twice that)
    assert [json.loads(raw)["step"] for raw in path.read_text().splitlines()] == [
        1 + s // 20 for s in range(1, 2000)
    ]
    assert not list(tmp_path.glob(".tmp-*"))


def _truncate(path: Path, n: int):
    path.write_bytes(path.read_bytes()[:n])


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda c: _truncate(c / "trainer_state.pt", 1000),
            "trainer_state.pt is damaged (RuntimeError",
        ),
        (lambda c: _truncate(c / "trainer_state.pt", 0), "trainer_state.pt is damaged (EOFError"),
        (lambda c: _truncate(c / "rank0.pt", 10), "rank0.pt is damaged"),
        (lambda c: _truncate(c / "model.safetensors", 1000), "cannot load model"),
        (lambda c: _truncate(c / "model.safetensors", 0), "cannot load model"),
        (lambda c: _truncate(c / "config.json", 0), "config.json is unreadable (JSONDecodeError)"),
        (lambda c: _truncate(c.parent.parent / "config.json", 50), "config.json is damaged"),
        (lambda c: _truncate(c.parent.parent / "config.json", 0), "config.json is damaged"),
        (lambda c: (c / "rank0.pt").unlink(), "is incomplete (missing rank0.pt)"),
        (
            lambda c: [p.unlink() for p in c.iterdir()],
            "is incomplete (missing config.json, model.safetensors, trainer_state.pt, rank0.pt)",
        ),
    ],
)
def test_check_checkpoint_ends_the_resume_of_damaged_run_files_in_one_line_touching_nothing(
    one_step_run, tmp_path, capsys, damage, message
):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    damage(out / "checkpoints" / "step-000001")
    before = sorted((p.relative_to(out), p.stat().st_size) for p in out.rglob("*"))
    assert message in error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert (
        sorted((p.relative_to(out), p.stat().st_size) for p in out.rglob("*")) == before
    )  # nothing touched


WRITE_ATOMIC = """
import resource, signal, sys
sys.path.insert(0, {here!r})
from pathlib import Path
from machinery import runfiles
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG) instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
try:
    runfiles.write_atomic(Path({path!r}), b"new" * 10_000)  # 30 kB: the write fails after 5000 bytes
except OSError as e:
    print(e.filename)
"""


def test_write_atomic_that_fails_midway_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "config.json"
    old = b'{"old": true}' * 300  # 3.9 kB
    path.write_bytes(old)
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_ATOMIC.format(here=str(HERE), path=str(path))],
        capture_output=True,
        text=True,
    )
    assert proc.stdout == f"{path}\n", proc.stderr  # the failure names the file
    assert path.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json"
    ]


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)]
)
def test_save_checkpoint_and_the_other_run_files_follow_the_umask(
    tmp_path, umask, file_mode, dir_mode
):
    old = os.umask(umask)
    try:
        assert run(SMALL + ["--steps", "1", "--out", str(tmp_path / "run")]) == 0
    finally:
        os.umask(old)
    modes = {
        str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777
        for p in (tmp_path / "run").rglob("*")
    }
    assert modes and all(
        m == (dir_mode if (tmp_path / p).is_dir() else file_mode) for p, m in modes.items()
    ), modes


# ---- A full disk
@pytest.fixture
def small_tmpfs(tmp_path):
    """A real, nearly full disk: a 1 MiB tmpfs (needs root; skipped where mounting is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_save_checkpoint_on_a_full_disk_is_one_line_and_leaves_no_temporary_folder(
    small_tmpfs, capsys
):
    out = small_tmpfs / "run"
    err = error_of(
        capsys, SMALL + ["--steps", "1", "--out", str(out)]
    )  # the logs fit, the 1.5 MB checkpoint not
    assert "cannot write checkpoint" in err and f"--resume --out {out}" in err
    assert list((out / "checkpoints").iterdir()) == []  # no .tmp-* left behind
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1]  # nothing logged is lost


def test_main_on_a_full_disk_while_logging_names_the_file(small_tmpfs, capsys):
    out = small_tmpfs / "run"
    filler = small_tmpfs / "filler"
    filler.write_bytes(
        b"\0" * (1024 * 1024 - 24 * 1024)
    )  # 24 KiB left: config.json fits, a step's logs do not
    err = error_of(capsys, SMALL + ["--steps", "1", "--out", str(out)])
    assert err == (
        f"stratagem: error: no space left on the device writing {out / 'trajectories.jsonl'}; make room, "
        f"then continue with --resume --out {out}\n"
    ), err


# ---- Stop signals: Ctrl-C, SIGTERM, SIGHUP, a stop in the middle of a save
HELD = "stratagem: stopping once this step is done and saved (again to stop at once, losing it)\n"


def test_resume_advice_after_ctrl_c_names_the_run_directory(tmp_path, capsys, monkeypatch):
    out, update, calls = tmp_path / "run", S.policy_update, []

    def interrupted_at_step_2(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return update(*a, **kw)

    monkeypatch.setattr(S, "policy_update", interrupted_at_step_2)
    assert run(SMALL + ["--steps", "3", "--save-every", "1", "--out", str(out)]) == 130
    assert capsys.readouterr().err == (
        f"stratagem: stopped by Ctrl-C (continue from step-000001 with: python stratagem.py --resume --out {out})\n"
    )


def test_resume_advice_of_a_stopped_run_is_a_command_that_works_as_printed(tmp_path):
    for mode, script in (("stratagem", "stratagem.py"), ("spyrl", "spyrl.py")):
        run_dir = tmp_path / f"my {mode} run"
        (run_dir / "checkpoints" / "step-000002").mkdir(parents=True)
        (run_dir / "config.json").write_text(json.dumps({"mode": mode}))
        assert runfiles.resume_advice(run_dir) == (
            f" (continue from step-000002 with: python {script} --resume --out {shlex.quote(str(run_dir))})"
        )
    url = "http://127.0.0.1:9/v1?a b"  # a resume sends the key only where its command line says
    (run_dir := tmp_path / "judged").mkdir()
    (run_dir / "config.json").write_text(json.dumps({"mode": "stratagem", "judge_base_url": url}))
    assert runfiles.resume_advice(run_dir) == (
        f" (no checkpoint yet: python stratagem.py --resume --out {run_dir} --judge-base-url "
        f"'{url}' starts it again from step 0)"
    )


def test_stop_handler_stops_a_run_on_sigterm_like_ctrl_c_and_it_resumes(tmp_path):
    import signal

    out = tmp_path / "run"
    proc = spawn(SMALL + ["--steps", "500", "--save-every", "1", "--out", str(out)], tmp_path)
    for line in proc.stdout:  # a real signal, sent in the middle of training
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert not list((out / "checkpoints").glob(".tmp-*"))
    done = int(sorted((out / "checkpoints").glob("step-*"))[-1].name[5:])
    assert err.removeprefix(HELD) == (
        f"stratagem: stopped by SIGTERM (continue from step-{done:06d} with: "
        f"python stratagem.py --resume --out {out})\n"
    )
    assert run(["--resume", "--out", str(out), "--steps", str(done + 1)]) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(range(1, done + 2))


@pytest.mark.slow
def test_stop_handler_stops_a_run_on_sighup_like_sigterm_and_it_resumes(tmp_path):
    import signal

    out = tmp_path / "run"
    proc = spawn(SMALL + ["--steps", "500", "--save-every", "1", "--out", str(out)], tmp_path)
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 129, err
    done = int(sorted((out / "checkpoints").glob("step-*"))[-1].name[5:])
    assert err.removeprefix(HELD) == (
        f"stratagem: stopped by SIGHUP (continue from step-{done:06d} with: python stratagem.py --resume --out {out})\n"
    )
    assert run(["--resume", "--out", str(out), "--steps", str(done + 1)]) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(range(1, done + 2))


@pytest.mark.slow
def test_stop_handler_ends_in_one_line_after_ctrl_c_again_and_again_and_the_run_resumes(tmp_path):
    """An impatient user presses Ctrl-C again and again: a Ctrl-C that lands while the first is being handled
    (unwinding a save, releasing the run, saying how to resume) must not turn the stop into a traceback, nor
    leave the run unable to resume. One every 10 ms until the process is gone reaches every moment of a stop."""
    import signal

    out = tmp_path / "run"
    proc = spawn(SMALL + ["--steps", "500", "--save-every", "1", "--out", str(out)], tmp_path)
    for line in proc.stdout:  # a step after the first checkpoint
        if line.startswith("step 2/"):
            break
    while proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.01)
    err = proc.stderr.read().removeprefix(HELD)  # the first Ctrl-C may land after an update
    # 130, or killed by a Ctrl-C in the last moments of the interpreter's exit, when Python has given SIGINT back
    # to the system (a shell reports both as 130): the run was released and its line said before
    assert proc.returncode in (130, -signal.SIGINT) and err.count("\n") == 1, err
    assert err.startswith("stratagem: stopped by Ctrl-C (continue from step-"), err
    done = int(sorted((out / "checkpoints").glob("step-*"))[-1].name[5:])
    assert run(["--resume", "--out", str(out), "--steps", str(done + 1)]) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(range(1, done + 2))


@pytest.mark.slow
def test_stop_handler_ends_a_run_at_once_on_sigterm_while_the_judge_never_finishes_its_reply(
    tmp_path,
):
    import signal

    server = RawJudgeServer(endless_body)
    out = tmp_path / "run"
    proc = spawn_quiet(
        SMALL
        + [
            "--steps",
            "3",
            "--out",
            str(out),
            "--judge",
            "openai",
            "--judge-base-url",
            server.url,
            "--judge-sample-rate",
            "1",
            "--judge-timeout",
            "300",
            "--judge-retries",
            "0",
        ],
        tmp_path,
    )
    try:
        assert server.posted.wait(120), "the run never asked the judge"
        time.sleep(0.5)  # every request of the step is in flight
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        server.close()
    # Waiting for the requests in flight would take the judge's timeout, 300 s; stopping at once takes the
    # interpreter's exit (1.8 s here when idle, several times that on a busy machine). A tenth of the timeout
    # tells them apart whatever the load; the single line says the main thread stopped the run (stop_within()
    # would have had to end it otherwise, with a line of its own).
    assert proc.returncode == 143 and took < 300 / 10, (took, err[-2000:])
    assert err == (
        f"stratagem: stopped by SIGTERM (no checkpoint yet: python stratagem.py --resume --out {out} "
        f"--judge-base-url {server.url} starts it again from step 0)\n"
    )


SLOW_SAVE = """
import sys, time
sys.path.insert(0, {here!r})
import torch
import stratagem

real_save = torch.save


def save(obj, f, *args, **kwargs):  # trainer_state.pt of step 2 (the --distill heads and holdout): held here
    if str(f).endswith("/.tmp-step-000002/trainer_state.pt"):
        open({marker!r}, "w").close()
        time.sleep(600)
    return real_save(obj, f, *args, **kwargs)


torch.save = save
sys.exit(stratagem.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
@pytest.mark.slow
def test_save_checkpoint_stopped_midway_then_resume_is_the_uninterrupted_run(tmp_path, stop):
    """kill -9 or SIGTERM while a checkpoint's trainer_state.pt (optimizer, baselines, the --distill heads and
    holdout) is being written: the previous checkpoint stands, and --resume replays the uninterrupted run exactly."""
    import signal

    server = JudgeServer(by_game)
    flags = DISTILL + ["--judge-base-url", server.url, "--save-every", "1", "--steps", "3"]
    whole, part, marker = tmp_path / "whole", tmp_path / "part", tmp_path / "saving"
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE.format(here=str(HERE), marker=str(marker)))
    try:
        assert run(flags + ["--out", str(whole)]) == 0
        proc = subprocess.Popen(
            [sys.executable, str(script), *flags, "--out", str(part)],
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            wait_for(lambda: marker.exists() or proc.poll() is not None, 600)
            assert marker.exists(), proc.communicate()[1][-3000:]
            proc.send_signal(getattr(signal, stop))
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.wait()
        if stop == "SIGTERM":
            assert proc.returncode == 143 and err == (
                f"stratagem: stopped by SIGTERM (continue from step-000001 with: python stratagem.py --resume "
                f"--out {part} --judge-base-url {server.url})\n"
            ), err
        else:
            assert proc.returncode == -9
        left = (
            [".tmp-step-000002"] if stop == "SIGKILL" else []
        )  # a kill -9 leaves the half-written one
        assert sorted(p.name for p in (part / "checkpoints").iterdir()) == [*left, "step-000001"]
        assert (
            run(["--resume", "--out", str(part), "--steps", "3", "--judge-base-url", server.url])
            == 0
        )
    finally:
        server.close()
    paid = ("judge_requests", "judge_cache_hits", "judge_prompt_tokens", "judge_completion_tokens")
    a, b = read_jsonl(whole / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert (
        b[1]["judge_cache_hits"] == a[1]["judge_requests"] > 0 == b[1]["judge_requests"]
    )  # step 2 was paid once
    for m in a + b:
        for k in paid:
            del m[k]
    (whole / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in a))
    (part / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in b))
    assert_resumed_exactly(whole, part, 3)
    a, b = (
        runfiles.load_state(r / "checkpoints/step-000003/trainer_state.pt", runfiles.TRAINER_STATE)[
            "distill"
        ]
        for r in (whole, part)
    )
    assert (
        all(torch.equal(a["heads"][k], b["heads"][k]) for k in a["heads"])
        and a["pairs"] == b["pairs"]
    )
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step-000003"]


# ---- One job per run folder: the lock
def test_claim_run_creates_a_new_lock_exclusively_and_release_runs_empties_it(tmp_path):
    out = tmp_path / "run"
    runfiles.claim_run(out, fresh=True)
    assert (out / "run.lock").read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    (out / "config.json").write_text("{}")  # a run that started: its folder stays
    runfiles.release_runs()
    assert (out / "run.lock").read_text() == "" and not (out / "run.lock").is_symlink()


@pytest.mark.slow
def test_claim_run_of_two_runs_on_one_out_at_once_one_wins_the_other_says_so_in_one_line(tmp_path):
    out = tmp_path / "run"
    procs = [spawn_quiet(SMALL + ["--steps", "1", "--out", str(out)], tmp_path) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [r[1][-2000:] for r in results]
    [(_, err)] = [r for p, r in zip(procs, results) if p.returncode == 2]
    assert err.count("\n") == 1 and err.startswith(f"stratagem: error: {out} already exists"), err
    assert "Traceback" not in err and "space" not in err and "room" not in err
    check_run(out, 1, beta=0.2)  # the winner's run, whole


@pytest.mark.slow
def test_check_not_in_use_refuses_a_second_job_naming_the_holder_and_a_dead_holder_blocks_nothing(
    tmp_path,
):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--save-every", "1", "--out", str(out)]) == 0
    first = spawn_quiet(
        ["--resume", "--out", str(out), "--steps", "500", "--save-every", "1"], tmp_path
    )
    try:
        for line in first.stdout:
            if line.startswith("step 3/"):
                break
        second = spawn_quiet(["--resume", "--out", str(out), "--steps", "500"], tmp_path)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2 and err == (
            f"stratagem: error: {out} is in use by pid {first.pid} on host {socket.gethostname()}, which holds "
            f"{out / 'run.lock'}; one run folder takes one job at a time: stop that job, or --resume once it has "
            "ended\n"
        )
        for line in first.stdout:  # the first job goes on, untouched
            if line.startswith("step 5/"):
                break
    finally:
        first.kill()  # SIGKILL: its lock is left behind, stale
        first.communicate()
    assert (out / "run.lock").read_text() == f"pid {first.pid} on host {socket.gethostname()}\n"
    done = int(sorted((out / "checkpoints").glob("step-*"))[-1].name[5:])
    assert run(["--resume", "--out", str(out), "--steps", str(done + 1)]) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(
        range(1, done + 2)
    )  # one line a step
    assert (out / "run.lock").read_text() == ""  # released at the end


def test_keep_step_saves_the_last_finished_step_when_ctrl_c_lands_before_the_update(
    tmp_path, capsys, monkeypatch
):
    """--save-every 50: Ctrl-C during step 4's self-play keeps steps 1-3, and --resume continues at
    step 4 exactly as the run that was never stopped."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run(SMALL + ["--steps", "5", "--out", str(whole)]) == 0
    play, calls = S.self_play, []

    def stopped_at_step_4(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return play(*a, **kw)

    monkeypatch.setattr(S, "self_play", stopped_at_step_4)
    capsys.readouterr()
    assert run(SMALL + ["--steps", "5", "--save-every", "50", "--out", str(part)]) == 130
    assert capsys.readouterr().err == (
        f"stratagem: stopped by Ctrl-C (continue from step-000003 with: python stratagem.py "
        f"--resume --out {part})\n"
    )
    monkeypatch.setattr(S, "self_play", play)
    assert run(["--resume", "--out", str(part)]) == 0
    assert_resumed_exactly(whole, part, 5)


def test_held_stop_after_the_update_ends_the_step_saves_it_and_a_resume_is_exact(
    tmp_path, capfd, monkeypatch
):
    """A real SIGINT after step 4's update (its evaluation): the step ends, is saved and logged, and
    the run stops; --resume continues at step 5."""
    import signal

    whole, part = tmp_path / "whole", tmp_path / "part"
    flags = SMALL + ["--eval-every", "1", "--eval-games", "TicTacToe-v0", "--eval-n", "2"]
    assert run(flags + ["--steps", "6", "--out", str(whole)]) == 0
    evaluate = S.periodic_eval

    def signalled_at_step_4(run_, step, timer):
        if step == 4 and run_.out == part:
            os.kill(os.getpid(), signal.SIGINT)  # held: the weights changed, the step is not saved
        return evaluate(run_, step, timer)

    monkeypatch.setattr(S, "periodic_eval", signalled_at_step_4)
    capfd.readouterr()
    assert run(flags + ["--steps", "6", "--save-every", "50", "--out", str(part)]) == 130
    out, err = capfd.readouterr()
    assert "step 4/6 |" in out and "step 5/6" not in out
    err = "".join(x for x in err.splitlines(True) if not x.startswith("stratagem: warning: "))
    assert err == (
        HELD + f"stratagem: stopped by Ctrl-C (continue from step-000004 with: python stratagem.py "
        f"--resume --out {part})\n"
    )
    assert run(["--resume", "--out", str(part)]) == 0
    assert_resumed_exactly(whole, part, 6)
