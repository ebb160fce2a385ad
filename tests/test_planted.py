"""Tests of what the newest code promises, each of which fails with one of the bugs an attack planted there one at a
time and the suite used to let through (docs/reliability.md lists them): SPIRAL's action rule, adaptive beta, the
budget's recent means, the step-0 evaluation and --keep-best, the memory projection, LoRA, plot, ablation and the
warm start."""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import stratagem as S
from games import actions
from machinery import adaptive_beta, lora, matches, memory, modulation, watch
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HUGE,
    SMALL,
    ScriptedPolicy,
    fresh,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    self_play,
    tiny_fixture,
)


# ---- SPIRAL's action rule (games/actions.py)
def test_last_box_reads_no_fbox_so_a_fboxed_move_is_invalid():
    assert actions.spiral_action("\\fbox{x[check]}", ["[check]", "[bet]"]) == actions.INVALID_ACTION


def test_spiral_action_brackets_a_bracketless_reply_of_five_words_at_most():
    assert (
        actions.spiral_action("I will check my card", ["[I will check my card]"])
        == "[I will check my card]"
    )
    assert (
        actions.spiral_action("I will check my card now", ["[I will check my card now]"])
        == actions.INVALID_ACTION
    )


OFFER = (
    "[GAME] You are Player 1 in the Negotiation Game.\n\t+ [Wood]    Qty: 10   Value: 5\n\t+ [Gold]    Qty: 10   "
    "Value: 15\n[Player 0] [Offer: 1 Wood -> 1 Gold]\n[GAME] Player 0 made the following offer to Player 1: "
    "Offered items: 1 Wood -> Requested items: 1 Gold\n"
)


@pytest.mark.parametrize(
    "answered", ["[GAME] Player 1 accepted the trade offer from Player 0.\n", "Player 1 denied"]
)
def test_negotiation_moves_offer_no_accept_once_the_offer_was_answered(answered):
    assert "[Accept]" in actions.negotiation_moves(OFFER)
    assert "[Accept]" not in actions.negotiation_moves(OFFER + answered)


# ---- adaptive beta
def test_evolution_share_is_a_ratio_of_root_mean_squares():
    trajs = [
        S.Trajectory("G", 0, [], 0.0, a_game=a, scores={}, phi=1.0, psi=1.0) for a in (1.0, 0.0)
    ]
    game = math.sqrt(0.5)  # RMS of A_game * phi = [1, 0]: not its mean, 0.5
    assert adaptive_beta.evolution_share(trajs, 0.5) == pytest.approx(0.5 / (game + 0.5))


# ---- numbers a policy writes
def test_self_play_pays_invalid_rewards_for_a_4301_digit_offer_not_rejected_rewards(tiny):
    _, tok = fresh(tiny)
    args = S.Args(
        tiny=True, batch_size=1, num_envs=1, invalid_rewards="-1.5,0.5", rejected_rewards="-1,0"
    )
    policy = ScriptedPolicy(lambda p: f"\\boxed{{[Offer: {HUGE} Wood -> 1 Gold]}}")
    trajs, _, _ = self_play(
        policy, tok, args, ["SimpleNegotiation-v1"], random.Random(0), watch.Timer(), {}, 1
    )
    assert sorted(t.reward for t in trajs) == [-1.5, 0.5]


# ---- the budget's recent means
def test_after_budget_averages_the_last_ten_judged_steps_phi_and_psi():
    class Spent:
        def budget_exhausted(self):
            return True

    recent = [{"phi": float(k), "psi": -float(k)} for k in range(12)]
    assert modulation.recent_means(recent) == {
        "phi": pytest.approx(6.5),
        "psi": pytest.approx(-6.5),
    }  # steps 2..11
    run_ = SimpleNamespace(runner=Spent(), recent=recent, args=S.Args(), distiller=None)
    trajs = [S.Trajectory("G", 0, [], 1.0, a_game=0.5)]
    S.modulate(trajs, {}, S.entering("stratagem", False), 0.2)
    assert modulation.after_budget(run_, trajs) == {
        "phi": pytest.approx(6.5),
        "psi": pytest.approx(-6.5),
    }
    info = S.final_a_mod(run_, trajs, [None], {}, 0.2)
    assert info["imputed_after_budget"] == {"phi": pytest.approx(6.5), "psi": pytest.approx(-6.5)}
    assert trajs[0].a_mod == pytest.approx(0.5 * 6.5 + 0.2 * -6.5)


# ---- the step-0 evaluation
def test_periodic_eval_plays_other_seeds_at_other_steps(tiny, monkeypatch):
    _, tok = fresh(tiny)
    seeds: list = []
    make = S.make_env
    monkeypatch.setattr(
        S, "make_env", lambda game, seed, *a: seeds.append(seed) or make(game, seed, *a)
    )
    args = S.Args(eval_every=5, eval_n=2, eval_games="KuhnPoker-v1", max_new_tokens=8)
    run_ = type(
        "R",
        (),
        {"args": args, "eval_games": ["KuhnPoker-v1"], "policy": ScriptedPolicy(lambda p: "x")},
    )()
    run_.tokenizer, run_.dist = tok, type("D", (), {"main": True})()
    for step in (5, 10, 5):
        S.periodic_eval(run_, step, watch.Timer())
    assert seeds[:2] == seeds[4:] and seeds[:2] != seeds[2:4]


def test_train_with_eval_every_plays_the_same_trajectories_as_without(tmp_path):
    flags = SMALL + ["--steps", "2", "--games", "KuhnPoker-v1", "--tiny-init", "warm"]
    assert run(flags + ["--out", str(tmp_path / "plain")]) == 0
    evaluated = ["--eval-every", "1", "--eval-n", "2", "--eval-games", "KuhnPoker-v1"]
    assert run(flags + evaluated + ["--out", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "plain" / "trajectories.jsonl").read_bytes() == (
        tmp_path / "eval" / "trajectories.jsonl"
    ).read_bytes()


# ---- the memory projection
QWEN3_4B = {**S.ARCHS["qwen3-4b"], "tie_word_embeddings": True}


def test_project_halves_gradients_at_two_ranks_and_the_kl_reference_costs_the_weights():
    one = memory.project(QWEN3_4B, 0, [], 1, 4096, False, True)
    two = memory.project(QWEN3_4B, 0, [], 1, 4096, False, True, world=2)
    assert two["gradients"] == one["gradients"] / 2 and two["adam"] == one["adam"] / 2
    assert (
        memory.project(QWEN3_4B, 0, [], 1, 4096, False, True, reference=True)["reference"]
        == one["weights"]
    )


def test_verdict_without_kv_room_does_not_fit():
    m = memory.project(QWEN3_4B, 0, [], 1, 4096, False, True)
    total = 1e12  # room for everything, but vLLM's share holds no more than its weights
    assert memory.verdict(m, total, m["vllm_weights"] / total)["fits"] is False
    assert memory.verdict(m, total, 0.5)["fits"] is True


# ---- LoRA
def test_lora_config_takes_the_lora_dropout_flag():
    assert lora.lora_config(S.Args(lora_rank=4, lora_dropout=0.1)).lora_dropout == 0.1


# ---- plot and ablation
def test_eval_cell_of_the_only_game_evaluated_draws_no_second_line():
    m = {"eval": {"games": {"KuhnPoker-v1": {"both": {"win": {"rate": 0.5}}}}}}
    from tools import plot

    assert plot.eval_cell(m, "KuhnPoker-v1", "win") is None
    m["eval"]["games"]["TicTacToe-v0"] = {"both": {"win": {"rate": 0.1}}}
    assert plot.eval_cell(m, "KuhnPoker-v1", "win") == 0.5


def test_draw_plot_shades_the_interval_of_the_step_0_point():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools import plot

    e = {"win_rate": 0.5, "win_ci95": [0.4, 0.6], "n": 10, "games": {}}
    fig = plot.draw_plot(
        plt, "eval_win_rate", [(Path("r"), [{"step": 0, "eval": e}, {"step": 5, "eval": e}])]
    )
    band = next(c for c in fig.axes[0].collections if len(c.get_paths()))
    assert band.get_paths()[0].vertices[:, 0].min() == 0
    plt.close(fig)


def test_ablation_resumes_a_folder_that_holds_a_config(tmp_path, monkeypatch):
    from tools import ablation

    commands = []
    monkeypatch.setattr(
        ablation.subprocess,
        "run",
        lambda cmd, **k: commands.append(cmd) or type("P", (), {"returncode": 0}),
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    ablation.train(tmp_path / "a", "stratagem", 1, 3)
    ablation.train(tmp_path / "b", "stratagem", 1, 3)
    assert "--resume" in commands[0] and "--resume" not in commands[1]


def test_arm_row_reports_the_mean_spread_of_a_game_over_the_steps(tmp_path):
    from machinery import runfiles
    from tools import ablation

    run_ = tmp_path / "stratagem-s1"
    run_.mkdir()
    e = {"win_rate": 0.5, "win_ci95": [0.4, 0.6], "n": 10, "games": {"KuhnPoker-v1": {}}}
    lines = [{"step": 0, "eval": e}] + [
        {"step": k, "loss": 0.0, "a_game_std": std, "a_mod_std": 0.1, "judge_judged": 1, "eval": e}
        for k, std in ((1, 0.2), (2, 0.6))
    ]
    for line in lines:
        runfiles.append_jsonl(run_ / "metrics.jsonl", line)
    assert ablation.arm_row("stratagem", [run_])["a_game_std"] == pytest.approx(0.4)


# ---- the warm start
def test_tokenize_ends_every_response_with_eos_and_the_soft_target_sits_on_the_action():
    from tools import warmstart

    tok = S.load_policy(str(S.WARM_START), torch.device("cpu"))[1]
    moves = warmstart.random_games({"TicTacToe-v0": 6, "KuhnPoker-v1": 6}, seed=3)
    items, soft = warmstart.tokenize(moves, tok), warmstart.soft_targets(moves, tok)
    assert all(r[-1] == tok.eos_token_id for _, r in items)
    for move, (_, response), target in zip(moves, items, soft):
        assert target is not None  # a board cell or a card's move: one token apart
        k, tokens = target
        assert response[k] in tokens and move.action.strip("[]") in tok.decode([response[k]])
        assert tok.decode(response[:k]).endswith("\\boxed{[") or tok.decode(response[:k]).endswith(
            "\\boxed{"
        )
    assert matches.RandomPlayer  # the moves above are the random legal player's


def test_kl_term_adds_nothing_for_a_repeated_micro_batch_and_the_k3_sum_otherwise():
    """FSDP's repeated micro-batches (sums None) carry no KL; a real one adds the k3 sum over its response
    tokens on the loss's normaliser, positive where the policy left the reference, and logs it."""
    logps = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.4), -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last column is padding
    assert S.kl_term(logps, ref, mask, 4.0, None).item() == 0.0
    sums = {}
    kl = S.kl_term(logps, ref, mask, 4.0, sums)
    expected = ((0.5 - math.log(0.5) - 1) + (2 - math.log(2) - 1)) / 4
    assert kl.item() == pytest.approx(expected) and sums == {"kl": pytest.approx(expected)}
