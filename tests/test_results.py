"""Tests that what a run reports is what happened: a game's result is decided once (stratagem.settle) from
what training pays, and the step line, metrics.jsonl, the trajectories and the evaluations agree on it; the
commands a run suggests play what they say in minutes and say where they are in a log."""

from __future__ import annotations

import json
import random
import re
import shlex
from types import SimpleNamespace

import stratagem as S
from machinery import opponents, watch
from machinery.matches import summarize_matches
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    SMALL,
    ScriptedPolicy,
    error_of,
    first_free,
    fresh,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    tiny_fixture,
)


def takes_a_taken_cell(monkeypatch) -> None:
    """The tiny model's words replaced: Player 0 takes the first free cell, Player 1 then names cell 0,
    which Player 0 holds: TicTacToe-v0 rejects it, and with no retry left Player 1 loses (SPIRAL's games
    pay the other seat 0 there, training pays --rejected-rewards)."""
    generate = S.HFPolicy.generate

    def scripted(self, prompts):
        said = generate(self, prompts)  # the model's own token ids, so that the update has some
        texts = [first_free(p) if "as Player 0." in p else "\\boxed{[0]}" for p in prompts]
        return [(p, r, text) for (p, r, _), text in zip(said, texts)]

    monkeypatch.setattr(S.HFPolicy, "generate", scripted)


def test_settle_a_rejected_move_agrees_in_the_step_line_the_metrics_and_the_rewards(
    tmp_path, capsys, monkeypatch
):
    takes_a_taken_cell(monkeypatch)
    out = tmp_path / "run"
    flags = ["--games", "TicTacToe-v0", "--error-allowance", "0", "--steps", "1"]
    assert run(SMALL + flags + ["--out", str(out)]) == 0
    [m] = read_jsonl(out / "metrics.jsonl")
    trajs = read_jsonl(out / "trajectories.jsonl")
    n = m["episodes"]
    assert n >= 2 and len(trajs) == 2 * n
    assert all(
        t["reward"] == (1.0 if t["role"] == 0 else -1.0) and t["turns"][0]["action"] for t in trajs
    )
    cell = lambda w, d, l_, bad: {"win": w, "draw": d, "loss": l_, "invalid": bad}  # noqa: E731
    assert m["games"] == {
        "TicTacToe-v0": {"player0": cell(n, 0, 0, 0), "player1": cell(0, 0, n, n)}
    }
    step = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step 1/1 | "))
    assert (
        f"| {n} games (won-drawn-lost {n}-0-0 by the first seat; {n} lost on an invalid move)"
        in step
    )


def test_settle_a_rejected_move_loses_for_its_maker_and_wins_for_the_other_whatever_it_pays():
    """SPIRAL's payout of a rejected move (-1 to its maker, 0 to the other seat) changes what training pays,
    not who won: the result is the game's, the same under any --rejected-rewards."""
    for rejected, paid in (((-1.0, 1.0), 1.0), ((-1.0, 0.0), 0.0)):
        env = S.make_env("TicTacToe-v0", 0, 0)
        env.step("[0]")
        done, _ = env.step("[0]")  # Player 1 names Player 0's cell
        ep = S.Episode("TicTacToe-v0", env, done=done)
        results, invalid, rewards = S.settle(ep, S.Rules(rejected_rewards=rejected))
        assert results == {0: "win", 1: "loss"} and invalid == {0: False, 1: True}
        assert rewards == {0: paid, 1: -1.0}


def test_finish_episode_tallies_a_fixed_opponents_rejected_move_as_the_learners_win():
    """--opponents: a past policy's rejected move is the learner's win, as paid; the learner made no invalid move."""
    args = S.Args(tiny=True)
    versus = opponents.Versus(SimpleNamespace(args=args))
    env = S.make_env("TicTacToe-v0", 0, 0)
    env.step("[0]")  # the learner, seat 0
    done, _ = env.step("[0]")  # the opponent
    ep = S.Episode("TicTacToe-v0", env, seat=0, kind="past", done=done)
    [traj] = S.finish_episode(ep, {}, args.rules, versus)
    assert traj.reward == 1.0
    assert versus.results == {
        "past": {"TicTacToe-v0": {"win": 1, "draw": 0, "loss": 0, "invalid": 0}}
    }


class TakesCellZero:
    """An opponent that always names cell 0: taken by the model in its seat-0 games, where the game rejects it."""

    name, failures = "cell-zero", 0

    def act(self, jobs):
        return ["[0]" for _ in jobs]


def test_play_matches_counts_the_opponents_rejected_move_as_the_models_win(tiny, capsys):
    """In an evaluation too: the opponent naming a taken cell loses, and the summary and eval's table say how many
    of the model's wins came so."""
    from tools import eval as eval_tool

    _, tok = fresh(tiny)
    games = S.schedule(["TicTacToe-v0"], 2, random.Random(0))
    records = S.play_matches(ScriptedPolicy(first_free), tok, TakesCellZero(), games, S.Rules(), 4)
    assert [
        (r["seat"], r["outcome"], r["reward"], r["invalid"], r["opponent_invalid"]) for r in records
    ] == [
        (0, "win", 1.0, False, True),  # the model opened with cell 0
        (1, "win", 1.0, False, True),  # the opponent took cell 0 first, and named it again
    ]
    summary = summarize_matches(records)
    cell = summary["games"]["TicTacToe-v0"]["both"]
    assert (cell["win"]["count"], cell["draw"]["count"], cell["opponent_invalid"]["count"]) == (
        2,
        0,
        2,
    )
    eval_tool.print_matches(summary, "cell-zero", {})
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "won on the opponent's invalid move: TicTacToe-v0 2 of 2"
    )


# ---- eval plays the games it says it plays
def a_run(folder, **config) -> str:
    """A run's folder as eval finds one: its config.json and a checkpoints folder."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_eval_opponent_minimax_refuses_a_runs_eval_games_it_cannot_play_before_anything_loads(
    tmp_path, capsys, monkeypatch
):
    from tools import eval as eval_tool

    def never(*a):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(eval_tool, "load_model", never)
    run_dir = a_run(tmp_path / "kuhn", games="KuhnPoker-v1", eval_games="KuhnPoker-v1")
    err = error_of(capsys, ["eval", run_dir, "--opponent", "minimax"])
    assert err == (
        f"stratagem: error: {run_dir} is evaluated on its --eval-games, and minimax plays TicTacToe-v0 only, "
        "not KuhnPoker-v1: give --games TicTacToe-v0\n"
    )
    assert not list((tmp_path / "kuhn").glob("eval-*.json"))


def no_model(monkeypatch) -> list:
    """eval with no model to load or play: each game a draw. Returns the schedules it was given."""
    from tools import eval as eval_tool

    played = []
    monkeypatch.setattr(eval_tool, "load_model", lambda *a: (None, None))
    monkeypatch.setattr(eval_tool, "HFPolicy", lambda *a: SimpleNamespace(close=lambda: None))

    def matches(policy, tok, opponent, games, *a):
        played.append(games)
        return [
            dict(index=i, game=g, seat=s, turns=1, capped=False, outcome="draw", invalid=False,
                 opponent_invalid=False, reward=0.0, moves=[])
            for i, (g, s, *_) in enumerate(games)
        ]  # fmt: skip

    monkeypatch.setattr(eval_tool, "play_matches", matches)
    return played


def test_eval_opponent_minimax_plays_the_games_given_or_a_runs_own(tmp_path, capsys, monkeypatch):
    schedules = no_model(monkeypatch)
    kuhn = a_run(tmp_path / "kuhn", games="KuhnPoker-v1", eval_games="KuhnPoker-v1")
    assert run(["eval", kuhn, "--opponent", "minimax", "--games", "TicTacToe-v0", "--n", "2"]) == 0
    ttt = a_run(tmp_path / "ttt", games="TicTacToe-v0", eval_games="TicTacToe-v0")
    assert run(["eval", ttt, "--opponent", "minimax", "--n", "2"]) == 0
    assert [{g for g, *_ in games} for games in schedules] == [{"TicTacToe-v0"}, {"TicTacToe-v0"}]
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("eval: ")]
    assert said[0].endswith("trained on none of these; unseen: TicTacToe-v0; 2 games, 2 of each")
    assert said[1].endswith("trained on TicTacToe-v0; unseen: none; 2 games, 2 of each")


def test_settings_keep_a_runs_first_last_to_the_games_given(tmp_path, monkeypatch):
    """A run trained with --eval-first-last TicTacToe-v0, evaluated on --games KuhnPoker-v1 (its closing line's
    advice for a run trained on Kuhn Poker): the run's first/last ids not played here are dropped, not refused."""
    schedules = no_model(monkeypatch)
    spiral = a_run(tmp_path / "r", games="KuhnPoker-v1", eval_first_last="TicTacToe-v0")
    assert run(["eval", spiral, "--games", "KuhnPoker-v1", "--n", "2"]) == 0
    assert [(g, shown) for g, _, _, shown in schedules[0]] == [("KuhnPoker-v1", False)] * 2
    both = ["--games", "TicTacToe-v0,KuhnPoker-v1", "--n", "1"]
    assert run(["eval", spiral, *both]) == 0
    assert [(g, shown) for g, _, _, shown in schedules[1]] == [
        ("TicTacToe-v0", True),
        ("KuhnPoker-v1", False),
    ]


# ---- the commands a run suggests, and where a long phase is
def test_closing_line_suggests_an_eval_of_the_training_games_that_plays_them(tmp_path, capsys):
    out = tmp_path / "run"
    assert run(SMALL + ["--games", "KuhnPoker-v1", "--steps", "1", "--out", str(out)]) == 0
    closing = capsys.readouterr().out.splitlines()[-1]
    command = shlex.split(closing.split("Next: ", 1)[1].split("  |  ")[-1])
    assert command == [
        "python",
        "stratagem.py",
        "eval",
        str(out),
        "--games",
        "KuhnPoker-v1",
        "--n",
        "20",
    ]
    assert S.main(command[2:]) == 0
    played = json.loads((out / "eval-1.json").read_text())
    assert {g["game"] for g in played["games"]} == {"KuhnPoker-v1"} and played["summary"]["n"] == 20


def test_lines_say_where_a_phase_is_off_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(watch, "LINE_EVERY", 0.0)
    lines = watch.Lines("eval vs random", 4, "games")
    lines(0)  # nothing done yet: nothing to say
    lines(1)
    lines(4)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2 and re.fullmatch(
        r"eval vs random: 1/4 games, \d+s, about \d+s left", said[0]
    )
    assert re.fullmatch(r"eval vs random: 4/4 games, \d+s", said[1])


def test_eval_says_where_it_is_in_a_log(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(watch, "LINE_EVERY", 0.0)
    argv = ["eval", str(tiny), "--games", "KuhnPoker-v1", "--n", "2", "--max-new-tokens", "8"]
    assert run([*argv, "--json", str(tmp_path / "e.json")]) == 0
    assert re.search(r"^eval vs random: 2/2 games, \d+s$", capsys.readouterr().out, re.MULTILINE)


def test_warmstart_says_each_phase_before_it_begins(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(watch, "LINE_EVERY", 0.0)
    flags = ["--steps", "2", "--moves", "6", "--batch-size", "2", "--games", "TicTacToe-v0"]
    assert run(["warmstart", str(tmp_path / "w"), *flags]) == 0
    said = capsys.readouterr().out.splitlines()
    phases = [x for x in said if x.startswith("warmstart: ") and " moves, " not in x]
    assert phases == [
        "warmstart: building a random tiny-warm model ...",
        "warmstart: playing the random legal player's games to learn from: 6 moves of TicTacToe-v0",
        phases[2],
        "warmstart: 2 steps of batch 2, a line every 2 steps",
    ]
    assert re.fullmatch(r"warmstart: tokenizing \d+ moves", phases[2])
    games = said[2 : said.index(phases[2])]  # the random games' lines, in a log
    assert games and re.fullmatch(
        r"warmstart: random games of TicTacToe-v0: 6/6 moves, \d+s", games[-1]
    )
    assert said[-2].startswith("step 2/2 loss ") and said[-1].startswith("built in ")


def test_closing_line_of_spyrl_says_training_further_takes_as_long_again(tmp_path, capsys):
    import spyrl

    out = tmp_path / "spy"
    assert spyrl.main(SMALL + ["--steps", "1", "--out", str(out)]) == 0
    closing = capsys.readouterr().out.splitlines()[-1]
    assert closing.startswith(
        f"done: 1 step in {out} (metrics.jsonl, trajectories.jsonl, checkpoints/)"
    )
    assert "checkpoints/); training it 1 more step takes about as long as these. Next: " in closing
    assert closing.endswith(f"python spyrl.py --resume --out {out} --steps 2")
