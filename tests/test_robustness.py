"""Tests of hostile and mistaken inputs: bad command lines, every number flag's bounds, numbers too long for
int() from a policy or a judge, and links planted in a run folder."""

from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import sys
import threading

import pytest
import torch

import stratagem as S
from machinery import distributed, runfiles, watch
from machinery import judge as J
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    HUGE,
    SMALL,
    JudgeServer,
    ScriptedPolicy,
    _completion_with,
    error_of,
    fast_first,
    fresh,
    judge_server_fixture,
    no_process_left_behind,
    not_for_the_vllm_tests,
    one_step_run_fixture,
    only_role1,
    only_the_vllm_tests,
    run,
    run_with_player1_failing,
    secret_key_fixture,
    self_play,
    talkers_fixture,
    tiny_fixture,
    tree_of,
)


# ---- Bad command lines: one line, exit 2, before any work
def test_main_error_is_one_line_without_traceback_in_a_fresh_interpreter(tmp_path):
    """The real command line, in a fresh interpreter."""
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "stratagem.py"),
            "--tiny",
            "--games",
            "NoSuchGame-v0",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "stratagem: error: unknown game id 'NoSuchGame-v0' "
        "(SPIRAL's look like KuhnPoker-v1, textarena 0.7.4's like TicTacToe-v0)"
    ]


BAD_COMMAND_LINES = [  # (argv with {file}, {dir}, {run}, {port} filled in, part of the one-line message)
    (SMALL + ["--out", "{file}/run"], "is a file, not a folder"),
    (SMALL + ["--out", "/sys/stratagem-run"], "cannot write in /sys"),
    (
        SMALL + ["--out", "{new}", "--judge-cache", "{dir}"],
        "--judge-cache {dir} is a folder, not a file",
    ),
    (
        SMALL + ["--out", "{new}", "--judge-cache", "{file}/cache.jsonl"],
        "{file} is a file, not a folder",
    ),
    (
        SMALL + ["--out", "{new}", "--device", "nonsense"],
        "--device 'nonsense' is not a torch device",
    ),
    (SMALL + ["--out", "{new}", "--device", "cuda:7"], "--device cuda:7: "),
    (["eval", "{run}", "--json", "{file}/eval.json"], "{file} is a file, not a folder"),
    (["eval", "{run}", "--json", "{new}/eval.json"], "does not exist"),
    (
        ["eval", "{run}", "--temperature", "nan", "--json", "{new}.json"],
        "--temperature must be 0 (greedy) or in [0.001, 100], got nan",
    ),
    (["eval", "{run}", "--device", "warp-drive", "--json", "{new}.json"], "is not a torch device"),
    (
        ["agree", "{run}", "--judges", "heuristic", "heuristic", "--json", "{file}/a.json"],
        "is a file, not a folder",
    ),
    (
        ["agree", "{run}", "--judges", "heuristic", "heuristic", "--judge-timeout", "nan"],
        "--judge-timeout must be > 0",
    ),
    (
        ["agree", "{run}", "--judges", "heuristic", "heuristic", "--judge-temperature", "-1"],
        "--judge-temperature must be",
    ),
    (
        ["agree", "{run}", "--judges", "heuristic", "heuristic", "--judge-concurrency", "0"],
        "--judge-concurrency must be",
    ),
    (
        ["agree", "{run}", "--judges", "heuristic", "distilled:{run}"],
        "distilled:{run}: {run} was trained without --distill",
    ),
    (
        ["agree", "{run}", "--judges", "heuristic", "distilled:{dir}"],
        "distilled:{dir}: {dir} is not a run with a checkpoint",
    ),
    (["serve-judge", "--port", "70000"], "--port must be in [0, 65535]"),
    (["serve-judge", "--port", "-1"], "--port must be in [0, 65535]"),
    (["serve-judge", "--delay", "inf"], "--delay >= 0"),
    (["bench"] + SMALL + ["--json", "{file}/bench.jsonl"], "is a file, not a folder"),
    (["bench"] + SMALL + ["--judgements", "-1"], "--judgements must be >= 0"),
    (["plot", "{run}", "--out", "{file}/plots"], "is a file, not a folder"),
    (["random-model", "{file}/model"], "is a file, not a folder"),
]


@pytest.mark.parametrize(
    "argv, message", BAD_COMMAND_LINES, ids=[" ".join(a[-2:]) for a, _ in BAD_COMMAND_LINES]
)
def test_main_fails_bad_command_lines_in_one_line_before_any_work(
    one_step_run, tmp_path, capsys, monkeypatch, argv, message
):
    if torch.cuda.device_count() > 7 and "cuda:7" in argv:
        pytest.skip("this machine has a GPU 7")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a file, not a folder")
    (tmp_path / "dir").mkdir()
    names = {
        "file": str(tmp_path / "file"),
        "dir": str(tmp_path / "dir"),
        "run": str(one_step_run),
        "new": str(tmp_path / "new"),
    }
    before = (
        sorted(p for p in tmp_path.rglob("*")),
        sorted((p, p.stat().st_mtime_ns) for p in one_step_run.rglob("*")),
    )
    err = error_of(capsys, [a.format(**names) for a in argv])
    assert message.format(**names) in err
    assert (
        sorted(p for p in tmp_path.rglob("*")),
        sorted((p, p.stat().st_mtime_ns) for p in one_step_run.rglob("*")),
    ) == before


# ---- Bounds: every number flag has a sane range
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temperature", "1e-320"], "--temperature must be in [0.001, 100], got 1e-320"),
        (["--temperature", "1e9"], "--temperature must be in [0.001, 100], got 1000000000.0"),
        (["--judge-timeout", "1e308"], "--judge-timeout must be <= 86400 (one day), got 1e+308"),
        (["--dist-timeout", "1e308"], "--dist-timeout must be <= 86400 (one day), got 1e+308"),
        (
            ["--max-new-tokens", "10000000"],
            "--max-new-tokens must be < 16384, the model's context, got 10000000",
        ),
        (["--num-envs", "100000000"], "--num-envs must be <= 65536, got 100000000"),
        (["--judge-samples", "100000"], "--judge-samples must be <= 100, got 100000"),
        (["--judge-retries", "1000000"], "--judge-retries must be <= 100, got 1000000"),
        (["--judge-concurrency", "1000000"], "--judge-concurrency must be <= 4096, got 1000000"),
        (
            ["--judge-max-tokens", "1000000000"],
            "--judge-max-tokens must be <= 1048576, got 1000000000",
        ),
        (["--lr", "1e308"], "--lr must be in (0, 1], got 1e+308"),
        (["--beta", "1e308"], "--beta must be <= 1000, got 1e+308"),
        (["--kl-coef", "1e308"], "--kl-coef must be <= 1000, got 1e+308"),
        (
            ["--invalid-rewards=1e308,0"],
            "--invalid-rewards must be two numbers in [-1000, 1000], got '1e308,0'",
        ),
        (["--judge-temperature", "1e308"], "--judge-temperature must be <= 100, got 1e+308"),
        (["--batch-size", "1000000000000"], "--batch-size must be <= 10000000, got 1000000000000"),
        (["--max-turns", "1000000000000"], "--max-turns must be <= 1000000, got 1000000000000"),
    ],
)
def test_validate_gives_every_number_flag_a_sane_range_refused_in_one_line(
    capsys, tmp_path, argv, message
):
    assert message in error_of(
        capsys, ["--tiny", "--steps", "1", *argv, "--out", str(tmp_path / "never")]
    )
    assert not (tmp_path / "never").exists()


def test_context_length_bounds_max_new_tokens_before_anything_is_loaded(tiny, tmp_path, capsys):
    """A model folder's config.json says its context (the tiny one: 16384 positions)."""
    argv = [
        "--model",
        str(tiny),
        "--judge",
        "heuristic",
        "--steps",
        "1",
        "--max-new-tokens",
        "16384",
    ]
    err = error_of(capsys, argv + ["--out", str(tmp_path / "never")])
    assert "--max-new-tokens must be < 16384, the model's context, got 16384" in err
    assert not (tmp_path / "never").exists()


def test_eval_refuses_a_temperature_too_small_to_sample_at(tiny, tmp_path, capsys):
    argv = ["eval", str(tiny), "--games", "TicTacToe-v0", "--n", "1", "--temperature", "1e-320"]
    err = error_of(capsys, argv + ["--json", str(tmp_path / "e.json")])
    assert "--temperature" in err and not (tmp_path / "e.json").exists()


# ---- Numbers a policy or a judge writes: too long for int(), a game that raises
@pytest.mark.parametrize(
    "game, action",
    [
        ("TicTacToe-v0", f"[{HUGE}]"),
        ("ConnectFour-v0", f"[col {HUGE}]"),
        ("LiarsDice-v1", f"[Bid: {HUGE}, 3]"),
        ("LiarsDice-v1", f"[Bid: 3, {HUGE}]"),
        ("SimpleNegotiation-v1", f"[Offer: {HUGE} Wood -> 1 Gold]"),
        ("SimpleNegotiation-v1", f"[Offer: 1 Wood -> {HUGE} Gold]"),
        ("Nim-v0", f"[{HUGE} {HUGE}]"),
    ],
)
@pytest.mark.parametrize("rule", ["lenient", "spiral"])
def test_play_move_takes_a_number_too_long_for_int_as_an_invalid_move_never_a_crash(
    tiny, game, action, rule
):
    _, tok = fresh(tiny)
    args = S.Args(tiny=True, batch_size=2, num_envs=2, action_rule=rule)
    trajs, counts, _ = self_play(
        ScriptedPolicy(lambda p: f"\\boxed{{{action}}}"),
        tok,
        args,
        [game],
        random.Random(0),
        watch.Timer(),
        {},
        2,
    )
    movers = [t for t in trajs if t.turns]
    assert movers and all(len(t.turns) == 1 and t.reward == -1.0 for t in movers)
    assert sum(c["invalid"] for c in counts[game].values()) == len(movers)


@pytest.mark.parametrize(
    "game, action",
    [
        ("LiarsDice-v1", f"[Bid: {HUGE}, 3]"),
        ("LiarsDice-v1", f"[Bid: 2, {HUGE}]"),
        ("SimpleNegotiation-v1", f"[Offer: {HUGE} Wood -> 1 Gold]"),
        ("SimpleNegotiation-v1", f"[Offer: 1 Wood -> {HUGE} Gold]"),
    ],
)
def test_make_env_games_take_an_oversized_number_as_an_invalid_move_for_any_textarena_agent(
    game, action
):
    env = S.make_env(game, 0, 0)
    done, _ = env.step(action)
    assert done and env.close()[1][0]["invalid_move"]


def test_play_move_takes_a_game_that_raises_as_an_invalid_move_and_warns_naming_the_exception(
    tiny, capsys, monkeypatch
):
    """The last line of defence: whatever a game's step() raises ends that game as an invalid move by the mover,
    with one warning naming the game and the exception; the other games and the run go on."""
    make_env = S.make_env

    def fragile(game_id, seed, error_allowance):
        env = make_env(game_id, seed, error_allowance)
        step = env.step

        def step_or_raise(action):
            if "4" in action:
                raise RuntimeError("the board caught fire")
            return step(action)

        env.step = step_or_raise
        return env

    monkeypatch.setattr(S, "make_env", fragile)
    _, tok = fresh(tiny)
    args = S.Args(tiny=True, batch_size=4, num_envs=2)
    cells = itertools.cycle(["\\boxed{4}", "\\boxed{0}"])
    trajs, counts, _ = self_play(
        ScriptedPolicy(lambda p: next(cells)),
        tok,
        args,
        ["TicTacToe-v0"],
        random.Random(0),
        watch.Timer(),
        {},
        4,
    )
    assert (
        counts["TicTacToe-v0"]["player0"]["invalid"]
        == counts["TicTacToe-v0"]["player0"]["loss"]
        >= 1
    )
    err = capsys.readouterr().err
    assert (
        "stratagem: warning: TicTacToe-v0 raised RuntimeError('the board caught fire') on Player 0's move '[4]'; "
        "it counts as an invalid move\n"
    ) in err


@pytest.mark.parametrize(
    "reply",
    [
        '{"alpha": "' + HUGE + '", "sigma": 1, "rho": 1}',
        '{"alpha": ' + HUGE + ', "sigma": 1, "rho": 1}',
        '{"alpha": 1e' + HUGE + ', "sigma": 1, "rho": 1}',
    ],
    ids=["string", "number", "exponent"],
)
def test_parse_scores_takes_an_oversized_number_in_a_verdict_as_a_failure_of_a_kind(reply):
    with pytest.raises(J.JudgeFailure) as e:
        J.parse_scores(reply, "transferability")
    assert e.value.kind in ("bad_value", "no_json")


@pytest.mark.parametrize(
    "name, behaviour",
    fast_first(
        [
            (
                "not JSON",
                only_role1(200, b"this is not json {", {"Content-Type": "application/json"}),
            ),
            (
                "HTML error page",
                only_role1(
                    200,
                    b"<html><body><h1>502 Bad Gateway</h1></body></html>",
                    {"Content-Type": "text/html"},
                ),
            ),
            (
                "JSON but a list",
                only_role1(200, b"[1, 2, 3]", {"Content-Type": "application/json"}),
            ),
            ("choices not a list", only_role1(200, _completion_with(choices={"0": "x"}))),
            (
                "content a list of parts",
                only_role1(
                    200,
                    _completion_with(
                        choices=[
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {
                                    "role": "assistant",
                                    "content": [{"type": "text", "text": '{"alpha": 1}'}],
                                },
                            }
                        ]
                    ),
                ),
            ),
            (
                "non-numeric usage",
                only_role1(
                    200,
                    _completion_with(usage={"prompt_tokens": "lots", "completion_tokens": None}),
                ),
            ),
        ]
    ),
)
def test_chat_reply_of_200_with_a_broken_body_is_a_counted_failure_never_a_crash(
    tmp_path, secret_key, name, behaviour, talkers
):
    run_with_player1_failing(tmp_path / "run", behaviour, "bad_response", name, talkers)


# ---- A run folder whoever can write in it cannot turn against the run: links and odd locks
PRECIOUS = "a file the run never made\n"


def test_out_on_a_dangling_link_or_on_a_file_says_what_it_is_and_touches_nothing(tmp_path, capsys):
    dangling, nowhere = tmp_path / "dangling", tmp_path / "nowhere"
    dangling.symlink_to(nowhere)
    err = error_of(capsys, SMALL + ["--steps", "1", "--out", str(dangling)])
    assert (
        err
        == f"stratagem: error: --out {dangling} is a symbolic link to {nowhere}, which does not exist\n"
    )
    assert not nowhere.exists() and dangling.is_symlink()
    file = tmp_path / "file"
    file.write_text(PRECIOUS)
    err = error_of(capsys, SMALL + ["--steps", "1", "--out", str(file)])
    assert err == f"stratagem: error: --out {file}: {file} is a file, not a folder\n"
    err = error_of(capsys, ["--resume", "--out", str(file)])
    assert err == f"stratagem: error: --resume: {file} is a file, not a run folder\n"
    err = error_of(capsys, ["--resume", "--out", str(dangling)])
    assert (
        err
        == f"stratagem: error: --resume: {dangling} is a symbolic link to {nowhere}, which does not exist\n"
    )
    assert file.read_text() == PRECIOUS and not nowhere.exists()


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory):
    """A finished 1-step run with a paid local judge (its cache and ledger), TensorBoard and a checkpoint."""
    not_for_the_vllm_tests()
    out = tmp_path_factory.mktemp("judged") / "run"
    server = JudgeServer()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OPENAI_API_KEY", "sk-test")
            flags = [
                "--judge",
                "openai",
                "--judge-base-url",
                server.url,
                "--report-to",
                "tensorboard",
            ]
            assert run(SMALL + flags + ["--steps", "1", "--out", str(out)]) == 0
    finally:
        server.close()
    return out


WRITTEN = [
    "run.lock",
    "metrics.jsonl",
    "trajectories.jsonl",
    "config.json",
    "config_history.jsonl",
    "judge_cache.jsonl",
    "judge_ledger.jsonl",
    ".tmp-config.json",
    ".tmp-metrics.jsonl",
    "checkpoints",
    "checkpoints/step-000001",
    "checkpoints/.tmp-step-000002",
    "tensorboard",
    "wandb_run_id",
]


@pytest.mark.parametrize("name", WRITTEN)
def test_check_no_links_refuses_a_link_planted_in_a_run_folder_in_one_line_never_following_it(
    judged_run, tmp_path, judge_server, secret_key, capsys, name
):
    """Whoever can write in a shared run folder must not make the trainer write, truncate or delete anything else:
    a link in place of any file or folder the trainer writes there ends a --resume in one line, before anything."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(judged_run, out, symlinks=True)
    place, victim = out / name, tmp_path / "victim"
    if place.is_dir():
        victim.mkdir()
        (victim / "keep.txt").write_text(PRECIOUS)
        shutil.rmtree(place)
    else:
        victim.write_text(PRECIOUS)
        place.unlink(missing_ok=True)
    place.symlink_to(victim)
    before = tree_of(out)
    err = error_of(
        capsys,
        ["--resume", "--out", str(out), "--steps", "2", "--judge-base-url", judge_server.url],
    )
    assert err.startswith(f"stratagem: error: {place} is a symbolic link (to {victim});"), err
    assert tree_of(out) == before and not judge_server.requests
    assert (victim / "keep.txt" if victim.is_dir() else victim).read_text() == PRECIOUS


def test_refuse_link_keeps_every_run_file_writer_from_writing_through_a_link(tmp_path):
    """A link planted while a run is going (after its start-up checks): every writer refuses it or replaces it,
    none writes through it."""
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl", "judge_ledger.jsonl"):
        (out / name).symlink_to(victim)
        with pytest.raises(S.UserError, match=f"^{re.escape(str(out / name))} is a symbolic link"):
            runfiles.append_jsonl(out / name, {"step": 1})
        with pytest.raises(S.UserError, match="is a symbolic link"):
            runfiles.end_torn_line(out / name)
    cache = runfiles.JudgeCache(tmp_path / "cache.jsonl")
    (tmp_path / "cache.jsonl").symlink_to(victim)
    with pytest.raises(S.UserError, match="is a symbolic link"):
        cache.put("k", "transferability", {"alpha": 1.0, "sigma": 1.0, "rho": 1.0})
    (out / ".tmp-config.json").symlink_to(victim)  # the temporary name of an atomic write
    runfiles.write_atomic(out / "config.json", b"{}")
    assert (out / "config.json").read_bytes() == b"{}" and not (out / ".tmp-config.json").exists()
    (out / "checkpoints").symlink_to(
        tmp_path, target_is_directory=True
    )  # its old checkpoints would be deleted
    with pytest.raises(S.UserError, match="is a symbolic link"):
        runfiles.save_checkpoint(out, 1, None, None, None, {}, {}, distributed.Dist())
    assert victim.read_text() == PRECIOUS and (tmp_path / "victim").exists()


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "hard link", "fifo"])
def test_claim_run_refuses_a_lock_that_is_not_the_runs_own_file_and_empties_nothing(tmp_path, kind):
    """run.lock is opened without following a link, created exclusively where it is new, and only a plain file
    with no other name is ever written or emptied."""
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    lock = out / "run.lock"
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":
        lock.symlink_to(tmp_path / "made-by-the-run")
    elif kind == "hard link":
        os.link(victim, lock)
    else:
        os.mkfifo(lock)
    for attempt in (
        lambda: runfiles.check_not_in_use(out),
        lambda: runfiles.claim_run(out, fresh=False),
    ):
        raised: list[BaseException] = []
        thread = threading.Thread(
            target=lambda into, fn: into.append(pytest.raises(S.UserError, fn).value),
            args=(raised, attempt),
        )
        thread.start()
        thread.join(60)
        if thread.is_alive():  # blocked opening a fifo: let it go, and fail
            os.close(os.open(lock, os.O_WRONLY | os.O_NONBLOCK))
            thread.join()
            pytest.fail("opening the lock blocked")
        runfiles.release_runs()
        assert raised and re.match(
            f"{re.escape(str(lock))} is (a symbolic link|not a plain file)", str(raised[0])
        )
    assert victim.read_text() == PRECIOUS and not (tmp_path / "made-by-the-run").exists()
