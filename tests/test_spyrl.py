"""Tests for spyrl.py: SpyRL's game (games/spy.py), its rewards and advantages, whole scripted runs, resume, the
flags and the tools on SpyRL runs. The helpers (a tiny model, the run checks, the vLLM settings) are
tests/common.py's."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spyrl
import stratagem as S
from games import spy
from machinery import watch
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    HUGE,
    SMALL,
    VLLM,
    VLLM_ENV,
    assert_resumed_exactly,
    error_of,
    needs_vllm_cpu,
    no_process_left_behind,
    not_for_the_vllm_tests,
    only_the_vllm_tests,
    read_jsonl,
    run,
)


# ---- SpyRL's game: rewards, votes, groups, the mask
def test_performance_rewards_for_hand_made_tallies_are_exact_and_zero_sum():
    votes = [1, 2, 1, None, 1]  # seat 1 is the spy; seat 3 cast no valid vote
    shares = spy.vote_shares(votes, 5)
    assert shares == [0.0, 0.75, 0.25, 0.0, 0.0]
    # s_c = (0 + 0.25 + 0 + 0) / 4 = 0.0625; r_u = 1.0 * (0.0625 - 0.75); r_cj = -r_u / 4 - 0.5 * (s_cj - 0.0625)
    rewards = spy.performance_rewards(shares, spy=1, beta=1.0, lam=0.5)
    assert rewards == pytest.approx([0.203125, -0.6875, 0.078125, 0.203125, 0.203125], abs=1e-12)
    assert abs(sum(rewards)) < 1e-12
    # s_c = 1/6, r_u = 2 * (1/6 - 1/2) = -2/3; lambda 0: the civilians share the spy's loss equally
    assert spy.performance_rewards([0.0, 0.0, 0.5, 0.5], spy=3, beta=2.0, lam=0.0) == pytest.approx(
        [2 / 9, 2 / 9, 2 / 9, -2 / 3]
    )
    assert spy.detection_rewards(votes, spy=1) == [1.0, None, 1.0, 0.0, 1.0]
    assert spy.caught(votes, 1) and not spy.caught(
        [1, 2, 2, 1, 0], 1
    )  # a tie at the top does not catch the spy
    assert (
        spy.vote_shares([None] * 4, 4) == [0.0] * 4
        and spy.performance_rewards([0.0] * 4, 0, 1.0, 0.5) == [0.0] * 4
    )
    for seed in range(200):  # random tallies, any beta and lambda: the rewards of a game sum to 0
        rng = random.Random(seed)
        n = rng.randint(3, 8)
        v = [rng.choice([None, *range(n)]) for _ in range(n)]
        assert (
            abs(
                sum(
                    spy.performance_rewards(
                        spy.vote_shares(v, n), rng.randrange(n), rng.random() * 3, rng.random()
                    )
                )
            )
            < 1e-9
        )


def spy_env(seed: int = 0, **kw) -> spy.WhoIsTheSpyEnv:
    import textarena as ta

    env = ta.make(spy.GAME, **kw)
    env.reset(num_players=5, seed=seed)
    return env


def test_WhoIsTheSpyEnv_through_the_textarena_interface_pays_those_rewards():
    """Any TextArena agent loop plays it: get_observation / step(response) / close."""
    env = spy_env(next(s for s in range(100) if spy_env(s).spy == 1))
    said = {
        0: "\\boxed{1}",
        1: "\\boxed{2}",
        2: "I think \\boxed{Player 1}",
        3: "\\boxed{3}",
        4: "\\boxed{[1]}",
    }
    done, turns = False, []
    while not done:
        seat, observation = env.get_observation()
        turns.append((seat, env.phase))
        assert "one copy" in observation or "one copy was incomplete" in observation
        done, _ = env.step(f"summary by {seat}" if env.phase == "performance" else said[seat])
    assert turns == [(k, "performance") for k in range(5)] + [(k, "detection") for k in range(5)]
    rewards, info = env.close()
    assert env.votes == [1, 2, 1, None, 1]  # seat 3 voted for itself: invalid
    assert [rewards[k] for k in range(5)] == pytest.approx(
        [0.203125, -0.6875, 0.078125, 0.203125, 0.203125]
    )
    assert (
        info[1]["role"] == "spy" and info[3]["invalid_move"] and info[0]["detection_reward"] == 1.0
    )
    results = env.results()
    assert [(seat, phase) for seat, phase, _, _ in results] == [(k, 0) for k in range(5)] + [
        (0, 1),
        (2, 1),
        (3, 1),
        (4, 1),
    ]
    assert {r["key"] for _, phase, _, r in results if phase == 0} == {
        "summarize/spy",
        "summarize/civilian",
    }
    assert all(r["group"] == [1.0, 1.0, 0.0, 1.0] for _, phase, _, r in results if phase == 1)
    assert "Player 3:\n| summary by 3" in env.observation(
        0
    )  # every output is quoted in the vote prompt


@pytest.mark.parametrize(
    "response, seat, vote",
    [
        ("\\boxed{2}", 0, 2),
        ("first \\boxed{1} then \\boxed{ Player 3 }", 0, 3),
        ("\\boxed{[4]}", 1, 4),
        ("\\boxed{0}", 0, None),
        ("\\boxed{5}", 0, None),
        ("\\boxed{two}", 0, None),
        ("Player 2", 0, None),
        ("<think>\\boxed{1}</think> so \\boxed{2}", 0, 2),
        ("<think>\\boxed{1}</think> no box", 0, None),
    ],
)
def test_parse_vote_reads_the_seat_in_the_last_box(response, seat, vote):
    assert spy.parse_vote(response, seat, 5) == vote


def test_parse_vote_takes_an_oversized_vote_as_invalid():
    assert spy.parse_vote("\\boxed{" + HUGE + "}", 0, 5) is None
    assert spy.parse_vote("\\boxed{Player " + "0" * 5000 + "3}", 0, 5) is None
    assert spy.parse_vote("\\boxed{3}", 0, 5) == 3


def grpo(rewards: list[float], moved: list[bool] | None = None) -> list[float]:
    trajs = [
        S.Trajectory(spy.GAME, k, [S.Turn("", "", "", [], [])] if m else [], r)
        for k, (r, m) in enumerate(zip(rewards, moved or [True] * len(rewards)))
    ]
    S.group_advantages([trajs])
    return [t.a_game for t in trajs]


def test_group_advantages_are_group_relative():
    # mean 0.75, population std sqrt(0.1875)
    eps = 1e-6
    assert grpo([1.0, 1.0, 0.0, 1.0]) == pytest.approx(
        [0.25 / (math.sqrt(0.1875) + eps)] * 2
        + [-0.75 / (math.sqrt(0.1875) + eps), 0.25 / (math.sqrt(0.1875) + eps)]
    )
    assert grpo([1.0, 1.0, 1.0]) == [0.0] * 3 and grpo([0.0, 0.0]) == [0.0] * 2
    assert sum(grpo([0.0, 1.0, 1.0, 0.0, 1.0])) == pytest.approx(0.0, abs=1e-9)


def test_group_advantages_put_a_seat_that_never_moved_in_no_group():
    """Its reward would move the others' mean; it has no tokens, so its A_game stays 0."""
    assert grpo([1.0, 0.0, 5.0], [True, True, False]) == pytest.approx(
        [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0]
    )
    assert grpo([1.0, -3.0], [False, False]) == [0.0, 0.0]


def test_WhoIsTheSpyEnv_reset_draws_the_spy_seat_uniformly_over_seeds():
    env = spy_env()
    counts = [0] * 5
    for seed in range(5000):
        env.reset(num_players=5, seed=seed)
        counts[env.spy] += 1
    chi2 = sum((c - 1000) ** 2 / 1000 for c in counts)
    assert chi2 < 18.47, counts  # chi-square, 4 degrees of freedom, p = 0.001
    env.reset(num_players=5, seed=7)
    assert env.inputs.count(env.item["text"]) == 4  # four civilians see x, one seat sees g(x)


def is_subsequence(part: str, whole: str) -> bool:
    it = iter(whole)
    return all(ch in it for ch in part)


@pytest.mark.parametrize("fraction", [0.2, 0.4])
def test_degrade_removes_its_fraction_and_the_spy_sees_a_subsequence(fraction):
    texts = [t["text"] for t in spy.default_texts()[:40]] + [
        "Solve for x: 2x + 3 = 11, then add four to it.",
        "A farmer has 17 sheep and all but 9 run away.",
        "Write a story. It is about a lighthouse keeper who finds a letter in a bottle that is addressed to him.",
    ]
    kinds = set()
    for k, text in enumerate(texts):
        kept, removed = spy.degrade(text, fraction, random.Random(k))
        by_sentence = spy.split_units(text, sentences=True)
        units = by_sentence if len(by_sentence) >= 1 / fraction else spy.split_units(text)
        kinds.add("sentences" if units is by_sentence else "words")
        assert "".join(text[a:b] for a, b in units) == text  # the units tile x
        assert (
            len(removed) == math.floor(fraction * len(units) + 0.5) >= 1
        )  # the fraction, rounded half up
        assert all(span in units for span in removed)  # whole sentences (or words), nothing else
        assert (
            kept == "".join(text[a:b] for a, b in units if (a, b) not in removed).rstrip()
        )  # no marker left
        assert is_subsequence(kept, text) and len(kept) < len(text)
    assert kinds == {"sentences", "words"}


def test_removed_count_rounds_half_up_at_an_exact_half():
    assert [
        spy.removed_count(n, f) for n, f in [(5, 0.5), (4, 0.5), (3, 0.5), (5, 0.1), (15, 0.1)]
    ] == [3, 2, 2, 1, 2]
    text = "One is here. Two is here. Three is here. Four is here. Five is here."
    kept, removed = spy.degrade(text, 0.5, random.Random(0))
    assert len(removed) == 3 and len(spy.split_units(kept, sentences=True)) == 2


def test_trained_phases_alternate_the_phase_of_each_step():
    assert [spy.trained_phases(s, 1) for s in (1, 2, 3, 4)] == [
        ("performance",),
        ("detection",),
    ] * 2
    assert [spy.trained_phases(s, 2)[0] for s in range(1, 7)] == ["performance"] * 2 + [
        "detection"
    ] * 2 + ["performance"] * 2
    assert spy.trained_phases(5, 0) == ("performance", "detection")
    assert (
        spy.games_needed(12, 5, ("performance",)) == 3
        and spy.games_needed(12, 5, ("detection",)) == 3
    )
    assert (
        spy.games_needed(13, 5, ("performance",)) == 3
        and spy.games_needed(13, 5, ("detection",)) == 4
    )
    assert spy.games_needed(18, 5, spy.PHASES) == 2


def test_outcomes_count_a_spy_game_without_a_valid_vote_as_a_draw():
    """No valid vote: every share is 0, r^P = 0 for every seat, and the spy neither won nor lost."""
    env = spy_env(0)
    for k in range(5):
        env.step(f"summary {k}")
    for _ in range(5):
        env.step("I cannot tell.")  # no \\boxed{}: an invalid vote
    trajs = [S.Trajectory(spy.GAME, p, [], r, info=info) for p, _, r, info in env.results()]
    counts = spy.outcomes(trajs)[spy.GAME]
    assert counts == {
        "spy": {"win": 0, "draw": 1, "loss": 0, "invalid": 1},
        "civilian": {"win": 0, "draw": 4, "loss": 0, "invalid": 4},
    }


# ---- Whole scripted SpyRL runs, resumed, shown
def scripted_spy_player(prompt: str) -> str:
    """A deterministic player: it writes its copy's word count, so the spy's output differs; as a voter it
    names the odd output out, except Player 0, which names the seat after it (a wrong vote, so the GRPO
    group varies), and the odd one out itself, which names its neighbour."""
    text = prompt.split("user\n", 1)[1].split("<|im_end|>", 1)[0]
    seat = int(re.search(r"You are Player (\d+)", text).group(1))
    if "Your copy of the" not in text:
        return f"{len(text.split('The document:', 1)[1].split())} words"
    outputs = dict((int(k), v) for k, v in re.findall(r"Player (\d+):\n\| (.*)", text))
    odd = next(k for k, v in outputs.items() if list(outputs.values()).count(v) == 1)
    vote = (seat + 1) % 5 if seat == odd else (odd + 1) % 5 or 2 if seat == 0 else odd
    return f"The odd one is clear. \\boxed{{{vote}}}"


class ScriptedSpyGenerate:
    """HFPolicy.generate replaced by scripted_spy_player (the learner still learns from these tokens)."""

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, policy, prompts):
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            text = scripted_spy_player(p)
            out.append(
                (
                    policy.tok(p, add_special_tokens=False).input_ids,
                    policy.tok(text).input_ids,
                    text,
                )
            )
        return out


def spy_data(path: Path, n: int = 6) -> Path:
    """Texts with a reference each: the civilians' scripted output itself, so their ROUGE-L is 1 exactly."""
    rows = [
        {"text": t["text"], "reference": f"{len(t['text'].split())} words"}
        for t in spy.default_texts()[:n]
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def spy_runs(tmp_path_factory):
    """One scripted SpyRL run of 3 steps (and a copy stopped after 2, resumed), with every policy update recorded."""
    not_for_the_vllm_tests()
    tmp = tmp_path_factory.mktemp("spy")
    data = spy_data(tmp / "data.jsonl")
    generate, update, updates = ScriptedSpyGenerate(), S.policy_update, []

    def recorded(run, trajs, normaliser):
        updates.append(
            (
                [(t.info["phase"], t.info["role"]) for t in trajs],
                normaliser,
                run.reference is not None,
            )
        )
        return update(run, trajs, normaliser)

    flags = SMALL + ["--spy-data", str(data), "--steps", "3", "--save-every", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S.HFPolicy, "generate", lambda policy, prompts: generate(policy, prompts))
        mp.setattr(S, "policy_update", recorded)
        assert spyrl.main(flags + ["--out", str(tmp / "whole")]) == 0
        calls, whole_updates = list(generate.calls), list(updates)
        assert (
            spyrl.main(
                flags[:-4] + ["--steps", "2", "--save-every", "1", "--out", str(tmp / "part")]
            )
            == 0
        )
        assert spyrl.main(["--resume", "--out", str(tmp / "part"), "--steps", "3"]) == 0
    return {"tmp": tmp, "calls": calls, "updates": whole_updates, "data": data}


def test_spy_play_rewards_baselines_and_advantages_of_a_spyrl_run_replay_from_the_files(spy_runs):
    out = spy_runs["tmp"] / "whole"
    config = json.loads((out / "config.json").read_text())
    assert (
        config["kl_coef"] == 0.04 and config["spy_mask"] == 0.2 and config["mode"] == "spyrl"
    )  # SpyRL's KL
    metrics, trajs = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "trajectories.jsonl")
    games: dict = {}
    for t in trajs:
        games.setdefault((t["step"], t["info"]["seed"]), []).append(t)
    baselines: dict = {}
    for rows in games.values():
        g = rows[0]["info"]
        outputs = sorted(
            (t for t in rows if t["info"]["phase"] == "performance"), key=lambda t: t["role"]
        )
        votes = [t for t in rows if t["info"]["phase"] == "detection"]
        assert [t["role"] for t in outputs] == list(range(5)) and len(
            votes
        ) == 4  # the spy's vote is not a trajectory
        assert [t["info"]["role"] == "spy" for t in outputs] == [k == g["spy"] for k in range(5)]
        expected = spy.performance_rewards(spy.vote_shares(g["votes"], 5), g["spy"], 1.0, 0.5)
        assert [t["reward"] for t in outputs] == pytest.approx(expected) and abs(
            sum(expected)
        ) < 1e-9
        civilians = [1.0 if g["votes"][k] == g["spy"] else 0.0 for k in range(5) if k != g["spy"]]
        for t in (
            votes
        ):  # r^D = 1[v = u]; A = (r - mean) / (std + eps) over the game's civilians, not a baseline
            assert (
                t["reward"] == float(g["votes"][t["role"]] == g["spy"])
                and t["info"]["role"] == "civilian"
            )
            mean = sum(civilians) / 4
            std = math.sqrt(sum((c - mean) ** 2 for c in civilians) / 4)
            assert (
                t["a_game"] == pytest.approx((t["reward"] - mean) / (std + 1e-6))
                and t["a_mod"] == t["a_game"]
            )
        for t in outputs:  # RAE keyed by (task, role), read before it is updated
            key = f"summarize/{t['info']['role']}"
            b = baselines.get(key, 0.0)
            assert t["baseline"] == pytest.approx(b) and t["a_game"] == pytest.approx(
                t["reward"] - b
            )
            baselines[key] = 0.95 * b + 0.05 * t["reward"]
    assert metrics[-1]["baselines"] == pytest.approx(baselines) and set(baselines) == {
        "summarize/spy",
        "summarize/civilian",
    }
    assert (
        baselines["summarize/spy"] < 0 < baselines["summarize/civilian"]
    )  # kept apart: the scripted spy is caught
    assert any(t["a_game"] != 0 for t in trajs if t["info"]["phase"] == "detection")


def test_spy_play_makes_two_generate_calls_per_wave_and_spyrl_metrics_alternate(spy_runs):
    out = spy_runs["tmp"] / "whole"
    metrics = read_jsonl(out / "metrics.jsonl")
    # batch 12: 3 games a step (12 / 5 outputs, 12 / 4 votes), --num-envs 4: one wave, two calls of 15 prompts
    assert spy_runs["calls"] == [15, 15] * 3 and [m["generate_calls"] for m in metrics] == [2, 2, 2]
    assert [m["spy"]["trained"] for m in metrics] == ["performance", "detection", "performance"]
    phases = [{p for p, _ in u[0]} for u in spy_runs["updates"]]
    assert phases == [
        {"performance"},
        {"detection"},
        {"performance"},
    ]  # only this step's turns are learnt from
    assert all(role == "civilian" for p, role in spy_runs["updates"][1][0])
    assert [u[1] for u in spy_runs["updates"]] == [
        15 * 16,
        12 * 16,
        15 * 16,
    ]  # normaliser: trained turns x tokens
    assert all(u[2] for u in spy_runs["updates"])  # the KL's reference is passed
    assert all(
        m["kl"] > 0 for m in metrics
    )  # the policy leaves its start (step 1's second epoch follows an update)
    ppo = [
        m["ppo"] for m in metrics
    ]  # the clipped objective: epoch 1 is the policy that played, epoch 2 is not
    assert all(p["ratio_mean"][0] == 1 and p["clip_frac"][0] == 0 for p in ppo)
    assert all(p["ratio_mean"][1] != 1 and 0 <= p["clip_frac"][1] <= 1 for p in ppo)
    trajs = read_jsonl(out / "trajectories.jsonl")
    for m in metrics:
        s, rows = m["spy"], [t for t in trajs if t["step"] == m["step"]]
        votes = [t for t in rows if t["info"]["phase"] == "detection"]
        games = [
            t["info"]
            for t in rows
            if t["info"]["phase"] == "performance" and t["info"]["role"] == "spy"
        ]
        assert (
            s["games"] == m["episodes"] == 3
            and m["trajectories"] == 27
            and s["trained_transitions"] in (15, 12)
        )
        assert s["detection_accuracy"] == pytest.approx(
            sum(t["reward"] for t in votes) / len(votes)
        )
        assert s["caught_rate"] == pytest.approx(sum(g["caught"] for g in games) / 3)
        assert s["invalid_vote_rate"] == pytest.approx(
            sum(v is None for g in games for v in g["votes"]) / 15
        )
        assert (
            s["zero_sum_residual"] < 1e-9 and s["rouge_l"] == 1.0
        )  # civilians only: the spy's would be 0.5
        assert s["reward"]["spy"] == pytest.approx(
            sum(t["reward"] for t in rows if t["info"]["role"] == "spy") / 3
        )
        assert m["games"]["WhoIsTheSpy-v0"]["spy"]["loss"] == sum(g["caught"] for g in games)
    tags = watch.scalars(metrics[0])
    for tag in (
        "spy/detection_accuracy",
        "spy/caught_rate",
        "spy/invalid_vote_rate",
        "spy/zero_sum_residual",
        "spy/reward/spy",
        "spy/advantage/civilian",
        "spy/rouge_l",
        "adv/baselines/summarize/spy",
        "update/kl",
    ):
        assert tag in tags


def test_resume_of_a_spyrl_run_is_exact(spy_runs):
    """The KL's reference after a resume is the run's initial policy (rebuilt), not the checkpoint."""
    assert_resumed_exactly(spy_runs["tmp"] / "whole", spy_runs["tmp"] / "part", 3)


def test_show_spy_game_renders_a_whole_spy_game(spy_runs, capsys):
    out = spy_runs["tmp"] / "whole"
    assert run(["show", str(out), "--step", "2", "--index", "1"]) == 0
    printed = capsys.readouterr().out
    rows = [t for t in read_jsonl(out / "trajectories.jsonl") if t["step"] == 2]
    g = [t["info"] for t in rows][
        9
    ]  # the second game's first line (9 lines a game: 5 outputs, 4 votes)
    text = [t for t in rows[9:18] if t["info"]["role"] == "civilian"][0]["turns"][0][
        "observation"
    ].split("The document:\n")[1]
    assert f"the spy: Player {g['spy']}" in printed and f"seed {g['seed']}" in printed
    for a, b in g["removed"]:
        assert f"[-{text[a:b].strip()}-]" in printed
    for k in range(5):
        assert f"--- Player {k} ({'spy' if k == g['spy'] else 'civilian'}) ---" in printed
    assert "spy caught: " in printed and "r^D = " in printed and "the spy's vote" in printed


def test_bench_spyrl_reports_calls_per_game_beside_stratagem(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert (
        run(
            [
                "bench",
                "--json",
                str(out),
                "--tiny",
                "--mode",
                "spyrl",
                "--steps",
                "2",
                "--batch-size",
                "8",
                "--num-envs",
                "4",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    res = read_jsonl(out)[0]["results"]
    assert set(res) == {"spyrl", "stratagem"}
    # step 2 trains the votes: ceil(8 / 4) = 2 games in one wave, two generate calls
    # STRATAGEM's games share its calls (lockstep); a tiny model's games end on its first move (no action loses)
    assert (
        res["spyrl"]["generate_calls_per_game"] == 1.0
        and 0 < res["stratagem"]["generate_calls_per_game"] < 1.0
    )
    assert res["spyrl"]["tokens_per_s"] > 0 and res["stratagem"]["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert (
        re.search(r"generate calls per game\s+1\.00\s+\d", printed)
        and "spyrl   stratagem" in printed
    )


def spyrl_script(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(HERE / "spyrl.py"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=VLLM_ENV,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@needs_vllm_cpu
@pytest.mark.slow
def test_spy_play_on_vllm_plays_spy_games_and_resumes_exactly(tmp_path):
    """The vLLM engine plays SpyRL's waves: two generate calls a step, every seat's prompt in each."""
    spyrl_script(SMALL + VLLM + ["--steps", "2", "--out", "whole"], tmp_path)
    metrics, trajs = (
        read_jsonl(tmp_path / "whole/metrics.jsonl"),
        read_jsonl(tmp_path / "whole/trajectories.jsonl"),
    )
    assert [m["generate_calls"] for m in metrics] == [2, 2] and [
        m["spy"]["games"] for m in metrics
    ] == [3, 3]
    assert [m["spy"]["trained"] for m in metrics] == ["performance", "detection"] and metrics[-1][
        "response_tokens"
    ] > 0
    votes = [t for t in trajs if t["info"]["phase"] == "detection"]
    assert len(votes) == 2 * 3 * 4 and all(
        "Player 4:\n| " in t["turns"][0]["observation"] for t in votes
    )
    spyrl_script(SMALL + VLLM + ["--steps", "1", "--out", "part"], tmp_path)
    assert (
        "resuming" in spyrl_script(["--resume", "--out", "part", "--steps", "2"], tmp_path).stdout
    )
    assert read_jsonl(tmp_path / "part/trajectories.jsonl") == trajs


# ---- The flags and the data, checked in one line
def test_resolve_args_of_spyrl_defaults_follow_the_script_and_task():
    assert spyrl.resolve_args({}).kl_coef == 0.04 and S.resolve_args({}).kl_coef == 0.0
    assert (
        spyrl.resolve_args({}).ppo_epochs == 2 and S.resolve_args({}).ppo_epochs == 1
    )  # the clip binds
    assert spyrl.resolve_args({"kl_coef": 0.0}).kl_coef == 0.0  # an explicit flag wins
    assert spyrl.resolve_args({"spy_task": "math"}).spy_mask == 0.4
    assert spyrl.resolve_args({"spy_task": "math", "spy_mask": 0.3}).spy_mask == 0.3
    assert spyrl.resolve_args({"spy_task": "write"}).spy_mask == 0.2
    text = " ".join(spyrl.build_parser().format_help().split())
    assert "(default: 0.04)" in text and "(default: 0.2; with --spy-task math: 0.4)" in text
    assert (
        "--judge-model" not in text and "--beta " not in text and "--games" not in text
    )  # a judge-free script


def test_mode_spyrl_is_spyrl_pys_and_each_script_resumes_only_its_own_runs(capsys, tmp_path):
    err = error_of(capsys, ["--tiny", "--mode", "spyrl", "--out", str(tmp_path / "r")])
    assert "spyrl.py" in err and not (tmp_path / "r").exists()
    assert (
        spyrl.main(
            [
                "--tiny",
                "--steps",
                "1",
                "--batch-size",
                "4",
                "--max-new-tokens",
                "4",
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    for resume, script in ((run, "spyrl.py"), (lambda argv: spyrl.main(argv), "stratagem.py")):
        out = tmp_path / ("s" if script == "spyrl.py" else "t")
        if script == "stratagem.py":
            assert run(SMALL + ["--steps", "1", "--out", str(out)]) == 0
            capsys.readouterr()
        assert resume(["--resume", "--out", str(out), "--steps", "2"]) == 2
        assert f"continue it with python {script} --resume" in capsys.readouterr().err


def spy_error_of(capsys, argv) -> str:
    assert spyrl.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("spyrl: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--spy-players", "2"], "--spy-players must be >= 3, got 2"),
        (["--spy-players", "1000000000"], "--spy-players must be <= 1000, got 1000000000"),
        (["--spy-mask", "1"], "--spy-mask must be in (0, 1), got 1.0"),
        (["--spy-task", "poems"], "invalid choice: 'poems'"),
        (["--kl-coef", "-0.1"], "--kl-coef must be >= 0, got -0.1"),
    ],
)
def test_validate_refuses_bad_spyrl_flags(capsys, tmp_path, argv, message):
    assert message in spy_error_of(capsys, ["--tiny", *argv, "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


def test_spy_data_is_needed_without_tiny_and_references_need_rouge(capsys, tmp_path, monkeypatch):
    assert "spyrl.py needs --spy-data FILE.jsonl" in spy_error_of(
        capsys, ["--out", str(tmp_path / "r")]
    )
    data = spy_data(tmp_path / "data.jsonl", n=2)
    monkeypatch.setitem(sys.modules, "rouge_score", None)
    spy.rouge_scorer.cache_clear()
    try:
        err = spy_error_of(
            capsys, ["--tiny", "--spy-data", str(data), "--out", str(tmp_path / "r")]
        )
    finally:
        spy.rouge_scorer.cache_clear()
    assert "pip install rouge-score" in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "--spy-data {file}: No such file or directory"),
        (
            b'{"text": "One two three four five six seven."}\n{oops\n',
            "--spy-data {file}, line 2: not JSON",
        ),
        (
            b'{"text": "One two three four five six seven."}\n\n{"reference": "x"}\n',
            '--spy-data {file}, line 3: needs an object with a non-empty "text" string',
        ),
        (
            b'["text"]\n',
            '--spy-data {file}, line 1: needs an object with a non-empty "text" string',
        ),
        (b"\nnull\n", '--spy-data {file}, line 2: needs an object with a non-empty "text" string'),
        (
            b'{"text": "Hi there"}\n',
            "--spy-data {file}, line 1: the text is too short to degrade (2 word(s)",
        ),
        (
            b'{"text": "caf\xe9 au lait et croissant"}\n',
            "--spy-data {file}, line 1: not UTF-8 (byte 0xe9 at column 14)",
        ),
        (
            b'{"text": "One two three four five six.", "reference": 3}\n',
            '--spy-data {file}, line 1: "reference" must be a string',
        ),
        (b"\n\n", "--spy-data {file}: no texts in it"),
    ],
)
def test_load_texts_ends_bad_spy_data_in_one_line_naming_file_and_line(
    capsys, tmp_path, content, message
):
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_bytes(content)
    err = spy_error_of(
        capsys, ["--tiny", "--spy-data", str(data), "--out", str(tmp_path / "never")]
    )
    assert message.format(file=data) in err and not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"text": "One is here. Two \\ud800 is here. Three is here. Four is here. Five is here."}\n',
            "line 1: the text holds a lone surrogate (\\ud800), which is not text",
        ),
        (
            '{"text": "One is here. Two is here. Three is here. Four is here. Five is here."}\n'
            '{"text": "One is here. Two is here. Three is here. Four is here.", "reference": "\\udfff"}\n',
            "line 2: the reference holds a lone surrogate (\\udfff), which is not text",
        ),
        ("[" * 100_000 + "\n", "line 1: nested too deeply"),
        (
            json.dumps({"text": "A word here. " * 1600})
            + "\n",  # 20 kB, the tiny model's context 16384 tokens
            "line 1: the text takes up to 20799 tokens, and a game's prompts leave it room for 14955 (the model",
        ),
    ],
    ids=["lone surrogate", "in a reference", "deep nesting", "longer than the context"],
)
def test_spy_data_is_checked_whole_before_the_run_folder_is_made(
    capsys, tmp_path, content, message
):
    data = tmp_path / "data.jsonl"
    data.write_text(content, encoding="utf-8", errors="surrogatepass")
    err = spy_error_of(
        capsys,
        ["--tiny", "--steps", "1", "--spy-data", str(data), "--out", str(tmp_path / "never")],
    )
    assert err.startswith(f"spyrl: error: --spy-data {data}, {message}"), err
    assert not (tmp_path / "never").exists()
