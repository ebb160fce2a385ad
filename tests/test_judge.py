"""Tests of the judge (machinery/judge.py, judge_http.py, openai_api.py, costs.py): requests through the real
`openai` client to a real OpenAI-compatible server on 127.0.0.1, the rules decided in code, verdicts parsed, the
transport's bounds, the start-up checks, the cache and the money."""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import http.server
import itertools
import json
import math
import random
import threading
import time

import pytest

import judge_prompts
import stratagem as S
from machinery import UserError, runfiles
from machinery import judge as J
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    GOOD,
    SMALL,
    JudgeServer,
    RawJudgeServer,
    _completion_with,
    check_run,
    completion,
    endless_body,
    error_of,
    fast_first,
    files_contain,
    free_port,
    good_judge,
    http_reply,
    judge_args,
    judge_server_fixture,
    no_process_left_behind,
    one_step_run_fixture,
    only_role1,
    only_the_vllm_tests,
    read_jsonl,
    role1,
    rubric_of,
    run,
    run_with_player1_failing,
    secret_key_fixture,
    spawn_quiet,
    talkers_fixture,
    tiny_fixture,
    tree_of,
    wait_for,
)
from tools import serve_judge


# ---- Requests through the real openai client: rubrics asked, samples combined, retries, failures imputed
def test_aggregate_majority_and_mean():
    verdicts = [{"d": 1.0, "a": 0.0}, {"d": 1.0, "a": -1.0}, {"d": -1.0, "a": 1.0}]
    assert J.aggregate(verdicts, "majority") == {
        "d": 1.0,
        "a": -1.0,
    }  # a: a three-way tie goes to the lowest
    assert J.aggregate(verdicts, "mean") == {"d": pytest.approx(1 / 3), "a": 0.0}


def test_judge_samples_ask_n_times_and_combine(judge_server, secret_key):
    args = judge_args(judge_server.url, judge_samples=3)
    runner = J.JudgeRunner(
        J.OpenAIJudge("judge-test", judge_server.url, args), args, runfiles.JudgeCache(None)
    )
    traj = S.Trajectory("TicTacToe-v0", 0, [S.Turn("b", "r", "[4]", [], [])], 1.0)
    [j], usage = S.judge_trajectories(runner, [traj], ["transferability"])
    assert usage["requests"] == 3 and j.scores == {"alpha": 1.0, "sigma": 0.5, "rho": 0.0}


def test_JudgeRunner_counts_a_plus_one_verdict_from_a_real_server_as_judged(secret_key):
    """Through the real openai client: '+1' and '.5' verdicts must reach phi and psi, not fail as no_json."""

    def plus_judge(body):
        reply = {
            "transferability": '{"alpha": 1, "sigma": .5, "rho": 0}',
            "evolution": 'I weigh each turn.\n{"d": +1, "a": 0, "c": +1}',
        }[rubric_of(body)]
        return 200, completion(reply)

    server = JudgeServer(plus_judge)
    try:
        args = judge_args(server.url)
        runner = J.JudgeRunner(
            J.OpenAIJudge("judge-test", server.url, args), args, runfiles.JudgeCache(None)
        )
        traj = S.Trajectory(
            "TicTacToe-v0",
            0,
            [
                S.Turn("board", "I take [4]", "[4]", [], []),
                S.Turn("board 2", "Then the corner: [0]", "[0]", [], []),
            ],
            1.0,
        )
        [judgement], _ = S.judge_trajectories(runner, [traj], ["transferability", "evolution"])
    finally:
        server.close()
    assert judgement.failure is None
    assert judgement.scores == {
        "alpha": 1.0,
        "sigma": 0.5,
        "rho": 0.0,
        "d": 1.0,
        "a": 0.0,
        "c": 1.0,
    }


def test_judge_retries_a_429_after_its_retry_after(judge_server, secret_key):
    seen = []

    def flaky(body):
        seen.append(time.monotonic())
        if len(seen) == 1:
            return 429, {"error": {"message": "slow down"}}, {"Retry-After": "1"}
        return good_judge(body)

    judge_server.behaviour = flaky
    args = judge_args(judge_server.url, judge_retries=2)
    runner = J.JudgeRunner(
        J.OpenAIJudge("judge-test", judge_server.url, args), args, runfiles.JudgeCache(None)
    )
    [j], usage = S.judge_trajectories(
        runner, [S.Trajectory("G", 0, [S.Turn("o", "r", "[1]", [], [])], 0.0)], ["transferability"]
    )
    assert j.scores is not None and len(seen) == 2 and seen[1] - seen[0] >= 0.9  # waited as told


def test_train_imputes_failed_judgements_and_counts_them(tmp_path, secret_key, talkers):
    server = JudgeServer(
        lambda body: (
            (500, {"error": "boom"}) if rubric_of(body) == "evolution" else good_judge(body)
        )
    )
    try:
        out = tmp_path / "run"
        assert (
            run(
                SMALL
                + talkers
                + [
                    "--steps",
                    "1",
                    "--out",
                    str(out),
                    "--judge",
                    "openai",
                    "--judge-base-url",
                    server.url,
                    "--judge-retries",
                    "1",
                ]
            )
            == 0
        )
    finally:
        server.close()
    metrics, trajs = check_run(out, 1, beta=0.2)
    judged = sum(t["judged"] for t in trajs)
    assert (
        metrics[0]["judge_failures"] == {"server_error": judged}
        and metrics[0]["modulated"] is False
    )
    assert all(t["phi"] == 1.0 and t["psi"] == 0.0 for t in trajs)
    assert len(server.requests) == judged * 3  # transferability once, evolution twice (one retry)


def sleepy(seconds):
    def behaviour(body):
        if role1(body):
            time.sleep(seconds)
        return good_judge(body)

    return behaviour


MB_OF_PROSE = "the reasoning is {fine} " * 45_000


@pytest.mark.parametrize(
    "name, behaviour, kind",
    fast_first(
        [
            ("500", only_role1(500, {"error": {"message": "boom"}}), "server_error"),
            (
                "429 with Retry-After",
                only_role1(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}),
                "rate_limit",
            ),
            ("timeout", sleepy(8.0), "timeout"),
            ("empty choices", only_role1(200, {**completion("x"), "choices": []}), "empty"),
            (
                "prose only",
                only_role1(200, completion("The player reasons well; I would give high marks.")),
                "no_json",
            ),
            (
                "fence with broken JSON",
                only_role1(200, completion('```json\n{"alpha": 1, "sigma": 0.5, "rho": \n```')),
                "no_json",
            ),
            (
                "values out of range",
                only_role1(
                    200, completion('{"alpha": 2, "sigma": 0.5, "rho": 0, "d": 5, "a": 0, "c": 0}')
                ),
                "bad_value",
            ),
            ("missing keys", only_role1(200, completion('{"alpha": 1, "d": 1}')), "missing_keys"),
            ("1 MB reply", only_role1(200, completion(MB_OF_PROSE)), "no_json"),
        ]
    ),
)
def test_train_with_a_misbehaving_judge_completes_and_imputes_the_right_trajectories(
    tmp_path, secret_key, name, behaviour, kind, talkers
):
    server = JudgeServer(behaviour)
    out = tmp_path / "run"
    try:
        assert (
            run(
                SMALL
                + talkers
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
                    "--judge-timeout",  # the sleepy server answers 8 s late; the others at once, even when
                    "4" if kind == "timeout" else "600",  # a busy machine slows them by seconds
                ]
            )
            == 0
        )
    finally:
        server.close()
    metrics, trajs = check_run(out, 1, beta=0.2)
    bad = [t for t in trajs if t["role"] == 1]
    assert bad and all(t["judged"] and t["scores"] is None for t in bad)
    assert all(t["scores"] is not None for t in trajs if t["role"] == 0)
    assert metrics[0]["judge_failures"] == {kind: len(bad)}, name


def test_train_with_a_judge_refusing_connections_after_start_up_runs_unmodulated(
    tmp_path, secret_key, talkers
):
    server = JudgeServer(close_after_probe=True)
    out = tmp_path / "run"
    assert (
        run(
            SMALL
            + talkers
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
                "1",
            ]
        )
        == 0
    )
    metrics, trajs = check_run(out, 1, beta=0.2)
    assert (
        metrics[0]["judge_failures"] == {"connection": len(trajs)} and not metrics[0]["modulated"]
    )
    assert server.requests == []


def test_JudgeRunner_puts_paid_requests_on_record_before_their_reply_is_read(
    judge_server, secret_key, tmp_path, monkeypatch
):
    """Whatever goes wrong while a reply is read, the request was paid for and is in the ledger already."""

    class Unforeseen(Exception):
        pass

    def parse_that_breaks(reply, rubric):
        raise Unforeseen(rubric)

    monkeypatch.setattr(S, "parse_scores", parse_that_breaks)
    args = judge_args(
        judge_server.url, judge_price_in=10.0, judge_price_out=0.0
    )  # gpt-4o's table price otherwise
    ledger = tmp_path / "judge_ledger.jsonl"
    runner = J.JudgeRunner(
        J.OpenAIJudge("judge-test", judge_server.url, args), args, runfiles.JudgeCache(None), ledger
    )
    trajs = [
        S.Trajectory(
            "G", r, [S.Turn("o", "r", "[1]", [], []), S.Turn("o2", "r2", "[2]", [], [])], 0.0
        )
        for r in (0, 1, 0)
    ]
    with pytest.raises(Unforeseen):
        S.judge_trajectories(runner, trajs, ["transferability", "evolution"])
    rows = read_jsonl(ledger)
    assert len(rows) == len(judge_server.requests) == 6 and all(
        r["cost"] == pytest.approx(0.001) for r in rows
    )


@pytest.mark.parametrize(
    "name, behaviour, kind",
    fast_first(
        [
            (
                "very long integer",
                only_role1(
                    200,
                    completion(
                        '{"alpha": 1'
                        + "0" * 400
                        + ', "sigma": 1, "rho": 1, "d": 1, "a": 1, "c": 1}'
                    ),
                ),
                "bad_value",
            ),
            ("{ and a thousand [", only_role1(200, completion('{"d": ' + "[" * 1000)), "no_json"),
            (
                "cut off by the token limit",
                only_role1(
                    200,
                    {
                        **completion(
                            'The player wrote {"alpha": 1, "sigma": 1, "rho": 1, "d": 1, "a": 1, "c": 1}.'
                            " My own verdict"
                        ),
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "length",
                                "message": {
                                    "role": "assistant",
                                    "content": 'The player wrote {"alpha": 1, "sigma": 1, "rho": 1, '
                                    '"d": 1, "a": 1, "c": 1}. My own',
                                },
                            }
                        ],
                    },
                ),
                "finish_length",
            ),
            (
                "content filter",
                only_role1(
                    200,
                    _completion_with(
                        choices=[
                            {
                                "index": 0,
                                "finish_reason": "content_filter",
                                "message": {
                                    "role": "assistant",
                                    "content": '{"alpha": 1, "sigma": 1, "rho": 1, "d": 1, "a": 1, "c": 1}',
                                },
                            }
                        ]
                    ),
                ),
                "finish_content_filter",
            ),
            (
                "no finish reason",
                only_role1(
                    200,
                    _completion_with(
                        choices=[
                            {
                                "index": 0,
                                "message": {
                                    "role": "assistant",
                                    "content": '{"alpha": 1, "sigma": 1, "rho": 1, "d": 1, "a": 1, "c": 1}',
                                },
                            }
                        ]
                    ),
                ),
                "finish_other",
            ),
        ]
    ),
)
def test_JudgeRunner_counts_odd_verdicts_never_caches_them_and_records_them_paid(
    tmp_path, secret_key, name, behaviour, kind, talkers
):
    out = tmp_path / "run"
    _, server = run_with_player1_failing(out, behaviour, kind, name, talkers)
    bodies = [r["body"] for r in server.requests]
    valid = [
        b
        for b in bodies
        if not role1(b) or (name == "very long integer" and rubric_of(b) == "evolution")
    ]
    assert (
        len(read_jsonl(out / "judge_cache.jsonl")) == len(valid) < len(bodies)
    )  # only valid verdicts are kept
    assert len(read_jsonl(out / "judge_ledger.jsonl")) == len(
        bodies
    )  # every request paid for is on record


# ---- The rules decided in code: one-turn games, stagnation, levels over turns
def test_JudgeRunner_never_sends_a_one_turn_trajectory_for_evolution(judge_server, secret_key):
    args = judge_args(judge_server.url)
    runner = J.JudgeRunner(
        J.OpenAIJudge("judge-test", judge_server.url, args), args, runfiles.JudgeCache(None)
    )
    one = S.Trajectory(
        "TicTacToe-v0", 0, [S.Turn("board", "I take the centre.", "[4]", [], [])], 1.0
    )
    two = S.Trajectory(
        "TicTacToe-v0",
        1,
        [
            S.Turn("board", "Centre is gone; a corner.", "[0]", [], []),
            S.Turn("board 2", "Now block the diagonal.", "[8]", [], []),
        ],
        -1.0,
    )
    (j1, j2), usage = S.judge_trajectories(runner, [one, two], ["transferability", "evolution"])
    assert (
        usage["requests"] == 3
        and [rubric_of(r["body"]) for r in judge_server.requests].count("evolution") == 1
    )
    assert (
        "It took 2 turn(s)"
        in next(r for r in judge_server.requests if rubric_of(r["body"]) == "evolution")["body"][
            "messages"
        ][-1]["content"]
    )
    assert j1.scores == {
        **{k: float(v) for k, v in GOOD["transferability"].items()},
        "d": 0.0,
        "a": 0.0,
        "c": 0.0,
    }
    assert j1.rule == "one_turn" and j2.rule is None and j2.scores["d"] == 1.0


def test_stagnant_is_negative_whatever_the_judge_says(judge_server, secret_key):
    """The state moved on, the reasoning did not (numbers aside): d = a = -1, though the judge said d = +1."""
    args = judge_args(judge_server.url)
    runner = J.JudgeRunner(
        J.OpenAIJudge("judge-test", judge_server.url, args), args, runfiles.JudgeCache(None)
    )
    reset = "On my first move I take cell {}: the centre is strongest."
    stuck = S.Trajectory(
        "TicTacToe-v0",
        0,
        [
            S.Turn("empty board", reset.format(4), "[4]", [], []),
            S.Turn("half-full board", reset.format(2), "[2]", [], []),
        ],
        0.0,
    )
    moving = S.Trajectory(
        "TicTacToe-v0",
        0,
        [
            S.Turn("empty board", reset.format(4), "[4]", [], []),
            S.Turn("half-full board", "X threatens 0-1-2, so I block at 2.", "[2]", [], []),
        ],
        0.0,
    )
    same_state = S.Trajectory(
        "TicTacToe-v0",
        0,
        [
            S.Turn("board", reset.format(4), "[4]", [], []),
            S.Turn("board", reset.format(4), "[4]", [], []),
        ],
        0.0,
    )
    (j1, j2, j3), _ = S.judge_trajectories(
        runner, [stuck, moving, same_state], ["transferability", "evolution"]
    )
    assert (j1.scores["d"], j1.scores["a"], j1.scores["c"], j1.rule) == (
        -1.0,
        -1.0,
        -1.0,
        "stagnant",
    )
    assert (j2.scores["d"], j2.scores["a"], j2.rule) == (1.0, 0.0, None)
    assert j3.rule is None  # nothing new was shown: repeating is not stagnation
    key = judge_prompts.reasoning_key
    assert key("I take cell 4 ") == key("i  take cell 12") and key("I take 4") != key("I block 4")


def test_reasoning_key_compares_the_reasoning_not_the_move_in_its_box():
    def same(a: str, b: str) -> bool:
        return judge_prompts.reasoning_key(a) == judge_prompts.reasoning_key(b)

    assert same(
        "Just play the move. \\boxed{[bet]}", "just play the move.  \\boxed{[check]}"
    )  # another move
    assert not same("Round one. \\boxed{[bet]}", "Round two. \\boxed{[bet]}")
    assert same("\\boxed{[bet]}", "\\boxed{[call]}")  # no reasoning at all, twice
    assert judge_prompts.reasoning_text("a \\boxed{x{y}z} b \\boxed{[4]}") == "a \\boxed{x{y}z} b "
    assert (
        judge_prompts.reasoning_text("a \\boxed{[4") == "a "
    )  # an unclosed box: the rest is the answer
    obs, moves = ["board 1", "board 2"], ["Just play. \\boxed{[1]}", "Just play. \\boxed{[2]}"]
    assert (
        judge_prompts.evolution_rules(obs, moves, {"d": 1.0, "a": 1.0, "c": 1.0})[1] == "stagnant"
    )


def test_HeuristicJudge_deepens_on_new_words_not_on_more_characters():
    judge = J.HeuristicJudge()

    def d(*responses):
        turns = [S.Turn(f"board {k}", r, "[1]", [], []) for k, r in enumerate(responses)]
        return judge.scores(
            "evolution", J.render_for_judge(S.Trajectory("KuhnPoker-v1", 0, turns, 0.0))
        )["d"]

    assert d("Round one.", "Round two, after a bet.") == 1.0  # a word the first turn had not
    assert (
        d("Round one, after a bet, after a bet.", "Round one, after a bet.") == 0.0
    )  # shorter, nothing new
    assert (
        d("Round one.", "Round one. Round one. Round one. Round one.") == 0.0
    )  # longer, nothing new: not deeper
    assert d("a", "b") == 0.0  # words of fewer than three letters are not content


def test_HeuristicJudge_scores_a_rubric_it_has_no_features_for_at_its_middle_levels(monkeypatch):
    """A rubric added to the table (docs/hacking.md's faithfulness) gets its middle level on every key, from a
    trajectory of several turns, rather than a crash mid-run."""
    rubric = {
        "score": "f",
        "role": "logged",
        "turns": 1,
        "levels": (-1.0, 0.0, 1.0),
        "preamble": "Grade it.",
    }
    rubric["dimensions"] = {
        "f1": {"weight": 0.5, "text": "f1"},
        "f2": {"weight": 0.5, "text": "f2"},
    }
    monkeypatch.setitem(judge_prompts.RUBRICS, "faithfulness", rubric)
    turns = [S.Turn(f"board {k}", "Round one. \\boxed{[bet]}", "[bet]", [], []) for k in range(3)]
    text = J.render_for_judge(S.Trajectory("KuhnPoker-v1", 0, turns, 0.0))
    assert J.HeuristicJudge().scores("faithfulness", text) == {"f1": 0.0, "f2": 0.0}


def test_HeuristicJudge_names_the_keys_it_has_no_feature_for_in_one_warning_line_once(
    monkeypatch, capsys
):
    """docs/hacking.md's forks, a dimension e in evolution and a third rubric: the first stand-in made says in one
    line which keys it cannot score and the level each gets instead, and the run goes on with those levels; a
    second stand-in (tools/serve_judge makes one a request) says nothing more. The paper's table warns of nothing."""
    monkeypatch.setattr(J.HeuristicJudge, "_named", set())
    J.HeuristicJudge()
    assert capsys.readouterr().err == ""
    evolution = copy.deepcopy(judge_prompts.RUBRICS["evolution"])
    evolution["dimensions"]["c"]["weight"] = 0.30
    evolution["dimensions"]["e"] = {"weight": 0.10, "text": "e"}
    monkeypatch.setitem(judge_prompts.RUBRICS, "evolution", evolution)
    faithfulness = {"score": "f", "role": "logged", "turns": 1, "levels": (0.0, 0.5, 1.0)}
    faithfulness |= {"preamble": "Grade it.", "dimensions": {"m": {"weight": 1.0, "text": "m"}}}
    monkeypatch.setitem(judge_prompts.RUBRICS, "faithfulness", faithfulness)
    judge = J.HeuristicJudge()
    assert capsys.readouterr().err == (
        "stratagem: warning: the stand-in judge (heuristic) has no feature for e (evolution), m (faithfulness): "
        "each gets its rubric's middle level on every trajectory (e = 0, m = 0.5), which grades nothing; teach "
        "HeuristicJudge in machinery/judge.py to score each, or use --judge openai\n"
    )
    J.HeuristicJudge()
    assert capsys.readouterr().err == ""
    turns = [S.Turn(f"board {k}", f"Turn {k}, new words.", "[bet]", [], []) for k in range(2)]
    text = J.render_for_judge(S.Trajectory("KuhnPoker-v1", 0, turns, 0.0))
    assert judge.scores("evolution", text)["e"] == 0.0 and judge.scores("faithfulness", text) == {
        "m": 0.5
    }


def test_typical_level_combines_levels_over_turns_and_the_heuristic_judge_keeps_the_rules():
    assert (
        judge_prompts.typical_level([1.0, 0.0, 0.5]) == 0.5
        and judge_prompts.typical_level([0.0, 1.0]) == 0.0
    )
    assert judge_prompts.typical_level([1.0]) == 1.0
    judge = J.HeuristicJudge()

    def scores(rubric, turns):  # turns: (response, action)
        traj = S.Trajectory(
            "TicTacToe-v0",
            0,
            [S.Turn(f"board {k}", r, a, [], []) for k, (r, a) in enumerate(turns)],
            0.0,
        )
        return judge.scores(rubric, J.render_for_judge(traj))

    rich = "If I compare the expected value of each case, the probability and payoff favour the optimal strategy."
    assert scores("transferability", [(rich, "[4]")])["alpha"] == 1.0
    assert (
        scores("transferability", [(rich, "[4]"), ("ok", "[0]"), ("fine", "[8]")])["alpha"] == 0.0
    )  # one turn of three
    assert scores("evolution", [("I have no idea", "")]) == {
        "d": 0.0,
        "a": 0.0,
        "c": 0.0,
    }  # one turn: by rule
    assert scores("evolution", [("a", "[4]"), ("bb", "[0]")])["c"] == 1.0  # coherent throughout
    assert (
        scores("evolution", [("a", ""), ("bb", "[0]")])["c"] == 0.0
    )  # a lapse repaired: less, never more
    assert scores("evolution", [("a", "[4]"), ("bb", "")])["c"] == -1.0  # lost by the end
    assert scores("evolution", [("same", "[4]"), ("same", "[0]")])[("d")] == -1.0


# ---- Verdicts parsed: as models write them, and nothing a judge writes crashes a run
@pytest.mark.parametrize(
    "reply, scores",
    [
        ('{"alpha": 1, "sigma": 0.5, "rho": 0}', {"alpha": 1.0, "sigma": 0.5, "rho": 0.0}),
        (
            'Sure!\n```json\n{"alpha": 0.5, "sigma": 0.5, "rho": 1, "note": "x"}\n```\nDone.',
            {"alpha": 0.5, "sigma": 0.5, "rho": 1.0},
        ),
        (
            '<think>maybe {"alpha": 0, "sigma": 0, "rho": 0}</think> {"alpha": "1", "sigma": 1, "rho": 1}',
            {"alpha": 1.0, "sigma": 1.0, "rho": 1.0},
        ),
    ],
)
def test_parse_scores_reads_valid_verdicts(reply, scores):
    assert J.parse_scores(reply, "transferability") == scores


@pytest.mark.parametrize(
    "reply, rubric, kind",
    [
        ('{"alpha": 0.7, "sigma": 0.5, "rho": 0}', "transferability", "bad_value"),
        ('{"alpha": true, "sigma": 0.5, "rho": 0}', "transferability", "bad_value"),
        ('{"alpha": "high", "sigma": 0.5, "rho": 0}', "transferability", "bad_value"),
        ('{"alpha": 1, "sigma": 0.5}', "transferability", "missing_keys"),
        ("The reasoning is good.", "transferability", "no_json"),
        ('```json\n{"alpha": 1, "sigma": \n```', "transferability", "no_json"),
        ("[1, 0.5, 0]", "transferability", "no_json"),
        # loose spellings (issue 9) are read, but NaN, booleans and off-level values still fail
        ('{"d": +1, "a": NaN, "c": 0}', "evolution", "bad_value"),
        ('{"d": +1, "a": "nan", "c": 0}', "evolution", "bad_value"),
        ('{"alpha": false, "sigma": .5, "rho": 1}', "transferability", "bad_value"),
        ('{"alpha": +.7, "sigma": .5, "rho": 1}', "transferability", "bad_value"),
        ('{"d": +2, "a": 0, "c": 0}', "evolution", "bad_value"),
        ('{"d": .5, "a": 0, "c": 0}', "evolution", "bad_value"),
    ],
)
def test_parse_scores_failures_have_a_kind(reply, rubric, kind):
    with pytest.raises(J.JudgeFailure) as e:
        J.parse_scores(reply, rubric)
    assert e.value.kind == kind


def test_parse_scores_evolution_levels():
    assert J.parse_scores('{"d": -1, "a": 0, "c": 1}', "evolution") == {
        "d": -1.0,
        "a": 0.0,
        "c": 1.0,
    }
    with pytest.raises(J.JudgeFailure):
        J.parse_scores('{"d": 0.5, "a": 0, "c": 1}', "evolution")


@pytest.mark.parametrize(
    "reply, rubric, scores",
    [
        (
            '<think>Turn 2 reuses turn 1\'s odds {so d improves}.</think>\n```json\n{"d": +1, "a": 0, "c": -1}\n```',
            "evolution",
            {"d": 1.0, "a": 0.0, "c": -1.0},
        ),
        (
            'Verdict: {"alpha": .5, "sigma": +.5, "rho": +1} - the player enumerates cases.',
            "transferability",
            {"alpha": 0.5, "sigma": 0.5, "rho": 1.0},
        ),
        (
            '```\n{\n  "alpha": "0.5",\n  "sigma": "+1",\n  "rho": ".5"\n}\n```',
            "transferability",
            {"alpha": 0.5, "sigma": 1.0, "rho": 0.5},
        ),
        (
            'Scores {"d": "-1", "a": -0, "c": +0} as asked.',
            "evolution",
            {"d": -1.0, "a": 0.0, "c": 0.0},
        ),
        (
            '{"d": +1, "a": +1, "c": +1, "why": "ratio: +.5 better"}',
            "evolution",
            {"d": 1.0, "a": 1.0, "c": 1.0},
        ),
    ],
)
def test_parse_scores_reads_verdicts_as_models_write_them(reply, rubric, scores):
    parsed = J.parse_scores(reply, rubric)
    assert parsed == scores and all(
        math.copysign(1, v) == 1 for v in parsed.values() if v == 0
    )  # no -0.0


@pytest.mark.parametrize(
    "reply, kind",
    [
        (
            '{"alpha": 1' + "0" * 400 + ', "sigma": 1, "rho": 1}',
            "bad_value",
        ),  # int(...) fine, float(...) overflows
        ('{"alpha": "1' + "0" * 400 + '", "sigma": 1, "rho": 1}', "bad_value"),
        ('{"alpha": 1e999, "sigma": 1, "rho": 1}', "bad_value"),
        (
            '{"alpha": ' + "9" * 5000 + ', "sigma": 1, "rho": 1}',
            "no_json",
        ),  # json refuses 4300+ digits
        ('{"alpha": ' + "[" * 1000, "no_json"),  # RecursionError inside json
        ('{"alpha": ' + "[" * 20_000 + "1" + "]" * 20_000 + ', "sigma": 1, "rho": 1}', "no_json"),
        ('{"alpha": {"alpha": {"alpha": 1}}, "sigma": 1, "rho": 1}', "bad_value"),
    ],
    ids=["long int", "long int string", "1e999", "5000 digits", "{[[[", "deep list", "nested dict"],
)
def test_parse_scores_takes_odd_verdicts_as_failures_of_a_kind_never_exceptions(reply, kind):
    with pytest.raises(J.JudgeFailure) as e:
        J.parse_scores(reply, "transferability")
    assert e.value.kind == kind


def test_parse_scores_raises_nothing_but_judge_failures_on_fuzzed_replies():
    junk = [
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        '"',
        "\\",
        "\\u0000",
        "\ud800",
        " ",
        "\n",
        "```json",
        "[" * 3000,
        "{" * 3000,
        "é",
        "\u2028",
        "<think>",
        "NaN",
        "0" * 5000,
    ]
    values = [
        "1",
        "0",
        "-1",
        "0.5",
        "+1",
        ".5",
        "-.5",
        "-0",
        '"1"',
        '"+.5"',
        '"x"',
        "9" * 400,
        "-" + "9" * 5000,
        "1e999",
        "-1e999",
        "NaN",
        "Infinity",
        "true",
        "null",
        "[1]",
        "{}",
        "[" * 2000 + "]" * 2000,
        "1" + "0" * 400,
    ]
    rng = random.Random(16)
    outcomes: dict[str, int] = {}
    for _ in range(3000):
        rubric = rng.choice(list(judge_prompts.RUBRICS))
        keys = [k for k in judge_prompts.keys(rubric) if rng.random() < 0.9] + [
            "extra"
        ] * rng.randrange(2)
        obj = "{" + ", ".join(f'"{k}": {rng.choice(values)}' for k in keys) + "}"
        reply = (
            "".join(rng.choice(junk) for _ in range(rng.randrange(4)))
            + obj
            + "".join(rng.choice(junk) for _ in range(rng.randrange(4)))
        )
        reply = reply[: rng.randrange(len(reply) + 1)] if rng.random() < 0.2 else reply
        try:
            scores = J.parse_scores(reply, rubric)
        except J.JudgeFailure as e:
            outcomes[e.kind] = outcomes.get(e.kind, 0) + 1
            continue
        outcomes["valid"] = outcomes.get("valid", 0) + 1
        assert set(scores) == set(judge_prompts.keys(rubric))
        assert all(v in judge_prompts.RUBRICS[rubric]["levels"] for v in scores.values())
    assert set(outcomes) == {"valid", "no_json", "missing_keys", "bad_value"}, outcomes


# ---- The transport: bounded waits, bounded replies, compression refused
def stall_after(seconds: float, seen: list):
    """Headers, then a byte every 0.1 s for `seconds`, then silence; `seen` gets how long the client held the
    connection, as the server saw it (from the request's arrival to the client's hang-up)."""

    def answer(conn, body):
        t0 = time.monotonic()
        conn.sendall(http_reply(200, b"", "Content-Length: 100000"))
        while time.monotonic() - t0 < seconds:
            conn.sendall(b" ")
            time.sleep(0.1)
        conn.settimeout(60)
        conn.recv(1)  # b"" when the client hangs up
        seen.append(time.monotonic() - t0)

    return answer


def test_judge_timeout_ends_an_attempt_at_its_deadline_not_one_wait_later(secret_key):
    """--judge-timeout T bounds an attempt as a whole: a server that trickles until just before T and then falls
    silent loses the connection at T, not one more wait of up to T later (about 1.9 T). Measured by the server,
    from the request's arrival to the hang-up: nothing the client computes before sending is counted, and what
    is left is waiting, which load does not lengthen by seconds."""
    timeout, seen = 4.0, []
    server = RawJudgeServer(stall_after(0.9 * timeout, seen))
    args = judge_args(server.url, judge_timeout=timeout, judge_retries=0)
    try:
        with pytest.raises(J.JudgeFailure) as e:
            J.OpenAIJudge("judge-test", server.url, args).complete(
                "transferability", judge_prompts.build_messages("transferability", "text")
            )
        wait_for(lambda: seen, 60)
    finally:
        server.close()
    assert e.value.kind == "timeout" and timeout - 0.5 < seen[0] < timeout + 1.5, seen


def trickled_body(
    conn, body
):  # a reply announced as 100 kB, sent one byte at a time, five a second
    conn.sendall(http_reply(200, b"", "Content-Length: 100000"))
    while True:
        conn.sendall(b" ")
        time.sleep(0.2)


def trickled_headers(conn, body):  # headers that never end
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while True:
        conn.sendall(b"X")
        time.sleep(0.2)


@pytest.mark.parametrize("answer", [trickled_body, endless_body, trickled_headers])
@pytest.mark.slow
def test_judge_timeout_bounds_a_step_whose_judge_never_finishes_to_retries_plus_one_timeouts(
    tmp_path, answer
):
    """--judge-timeout bounds each attempt as a whole (connect to the last byte), not each wait for a byte:
    the judge phase of a step takes (retries + 1) x timeout plus the client's backoff (0.5 s before the retry)."""
    server = RawJudgeServer(answer)
    out = tmp_path / "run"
    proc = spawn_quiet(
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
            "--judge-timeout",
            "1.5",
            "--judge-retries",
            "1",
        ],
        tmp_path,
    )
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        proc.kill()
        server.close()
    assert proc.returncode == 0, err[-2000:]
    [m] = read_jsonl(out / "metrics.jsonl")
    assert (
        m["judge_failures"] == {"timeout": m["judge_judged"]}
        and m["judge_requests"] == server.posts // 2
    )
    assert 2 * 1.5 <= m["time_split_s"]["judge"] < 2 * 1.5 + 0.5 + 1.5, m["time_split_s"]


def fifty_mb_reply(chunked: bool):
    """A completion of 50 MB, made here, before any memory is measured."""
    reply = json.dumps(completion("x" * 50_000_000)).encode()
    wire = memoryview(
        http_reply(200, b"", "Transfer-Encoding: chunked") if chunked else http_reply(200, reply)
    )

    def answer(conn, body):
        conn.sendall(wire)
        if chunked:
            for k in range(0, len(reply), 1 << 20):
                piece = memoryview(reply)[k : k + (1 << 20)]
                conn.sendall(b"%x\r\n" % len(piece))
                conn.sendall(piece)
                conn.sendall(b"\r\n")
            conn.sendall(b"0\r\n\r\n")

    return answer


def judged_once_with_peak_memory(server) -> tuple:
    """One trajectory judged by `server` (2 retries allowed), then the server closed: (judgement, usage, the peak of
    Python's memory while judging, tracemalloc's count)."""
    import tracemalloc

    args = judge_args(server.url, judge_retries=2)
    runner = J.JudgeRunner(
        J.OpenAIJudge("judge-test", server.url, args), args, runfiles.JudgeCache(None)
    )
    tracemalloc.start()
    try:
        [j], usage = S.judge_trajectories(
            runner,
            [S.Trajectory("G", 0, [S.Turn("o", "r", "[1]", [], [])], 0.0)],
            ["transferability"],
        )
        return j, usage, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["announced", "chunked"])
def test_max_reply_bytes_refuses_a_50_mb_judge_reply_without_reading_it_into_memory(
    secret_key, chunked
):
    server = RawJudgeServer(fifty_mb_reply(chunked))
    j, usage, peak = judged_once_with_peak_memory(server)
    assert j.failure == "too_large" and usage["requests"] == 1
    assert server.posts == 1  # not retried: the same server would send the same reply
    assert peak < 30e6, peak  # the body is capped at 4 MiB (--judge-max-tokens 1024)


@functools.cache
def bomb(encoding: str) -> bytes:
    """A chat completion whose content is 200 MB of "x", compressed to about 0.2 MB (gzip, deflate); br and zstd
    (which httpx decodes only with optional packages) are their header on an opaque body."""
    import zlib

    if encoding in ("br", "zstd"):
        return b"\x1b\xff\xff" * 1000
    head, tail = json.dumps(completion("@")).encode().split(b"@")
    z = zlib.compressobj(6, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    x = b"x" * (1 << 20)
    return b"".join(
        [z.compress(head), *(z.compress(x) for _ in range(200)), z.compress(tail), z.flush()]
    )


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd", "gzip, identity"])
def test_BoundedClient_refuses_a_compressed_judge_reply_unread_whatever_it_would_inflate_to(
    secret_key, encoding
):
    """The client asks for no compression; a reply compressed anyway is refused before a byte of it is decoded
    (the cap counts what is parsed), counted as `encoded` and not retried (the same server would do it again)."""
    body = bomb(encoding.split(",")[0])
    server = RawJudgeServer(
        lambda conn, _: conn.sendall(http_reply(200, body, f"Content-Encoding: {encoding}"))
    )
    j, usage, peak = judged_once_with_peak_memory(server)
    assert j.failure == "encoded" and usage["requests"] == 1 and server.posts == 1
    assert peak < 8e6, (
        peak
    )  # a normal reply's request takes about 1 MB; the bomb inflates to 200 MB


# ---- The start-up checks: a key, a reachable OpenAI chat endpoint, one probe that must come back a verdict
def test_openai_client_needs_a_key_or_a_base_url(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    err = error_of(capsys, ["--tiny", "--judge", "openai", "--out", str(tmp_path / "r")])
    assert "OPENAI_API_KEY" in err and not (tmp_path / "r").exists()


def test_check_reachable_refuses_an_unreachable_judge_in_one_line(capsys, tmp_path, secret_key):
    err = error_of(
        capsys,
        [
            "--tiny",
            "--judge",
            "openai",
            "--judge-base-url",
            f"http://127.0.0.1:{free_port()}/v1",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert "unreachable" in err and not (tmp_path / "r").exists() and secret_key not in err


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:s3cret-pw@127.0.0.1:9/v1",
        "http://alice:s3cret%40pw@127.0.0.1:9/v1",
        "https://s3cret@127.0.0.1:9",
    ],
    ids=["user and password", "encoded password", "password as user"],
)
def test_check_base_url_refuses_credentials_in_one_line_and_never_writes_or_shows_them(
    one_step_run, tiny, tmp_path, capsys, secret_key, url
):
    """A URL's user:password would be written to config.json and the start line and sent as Basic auth in place
    of the key: every command that takes a base URL refuses it, naming OPENAI_API_KEY, and shows no password."""
    import shutil

    done = tmp_path / "done"
    shutil.copytree(one_step_run, done)
    commands = {
        "train": SMALL
        + [
            "--steps",
            "1",
            "--judge",
            "openai",
            "--judge-base-url",
            url,
            "--out",
            str(tmp_path / "new"),
        ],
        "dry run": ["--dry-run", "--judge-base-url", url, "--out", str(tmp_path / "dry")],
        "resume": ["--resume", "--out", str(done), "--steps", "2", "--judge-base-url", url],
        "eval": [
            "eval",
            str(tiny),
            "--opponent",
            f"openai:m@{url}",
            "--n",
            "1",
            "--json",
            str(tmp_path / "e.json"),
        ],
        "agree": ["agree", str(done), "--judges", "heuristic", f"openai:m@{url}"],
    }
    for name, argv in commands.items():
        assert run(argv) == 2, name
        said = capsys.readouterr()
        assert said.err.count("\n") == 1 and said.err.endswith(
            "; put the key in OPENAI_API_KEY\n"
        ), (name, said.err)
        assert "s3cret" not in said.out + said.err, name
    assert not files_contain(tmp_path, "s3cret") and not (tmp_path / "new").exists()
    assert tree_of(done) == tree_of(one_step_run)


def test_check_reachable_refuses_a_judge_that_compresses_every_reply_in_one_line(
    tmp_path, capsys, secret_key
):
    import gzip

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, payload: dict):
            data = gzip.compress(json.dumps(payload).encode())
            self.send_response(200)
            for k, v in {"Content-Type": "application/json", "Content-Encoding": "gzip"}.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"object": "list", "data": []})

    httpd = serve_judge.JudgeHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        err = error_of(
            capsys,
            SMALL
            + [
                "--steps",
                "1",
                "--judge",
                "openai",
                "--judge-base-url",
                url,
                "--out",
                str(tmp_path / "run"),
            ],
        )
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert err == (
        f"stratagem: error: the judge at {url} compressed its reply (Content-Encoding: gzip) although asked not to "
        "(Accept-Encoding: identity); a compressed reply is never read (its size is not known before it is "
        "decoded): turn compression off on that server or its proxy\n"
    )
    assert not (tmp_path / "run").exists()


def judge_check_fails(capsys, tmp_path, url: str, *flags) -> str:
    """A run against `url` stops in one line before it loads the policy or writes a file; the line."""
    out = tmp_path / "never"
    argv = SMALL + [
        "--out",
        str(out),
        "--judge",
        "openai",
        "--judge-base-url",
        url,
        "--judge-retries",
        "0",
        *flags,
    ]
    assert run(argv) == 2
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and "Traceback" not in printed.err and not out.exists()
    assert "loading the policy" not in printed.out
    return printed.err.removeprefix("stratagem: error: ").strip()


def test_check_reachable_stops_a_run_on_a_judge_url_without_v1_with_a_hint(
    tmp_path, capsys, secret_key
):
    server = serve_judge.make_judge_server(
        "127.0.0.1", 0, noise=0.0, seed=0
    )  # the stand-in: 404 off its routes
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        line = judge_check_fails(capsys, tmp_path, base, "--judge-model", "heuristic")
        assert (
            run(
                SMALL
                + ["--steps", "1", "--out", str(tmp_path / "ok"), "--judge", "openai"]
                + ["--judge-base-url", base + "/v1", "--judge-model", "heuristic"]
            )
            == 0
        )
    finally:
        server.shutdown()
        server.server_close()
    assert line == (
        f"the judge at {base}/chat/completions (--judge-model heuristic) failed its start-up check: HTTP 404: "
        f"no route POST /chat/completions; did you mean --judge-base-url {base}/v1?"
    )
    assert (
        f"judge check: {base}/v1/chat/completions answered a verdict in " in capsys.readouterr().out
    )


def vllm_like(body: dict):
    """A server of one model that refuses any other name as vLLM does (404), and answers in prose, not JSON."""
    if body["model"] != "judge-test":
        return 404, {
            "error": {"message": f"The model `{body['model']}` does not exist.", "code": 404}
        }
    return 200, completion("Hello! How can I help you today?")


def test_check_reachable_stops_a_run_on_a_wrong_model_name_or_a_judge_that_answers_no_verdict(
    tmp_path, capsys, secret_key
):
    server = JudgeServer(vllm_like, answer_probe=False)
    try:
        wrong = judge_check_fails(capsys, tmp_path, server.url)  # --judge-model gpt-4o, the default
        prose = judge_check_fails(capsys, tmp_path, server.url, "--judge-model", "judge-test")
    finally:
        server.close()
    assert wrong == (
        f"the judge at {server.url}/chat/completions (--judge-model gpt-4o) failed its start-up check: HTTP 404: "
        "The model `gpt-4o` does not exist; it lists the models judge-test: pass one as --judge-model"
    )
    assert prose.startswith(
        f"the judge at {server.url}/chat/completions (--judge-model judge-test) failed its "
    )
    assert (
        "its reply is not a verdict ('Hello! How can I help you today?'; 3 replies tried, none a verdict); the judge "
        "must answer in JSON" in prose
    )
    # the wrong name: one request; prose: three structured (auto), then three free-text ones
    assert len(server.requests) == 7 and all(
        r["body"]["max_tokens"] == 1024 for r in server.requests
    )
    assert ["response_format" in r["body"] for r in server.requests] == [True] * 4 + [False] * 3


def flaky_then_verdict(cut: int, structured_ok: bool = True):
    """A judge whose first `cut` probe replies are cut short (finish_reason "length"), then a verdict; one that
    refuses response_format with a 400 where `structured_ok` is False."""
    seen = {"n": 0}

    def behaviour(body: dict):
        if "response_format" in body and not structured_ok:
            return 400, {"error": {"message": "response_format is not supported"}}
        seen["n"] += 1
        if seen["n"] <= cut:
            cut_short = completion('{"alpha": 0.5, "sig')
            cut_short["choices"][0]["finish_reason"] = "length"
            return 200, cut_short
        return 200, completion(json.dumps(J.probe_verdict()))

    return behaviour


def test_check_reachable_decides_on_a_few_replies_and_says_at_which_try(
    tmp_path, capsys, secret_key
):
    server = JudgeServer(flaky_then_verdict(2), answer_probe=False)
    try:
        args = judge_args(server.url, judge_model="judge-test", judge_retries=0)
        line = J.OpenAIJudge("judge-test", server.url, args).check_reachable()
        refused = J.OpenAIJudge(
            "judge-test", server.url, dataclasses.replace(args, judge_structured="on")
        )
        server.behaviour = flaky_then_verdict(3)
        with pytest.raises(
            UserError, match="3 replies tried; the reply was cut at --judge-max-tokens"
        ):
            refused.check_reachable()
    finally:
        server.close()
    assert "answered a verdict at try 3 of 3" in line and "verdicts: structured" in line


def test_check_reachable_in_auto_falls_back_to_free_text_where_the_server_refuses_the_schema(
    secret_key,
):
    server = JudgeServer(flaky_then_verdict(0, structured_ok=False), answer_probe=False)
    try:
        args = judge_args(server.url, judge_model="judge-test", judge_retries=0)
        judge = J.OpenAIJudge("judge-test", server.url, args)
        line = judge.check_reachable()
        assert (
            not judge.structured
            and "verdicts: free text, parsed; --judge-structured auto: the server" in line
        )
        with pytest.raises(UserError, match="HTTP 400: response_format is not supported"):
            J.OpenAIJudge(
                "judge-test", server.url, dataclasses.replace(args, judge_structured="on")
            ).check_reachable()
        judge.complete(
            "evolution", judge_prompts.build_messages("evolution", "a trajectory")
        )  # free text: no schema sent
        assert "response_format" not in server.requests[-1]["body"]
    finally:
        server.close()


def test_complete_with_structured_verdicts_sends_each_rubrics_schema(secret_key):
    server = JudgeServer(good_judge)
    try:
        args = judge_args(server.url, judge_model="judge-test", judge_structured="on")
        J.OpenAIJudge("judge-test", server.url, args).complete(
            "evolution", judge_prompts.build_messages("evolution", "a trajectory")
        )
    finally:
        server.close()
    schema = server.requests[-1]["body"]["response_format"]["json_schema"]["schema"]
    assert schema == {
        "type": "object",
        "properties": {k: {"type": "number", "enum": [-1, 0, 1]} for k in ("d", "a", "c")},
        "required": ["d", "a", "c"],
        "additionalProperties": False,
    }


def test_JudgeCache_key_of_a_structured_request_differs_and_a_free_text_key_is_as_before():
    free = runfiles.JudgeCache.key("m", "evolution", 1.0, 1024, 0, "t")
    assert free == runfiles.JudgeCache.key("m", "evolution", 1.0, 1024, 0, "t", False)
    assert free != runfiles.JudgeCache.key("m", "evolution", 1.0, 1024, 0, "t", True)
    ident = json.dumps(["m", judge_prompts.PROMPT_VERSION, "evolution", 1.0, 1024, 0, "t"])
    assert (
        free == hashlib.sha256(ident.encode()).hexdigest()
    )  # caches written before structured verdicts still hit


class HTMLServer(http.server.BaseHTTPRequestHandler):
    """A web server, not an API: every request gets a 200 with an HTML page."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        page = b"<html><body><h1>Welcome to nginx!</h1></body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.do_GET()


class FileServer(http.server.SimpleHTTPRequestHandler):
    """Python's own file server: no POST at all (501)."""

    def log_message(self, *a):
        pass


@pytest.mark.parametrize(
    "handler, came_back",
    [
        (
            HTMLServer,
            "bad response (not a chat completion: '<html><body><h1>Welcome to nginx!</h1></body></html>')",
        ),
        (
            FileServer,
            "HTTP 501: Error response Error response Error code: 501 Message: Unsupported method ('POST')",
        ),
    ],
)
def test_check_reachable_stops_a_run_on_a_server_that_is_no_openai_chat_endpoint(
    tmp_path, capsys, secret_key, handler, came_back
):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        line = judge_check_fails(capsys, tmp_path, url)
    finally:
        server.shutdown()
        server.server_close()
    assert line.startswith(
        f"the judge at {url}/chat/completions (--judge-model gpt-4o) failed its start-up check: "
    )
    assert came_back in line and line.endswith(
        "is it an OpenAI-compatible chat endpoint (POST /chat/completions under --judge-base-url)?"
    )


def test_probe_messages_are_one_short_request_outside_the_budget_and_the_ledger(
    tmp_path, judge_server, secret_key, capsys
):
    out = tmp_path / "run"
    flags = ["--judge", "openai", "--judge-base-url", judge_server.url, "--judge-price-in", "10"]
    assert run(SMALL + ["--steps", "1", "--out", str(out)] + flags) == 0
    [m] = read_jsonl(out / "metrics.jsonl")
    assert (
        judge_server.probes == 1
        and len(read_jsonl(out / "judge_ledger.jsonl")) == m["judge_requests"]
    )
    lines = capsys.readouterr().out.splitlines()
    check = next(k for k, x in enumerate(lines) if x.startswith("judge check: "))
    assert "(30 + 12 tokens, outside the budget); verdicts: structured" in lines[check]
    assert lines[check + 1].startswith("loading")
    probe = J.probe_messages()[0]["content"]
    assert len(probe) < 200 and J.parse_scores(probe, "transferability") == J.probe_verdict()


# ---- The cache: a verdict is paid for once
def test_judge_cache_of_a_repeated_run_never_pays_twice_and_survives_a_torn_line(
    tmp_path, judge_server, secret_key
):
    cache = tmp_path / "shared-cache.jsonl"
    common = SMALL + [
        "--steps",
        "2",
        "--judge",
        "openai",
        "--judge-base-url",
        judge_server.url,
        "--judge-sample-rate",
        "1",
        "--judge-cache",
        str(cache),
    ]
    assert run(common + ["--out", str(tmp_path / "a")]) == 0
    paid = len(judge_server.requests)
    lines = cache.read_text().splitlines()
    assert paid > 0 and len({json.loads(x)["key"] for x in lines}) == len(lines) <= paid
    with open(cache, "a") as f:
        f.write('{"key": "torn-by-a-cra')  # a crash in the middle of a line
    assert run(common + ["--out", str(tmp_path / "b")]) == 0  # same seed: the same trajectories
    assert len(judge_server.requests) == paid
    metrics = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert (
        sum(m["judge_cache_hits"] for m in metrics) == paid
        and sum(m["judge_requests"] for m in metrics) == 0
    )
    assert read_jsonl(tmp_path / "a" / "trajectories.jsonl") == read_jsonl(
        tmp_path / "b" / "trajectories.jsonl"
    )


def test_judge_cache_of_a_resumed_run_does_not_pay_again_for_a_replayed_step(
    tmp_path, judge_server, secret_key
):
    import shutil

    common = SMALL + [
        "--judge",
        "openai",
        "--judge-base-url",
        judge_server.url,
        "--judge-sample-rate",
        "1",
    ]
    out = tmp_path / "run"
    assert run(common + ["--steps", "1", "--out", str(out)]) == 0
    shutil.copytree(out / "checkpoints", tmp_path / "ckpt-1")
    assert (
        run(["--resume", "--out", str(out), "--steps", "2", "--judge-base-url", judge_server.url])
        == 0
    )
    paid = len(judge_server.requests)
    shutil.rmtree(
        out / "checkpoints"
    )  # crash after step 2 was logged and judged, before its checkpoint
    shutil.copytree(tmp_path / "ckpt-1", out / "checkpoints")
    assert (
        run(["--resume", "--out", str(out), "--steps", "2", "--judge-base-url", judge_server.url])
        == 0
    )
    assert len(judge_server.requests) == paid
    assert read_jsonl(out / "metrics.jsonl")[-1]["judge_requests"] == 0


def test_judge_cache_lines_with_bad_scores_are_not_trusted(
    tmp_path, judge_server, secret_key, capsys
):
    cache = tmp_path / "cache.jsonl"
    common = SMALL + [
        "--steps",
        "1",
        "--judge",
        "openai",
        "--judge-base-url",
        judge_server.url,
        "--judge-sample-rate",
        "1",
        "--judge-cache",
        str(cache),
    ]
    assert run(common + ["--out", str(tmp_path / "a")]) == 0
    paid = len(judge_server.requests)
    forged = [
        {"alpha": 7, "sigma": 1, "rho": 1},
        {"alpha": True, "sigma": 1, "rho": 1},
        {"alpha": "x", "sigma": 1, "rho": 1},
        {"alpha": 1},
        ["alpha"],
        {"alpha": None, "sigma": 1, "rho": 1},
        {"d": 0.5, "a": 0, "c": 0},
    ]
    lines = [json.loads(x) for x in cache.read_text().splitlines()]
    for line, scores in zip(lines, itertools.cycle(forged)):
        line["scores"] = scores
    lines[-1]["rubric"] = "no-such-rubric"
    cache.write_text("".join(json.dumps(x) + "\n" for x in lines))
    capsys.readouterr()
    assert run(common + ["--out", str(tmp_path / "b")]) == 0
    assert (
        f"judge cache: skipped {len(lines)} unreadable or invalid line(s)"
        in capsys.readouterr().err
    )
    assert (
        len(judge_server.requests) == 2 * paid
    )  # every forged entry is asked for again, none is trusted
    assert read_jsonl(tmp_path / "a" / "trajectories.jsonl") == read_jsonl(
        tmp_path / "b" / "trajectories.jsonl"
    )
    check_run(tmp_path / "b", 1, beta=0.2)


def test_judge_cache_lines_of_any_shape_are_skipped_and_never_crash_a_run(
    tmp_path, judge_server, secret_key, capsys
):
    good = {
        "key": "k" * 64,
        "rubric": "transferability",
        "scores": {"alpha": 1, "sigma": 0.5, "rho": 0},
    }
    odd = [
        {
            **good,
            "scores": {"alpha": int("1" + "0" * 400), "sigma": 1, "rho": 1},
        },  # OverflowError in float()
        {**good, "scores": {"alpha": 1e400, "sigma": 1, "rho": 1}},
        {**good, "scores": "alphasigmarho"},
        {**good, "scores": 7},
        {**good, "rubric": ["transferability"]},
        {**good, "key": None},
        [good],
        "text",
        3,
        None,
    ]
    cache = tmp_path / "cache.jsonl"
    cache.write_bytes(
        "".join(json.dumps(x) + "\n" for x in odd).encode()
        + b"{"
        + b"[" * 100_000
        + b"\n"
        + b'{"alpha": '
        + b"9" * 5000
        + b"}\n"
        + b'{"key": "\xff\xfe"}\n'
    )  # the last one not UTF-8
    loaded = runfiles.JudgeCache(cache)
    assert loaded.entries == {} and loaded.skipped == len(odd) + 3
    assert (
        run(
            SMALL
            + [
                "--steps",
                "1",
                "--out",
                str(tmp_path / "run"),
                "--judge",
                "openai",
                "--judge-base-url",
                judge_server.url,
                "--judge-sample-rate",
                "1",
                "--judge-cache",
                str(cache),
            ]
        )
        == 0
    )
    assert (
        f"judge cache: skipped {len(odd) + 3} unreadable or invalid line(s)"
        in capsys.readouterr().err
    )
    check_run(tmp_path / "run", 1, beta=0.2)


def test_judge_cache_asks_the_judge_again_for_a_new_prompt_version(
    tmp_path, judge_server, secret_key, monkeypatch
):
    common = SMALL + [
        "--steps",
        "1",
        "--judge",
        "openai",
        "--judge-base-url",
        judge_server.url,
        "--judge-sample-rate",
        "1",
        "--judge-cache",
        str(tmp_path / "cache.jsonl"),
    ]
    assert run(common + ["--out", str(tmp_path / "a")]) == 0
    paid = len(judge_server.requests)
    assert (
        run(common + ["--out", str(tmp_path / "b")]) == 0 and len(judge_server.requests) == paid
    )  # all cached
    monkeypatch.setattr(judge_prompts, "PROMPT_VERSION", judge_prompts.PROMPT_VERSION + "-changed")
    assert (
        run(common + ["--out", str(tmp_path / "c")]) == 0 and len(judge_server.requests) == 2 * paid
    )


def test_JudgeCache_key_holds_every_parameter_of_a_judge_request(
    judge_server, secret_key, tmp_path
):
    """A verdict is reused only for the very request that produced it: changing any parameter the request sends
    (model, messages, temperature, max_tokens) changes the key. A parameter added to the request later fails
    this test until the key covers it."""
    base = judge_args(judge_server.url)
    trajectory = S.Trajectory("G", 0, [S.Turn("o", "r", "[1]", [], [])], 0.0)
    asked = itertools.count()

    def ask(args=base, model="judge-test", traj=trajectory) -> tuple[dict, str]:
        judge_server.requests.clear()
        ledger = tmp_path / f"ledger-{next(asked)}.jsonl"
        runner = J.JudgeRunner(
            J.OpenAIJudge(model, judge_server.url, args), args, runfiles.JudgeCache(None), ledger
        )
        S.judge_trajectories(runner, [traj], ["transferability"])
        [request], [row] = judge_server.requests, read_jsonl(ledger)
        return request["body"], row["key"]

    body, key = ask()
    varied = {
        "model": lambda: ask(model="judge-other"),
        "messages": lambda: ask(
            traj=S.Trajectory("G", 0, [S.Turn("o", "other", "[1]", [], [])], 0.0)
        ),
        "temperature": lambda: ask(S.dataclasses.replace(base, judge_temperature=0.5)),
        "max_tokens": lambda: ask(S.dataclasses.replace(base, judge_max_tokens=512)),
    }
    assert set(body) == set(varied), set(body) ^ set(varied)
    for name, vary in varied.items():
        other_body, other_key = vary()
        assert other_body[name] != body[name] and other_key != key, name
    assert ask() == (body, key)  # and the same request, the same key


def test_JudgeRunner_of_the_offline_stand_in_judges_but_writes_no_ledger_of_requests_never_made(
    one_step_run,
):
    """judge_ledger.jsonl is the record of paid requests; the offline stand-in makes none, so a run judged by it
    has no ledger (it once wrote a zero-cost line per verdict)."""
    metrics = read_jsonl(one_step_run / "metrics.jsonl")
    assert metrics[0]["judge_judged"] > 0
    assert not (one_step_run / "judge_ledger.jsonl").exists()
