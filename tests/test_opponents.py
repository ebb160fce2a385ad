"""--opponents: self-play against the policy itself, a pool of past policies and the random legal
player (machinery/opponents.py)."""

from __future__ import annotations

import os
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import stratagem as S
from machinery import UserError, opponents
from machinery.distributed import Dist
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    SMALL,
    assert_resumed_exactly,
    error_of,
    fresh,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    tiny_fixture,
)

MIX = ["--opponents", "self=0.5,past=0.25,random=0.25", "--past-every", "1"]


@pytest.mark.parametrize(
    "spec, why",
    [
        ("self=0.5,past=0.6", "the shares must sum to 1, got 1.1"),
        ("self=0.5,past=0.3", "the shares must sum to 1, got 0.8"),  # below 1 too
        ("random=0.999", "the shares must sum to 1, got 0.999"),
        ("self=1.2,random=-0.2", "random's share must be a number >= 0, got '-0.2'"),
        ("self=0.5,mirror=0.5", "unknown kind 'mirror' (kinds: self, past, random)"),
        ("self=0.5,self=0.5", "self's share is given twice"),
        ("self=half,random=0.5", "self's share must be a number >= 0, got 'half'"),
        ("self", "self's share must be a number >= 0, got ''"),
    ],
)
def test_parse_refuses_bad_shares_in_one_line(capsys, spec, why):
    err = error_of(capsys, ["--tiny", "--opponents", spec, "--dry-run"])
    assert err == f"stratagem: error: --opponents: {why}\n"


def test_parse_keeps_the_kinds_with_a_share_and_check_refuses_past_flags_without_past(capsys):
    assert opponents.parse("self=0.6, past=0.2,random=0.2") == {
        "self": 0.6,
        "past": 0.2,
        "random": 0.2,
    }
    assert opponents.parse("self=1,random=0") == {"self": 1.0}
    for flag in ("--past-every", "--past-pool"):
        err = error_of(capsys, ["--tiny", flag, "2", "--opponents", "self=0.5,random=0.5"])
        assert err == (
            f"stratagem: error: {flag} shapes the past pool: give --opponents with a past share\n"
        )


class Engine:
    """A stand-in engine: Versus builds the past policies' one from the learner's type."""

    def __init__(self, model, tokenizer, args, device):
        self.model, self.room = model, None


def versus(spec: str, model=None) -> opponents.Versus:
    model = model or torch.nn.Linear(2, 2)
    args = S.Args(tiny=True, opponents=spec)
    run_ = SimpleNamespace(args=args, dist=Dist(), model=model, tokenizer=None, device=None)
    run_.policy = Engine(model, None, args, None)
    return opponents.Versus(run_)


def test_draw_gives_each_kind_its_share_and_pure_self_play_draws_nothing():
    mix = versus("self=0.6,past=0.1,random=0.3")
    rng = random.Random(0)
    drawn = [mix.draw(rng) for _ in range(20000)]
    kinds = Counter(kind for kind, _, _ in drawn)
    assert {k: round(n / 20000, 2) for k, n in kinds.items()} == {
        "self": 0.6,
        "past": 0.1,
        "random": 0.3,
    }
    assert all((seat is None) == (kind == "self") for kind, seat, _ in drawn)
    assert Counter(seat for _, seat, _ in drawn if seat is not None).keys() == {0, 1}
    assert {type(o).__name__ for kind, _, o in drawn if kind != "self"} == {"Past", "RandomPlayer"}
    pure, rng = versus("self=1"), random.Random(0)
    before = rng.getstate()
    assert pure.draw(rng) == ("self", None, None) and rng.getstate() == before


def test_draw_plays_every_snapshot_of_the_pool_not_only_the_newest():
    model = torch.nn.Linear(2, 2)
    mix = versus("past=1", model)
    for step in (10, 20):  # --past-every 0: 10; the pool of three: steps 0, 10, 20
        mix.snapshot(step, model)
    rng = random.Random(1)
    drawn = Counter(mix.draw(rng)[2].k for _ in range(3000))
    assert sorted(drawn) == [0, 1, 2] and min(drawn.values()) > 900  # one drawn uniformly a game


def test_snapshot_keeps_the_newest_of_the_pool_and_past_plays_a_snapshot_s_weights():
    model = torch.nn.Linear(2, 2)
    mix = versus("self=0.5,past=0.5", model)
    said = "the pool holds step 0 (the initial policy); the next snapshot at step 10;"
    assert [s for s, _ in mix.pool] == [0] and said in mix.describe()
    first = model.weight.detach().clone()
    for step in range(1, 31):
        with torch.no_grad():
            model.weight.add_(1.0)
        mix.snapshot(step, model)
    assert [s for s, _ in mix.pool] == [10, 20, 30] and len(mix.members) == 3
    mix.load(0)
    assert torch.allclose(mix.frozen.weight, first + 10) and not mix.frozen.weight.requires_grad
    mix.load(2)
    assert torch.equal(mix.frozen.weight, model.weight.detach())


class Reporter:
    """An engine that answers each prompt with the first weight of the model it generates for."""

    def __init__(self, model, tokenizer, args, device):
        self.model, self.room = model, None

    def generate(self, prompts):
        return [([], [], f"{self.model.weight[0, 0].item():g}") for _ in prompts]


def test_Past_generates_with_its_own_snapshot_s_weights_whichever_was_loaded_before():
    model = torch.nn.Linear(2, 2)
    args = S.Args(tiny=True, opponents="past=1", past_every=1)
    fake = SimpleNamespace(args=args, dist=Dist(), model=model, tokenizer=None, device=None)
    fake.policy = Reporter(model, None, args, None)
    mix = opponents.Versus(fake)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        mix.snapshot(step, model)
    [zero, one, two] = mix.members  # steps 0 (the initial policy), 1 and 2
    first = f"{zero.versus.pool[0][1]['weight'][0, 0].item():g}"
    said = [m.generate(["p"])[0][2] for m in (two, zero, one, two, two, zero)]
    assert said == ["2", first, "1", "2", "2", first]


def test_restored_refuses_a_pool_that_does_not_fit_the_model():
    model = torch.nn.Linear(2, 2)
    good = {"steps": [0], "weights": [opponents.trainable(model)]}
    assert opponents.restored(good, model)[0][0] == 0
    wrong = torch.nn.Linear(3, 2)
    bad = [
        {"steps": [0], "weights": [opponents.trainable(wrong)]},
        {"steps": [0, 1], "weights": [opponents.trainable(model)]},
        {"steps": [-1], "weights": [opponents.trainable(model)]},
        {"steps": [0], "weights": [{"weight": torch.zeros(2, 2)}]},
        {"steps": "0", "weights": []},
    ]
    for state in bad:
        with pytest.raises(UserError, match="the checkpoint's past pool does not fit this model"):
            opponents.restored(state, model)


def test_finish_episode_pays_the_learner_its_own_seat_s_result_against_a_fixed_opponent():
    """A real win of the learner's (seat 1: a row the opponent in seat 0 did not block) pays it +1 and
    is tallied as its win; the same game from seat 0 is a loss, paid -1."""
    for seat, reward, result in ((1, 1.0, "win"), (0, -1.0, "loss")):
        mix = versus("self=0.5,random=0.5")
        env = S.make_env("TicTacToe-v0", 0, 0)
        done = False
        for move in ("[0]", "[3]", "[1]", "[4]", "[8]", "[5]"):  # Player 1 takes the middle row
            done, _ = env.step(move)
        assert done
        ep = S.Episode("TicTacToe-v0", env, seat=seat, kind="random", done=done)
        [traj] = S.finish_episode(ep, {}, S.Rules(), mix)
        assert (traj.role, traj.reward, traj.opponent) == (seat, reward, "random")
        cell = {"win": 0, "draw": 0, "loss": 0, "invalid": 0} | {result: 1}
        assert mix.results == {"random": {"TicTacToe-v0": cell}}


def test_finish_episode_tallies_the_learner_s_own_invalid_move_against_a_fixed_opponent():
    """The learner (seat 1) names the cell the opponent took: its loss by an invalid move, tallied as
    one, paid --rejected-rewards' first number; the opponent's seat made none."""
    mix = versus("self=0.5,past=0.5")
    env = S.make_env("TicTacToe-v0", 0, 0)
    env.step("[0]")  # the opponent, seat 0
    done, _ = env.step("[0]")  # the learner: taken, and no retry left
    ep = S.Episode("TicTacToe-v0", env, seat=1, kind="past", done=done)
    [traj] = S.finish_episode(ep, {}, S.Rules(rejected_rewards=(-1.5, 0.5)), mix)
    assert (traj.role, traj.reward, traj.opponent) == (1, -1.5, "past")
    assert mix.results == {"past": {"TicTacToe-v0": {"win": 0, "draw": 0, "loss": 1, "invalid": 1}}}


def test_self_play_against_the_random_player_trains_only_the_learner_s_seat(tiny):
    model, tok = fresh(tiny)
    args = S.Args(tiny=True, opponents="random=1", max_turns=6, max_new_tokens=8)
    policy = S.HFPolicy(model, tok, args, torch.device("cpu"))
    games, rng = ["TicTacToe-v0", "KuhnPoker-v1"], random.Random(3)
    run_ = SimpleNamespace(args=args, dist=Dist(), model=model, policy=policy, tokenizer=tok)
    run_ = SimpleNamespace(**vars(run_), device=None, games=games, rng=rng, lengths={})
    run_.versus = mix = opponents.Versus(run_)
    calls = []
    generate = policy.generate
    policy.generate = lambda prompts: calls.append(len(prompts)) or generate(prompts)
    trajs, counts, _ = S.self_play(run_, 12, S.watch.Timer())
    assert trajs and all(t.opponent == "random" for t in trajs)
    results = mix.results["random"]
    assert sum(sum(c[k] for k in ("win", "draw", "loss")) for c in results.values()) == len(trajs)
    for t in trajs:  # one trajectory a game, the learner's seat: its own prompts only
        assert all(f"Player {t.role}" in turn.prompt for turn in t.turns)
    assert all(
        c["player0"] == c["player1"] == dict.fromkeys(c["player0"], 0) for c in counts.values()
    )
    assert sum(calls) == sum(len(t.turns) for t in trajs)  # no generation for the random seat


def test_Versus_state_is_saved_and_a_resumed_mixed_run_is_exact(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run(SMALL + MIX + ["--steps", "3", "--out", str(whole)]) == 0
    assert run(SMALL + MIX + ["--steps", "2", "--save-every", "1", "--out", str(part)]) == 0
    assert run(["--resume", "--out", str(part), "--steps", "3"]) == 0
    assert_resumed_exactly(whole, part, 3)
    metrics = read_jsonl(whole / "metrics.jsonl")
    assert all(set(m["opponents"]) <= {"past", "random"} for m in metrics)
    kinds = {t.get("opponent", "self") for t in read_jsonl(whole / "trajectories.jsonl")}
    assert kinds == {"self", "past", "random"}
    state = torch.load(whole / "checkpoints/step-000003/trainer_state.pt", weights_only=True)
    assert state["past_pool"]["steps"] == [1, 2, 3]


def test_Versus_of_a_mixed_run_stopped_by_sigint_midway_resumes_exactly(
    tmp_path, capsys, monkeypatch
):
    """A real SIGINT in step 4's games (the pool has grown every step): steps 1-3 are kept, the pool
    with them, and --resume plays steps 4-5 as the run that was never stopped did."""
    import signal

    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run(SMALL + MIX + ["--steps", "5", "--out", str(whole)]) == 0
    play, calls = S.self_play, []

    def signalled_at_step_4(*a, **kw):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)  # before the update: the step is lost, 1-3 kept
        return play(*a, **kw)

    monkeypatch.setattr(S, "self_play", signalled_at_step_4)
    capsys.readouterr()
    assert run(SMALL + MIX + ["--steps", "5", "--save-every", "50", "--out", str(part)]) == 130
    assert capsys.readouterr().err.endswith(
        f"stratagem: stopped by Ctrl-C (continue from step-000003 with: python stratagem.py "
        f"--resume --out {part})\n"
    )
    state = torch.load(part / "checkpoints/step-000003/trainer_state.pt", weights_only=True)
    assert state["past_pool"]["steps"] == [1, 2, 3]
    monkeypatch.setattr(S, "self_play", play)
    assert run(["--resume", "--out", str(part)]) == 0
    assert_resumed_exactly(whole, part, 5)


def test_planned_names_the_mix_in_the_dry_run_and_says_nothing_of_pure_self_play(capsys):
    assert run(["--tiny", "--dry-run", "--opponents", "self=0.6,past=0.4", "--past-pool", "2"]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("opponents: ")]
    assert said == [
        "opponents: 0.6 the policy itself, 0.4 a past policy (a snapshot every 10 steps, the "
        "newest 2 kept; the pool holds step 0 (the initial policy); the next snapshot at step 10; "
        "one more copy of the model in memory, the "
        "snapshots on the CPU; with vLLM the engine takes a past policy's weights for its turns); "
        "only the learner's seat trains against a fixed one"
    ]
    assert run(["--tiny", "--dry-run"]) == 0
    assert "opponents:" not in capsys.readouterr().out


RECIPE = (  # a fast-learning Kuhn run: pure self-play settles on checking within 15 steps
    "--tiny --games KuhnPoker-v1 --lr 3e-3 --batch-size 64 --micro-batch-size 32 --num-envs 16 "
    "--steps 15 --seed 1 --judge-sample-rate 1"
).split()


def kept(out) -> dict[str, float]:
    """Each Kuhn spot of step 1: its share over steps 13-15 over its share at step 1."""
    rows = [m["coverage"]["KuhnPoker-v1"] for m in read_jsonl(out / "metrics.jsonl")]
    first = {spot: cell["share"] for spot, cell in rows[0].items()}
    late = Counter()
    for row in rows[12:15]:
        late.update({spot: cell["n"] for spot, cell in row.items()})
    return {spot: late[spot] / late.total() / share for spot, share in first.items()}


@pytest.mark.slow
def test_Versus_mix_keeps_every_kuhn_spot_that_pure_self_play_loses(tmp_path):
    """Seeded, one thread: the same runs on every CPU. Measured: pure self-play's six spots after a
    bet all at 0 by steps 13-15 (a checking line); the mix keeps every spot at 0.55 or more of its
    step-1 share."""
    assert run(RECIPE + ["--out", str(tmp_path / "pure")]) == 0
    mix = ["--opponents", "self=0.6,past=0.2,random=0.2"]
    assert run(RECIPE + mix + ["--out", str(tmp_path / "mix")]) == 0
    lost = sorted(spot for spot, r in kept(tmp_path / "pure").items() if r < 0.1)
    assert lost == ["J bet", "J check bet", "K bet", "K check bet", "Q bet", "Q check bet"]
    assert min(kept(tmp_path / "mix").values()) >= 0.1


def test_Swapped_gives_the_engine_the_past_weights_for_the_call_and_the_learners_back_after():
    calls = []

    class Engine:
        room = 100

        def sync(self, model):
            calls.append(("sync", model))

        def generate(self, prompts):
            calls.append(("generate", prompts))
            if prompts == ["boom"]:
                raise RuntimeError("the engine failed")
            return [([1], [2], "ok")]

    swapped = opponents.Swapped(Engine(), "frozen", "learner")
    assert swapped.room == 100 and swapped.generate(["p"]) == [([1], [2], "ok")]
    assert calls == [("sync", "frozen"), ("generate", ["p"]), ("sync", "learner")]
    calls.clear()
    with pytest.raises(RuntimeError):
        swapped.generate(["boom"])
    assert calls[-1] == ("sync", "learner")  # the learner's weights are back whatever happened


def test_of_run_counts_one_frozen_copy_for_the_past_policies_and_one_for_the_kl_reference():
    from machinery import memory

    shape = {**S.ARCHS["qwen3-4b"], "tie_word_embeddings": True}
    alone = memory.of_run(S.Args(), shape, 1, False, True, 1)
    past = S.Args(opponents="self=0.8,past=0.2")
    both = S.Args(opponents="self=0.8,past=0.2", kl_coef=0.01)
    assert alone["reference"] == 0
    assert memory.of_run(past, shape, 1, False, True, 1)["reference"] == alone["weights"]
    assert memory.of_run(both, shape, 1, False, True, 1)["reference"] == 2 * alone["weights"]


def test_baseline_key_gives_each_fixed_opponent_kind_its_own_rae_baseline(tmp_path, capsys):
    err = error_of(capsys, ["--tiny", "--opponent-baselines", "--dry-run"])
    assert err == (
        "stratagem: error: --opponent-baselines needs --opponents with a past or random share\n"
    )
    out = tmp_path / "run"
    assert run(SMALL + MIX + ["--opponent-baselines", "--steps", "2", "--out", str(out)]) == 0
    baselines, rows = {}, read_jsonl(out / "trajectories.jsonl")
    for r in rows:  # RAE replayed with the key: each row's baseline is its own kind's so far
        t = SimpleNamespace(game=r["game"], role=r["role"], opponent=r.get("opponent"))
        key = opponents.baseline_key(t)
        assert r["baseline"] == pytest.approx(baselines.get(key, 0.0)), key
        baselines[key] = 0.95 * baselines.get(key, 0.0) + 0.05 * r["reward"]
    keys = set(read_jsonl(out / "metrics.jsonl")[-1]["baselines"])
    assert keys == set(baselines)
    assert {k.rsplit("/", 1)[-1] for k in keys if k.count("/") == 2} == {"vs-past", "vs-random"}
    assert any(k.count("/") == 1 for k in keys)  # self-play's, as the paper keys them
