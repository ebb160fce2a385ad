"""Tests of --distill (machinery/distill.py): a judge distilled into small ordinal heads on the policy's hidden
states, the trust that switches them on and off, and whole distilled runs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

import judge_prompts
import stratagem as S
from machinery import distill, distributed, runfiles, watch
from machinery import judge as J
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    DISTILL,
    REFERENCE,
    REFERENCE_RUNS,
    JudgeServer,
    assert_as_recorded,
    assert_resumed_exactly,
    by_game,
    completion,
    fresh,
    learner,
    make_batch,
    no_process_left_behind,
    not_for_the_vllm_tests,
    only_the_vllm_tests,
    read_jsonl,
    run,
    run_fingerprint,
    tiny_fixture,
)
from tools import agree, serve_judge


# ---- --distill: a judge distilled into small heads on the policy's hidden states
def test_OrdinalHeads_charge_a_two_level_miss_more_than_a_one_level_miss():
    heads = distill.OrdinalHeads(1, n_dims=1)
    with torch.no_grad():
        heads.weight.fill_(1.0)
    for score in (-6.0, -2.0, -1.0, 0.0, 1.0, 2.0, 6.0):
        nll = -heads.log_probs(torch.tensor([[score]]))[0, 0]  # [3]
        best = int(nll.argmin())
        assert all(nll[k] < nll[k + 1] for k in range(best, 2)) and all(
            nll[k] < nll[k - 1] for k in range(1, best + 1)
        )
    nll = -heads.log_probs(torch.tensor([[-6.0]]))[0, 0]  # sure of level 0
    assert (
        nll[2] > nll[1] + 1 > nll[0] + 1
    )  # level 2 costs more than level 1 (a softmax over classes need not)


def test_OrdinalHeads_cut_points_stay_ordered_whatever_their_parameters():
    """P(level <= 0) <= P(level <= 1) for any parameters, so the three levels' probabilities are a distribution:
    the second cut point is the first plus a positive gap, however negative the raw parameter."""
    heads = distill.OrdinalHeads(4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(6, 4, generator=gen))
        heads.first_cut.copy_(torch.randn(6, generator=gen))
        heads.gap.copy_(torch.tensor([-30.0, -3.0, -0.5, 0.0, 0.5, 3.0]))
    probs = heads.log_probs(torch.randn(32, 4, generator=gen)).exp()  # [N, D, 3]
    assert torch.allclose(probs.sum(-1), torch.ones(32, 6), atol=1e-6) and (probs <= 1).all()


def test_ordinal_loss_is_the_mean_over_the_judged_entries_only():
    probs = torch.tensor(
        [[[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]], [[0.6, 0.2, 0.2], [0.3, 0.3, 0.4]]]
    )  # [N, D, 3]
    levels, known = torch.tensor([[2, 0], [1, 2]]), torch.tensor([[True, False], [True, True]])
    want = -(math.log(0.5) + math.log(0.2) + math.log(0.4)) / 3
    assert distill.ordinal_loss(probs.log(), levels, known).item() == pytest.approx(want)


def test_cohen_kappa_and_spearman_known_values():
    a = ["y"] * 25 + ["n"] * 25  # Wikipedia's example: 20 yes/yes, 5 yes/no, 10 no/yes, 15 no/no
    b = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    assert distill.cohen_kappa(a, b) == pytest.approx(0.4)
    assert distill.cohen_kappa([1, 0, 1], [1, 0, 1]) == 1.0 and math.isnan(
        distill.cohen_kappa([1, 1], [1, 1])
    )
    assert distill.spearman([1, 2, 3], [1, 1, 2]) == pytest.approx(1.5 / math.sqrt(3))
    assert distill.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert distill.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert distill.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert (agree.cohen_kappa, agree.spearman) == (
        distill.cohen_kappa,
        distill.spearman,
    )  # one copy, in machinery


def two_turns(i: int) -> S.Trajectory:
    """A trajectory whose evolution no rule decides (two turns, different observations, different reasoning)."""
    return S.Trajectory(
        "KuhnPoker-v1",
        0,
        [
            S.Turn(f"obs {i} a", f"first thought {chr(97 + i % 26)}", "[bet]", [], []),
            S.Turn(f"obs {i} b", f"then another {chr(98 + i % 25)}", "[call]", [], []),
        ],
        1.0,
    )


def pairs_at_kappa(agreeing: int) -> list[tuple[float, float]]:
    """Ten (heads, judge) pairs, both raters half 0 and half 1: kappa = (agreeing / 10 - 0.5) / 0.5."""
    judge = [0.0] * 5 + [1.0] * 5
    heads = judge[:]
    for k in range((10 - agreeing) // 2):  # swap pairs of labels: the margins stay half and half
        heads[k], heads[9 - k] = 1.0, 0.0
    return list(zip(heads, judge))


def test_trusted_switches_on_and_off_at_the_threshold(monkeypatch):
    assert [distill.cohen_kappa(*map(list, zip(*pairs_at_kappa(n)))) for n in (8, 6)] == [
        pytest.approx(0.6),
        pytest.approx(0.2),
    ]
    assert distill.trusted({"alpha": 0.6}, {"alpha": 10}, 0.6, 10)
    exactly = distill.cohen_kappa(
        [0, 0, 1] + [0] + [1] * 14, [0, 0, 0] + [1] * 15
    )  # 3/5 exactly, in floats a hair less
    assert exactly < 0.6 and distill.trusted({"alpha": exactly}, {"alpha": 18}, 0.6, 18)
    assert not distill.trusted({"alpha": 0.5999}, {"alpha": 10}, 0.6, 10)
    assert not distill.trusted({"alpha": 1.0}, {"alpha": 9}, 0.6, 10)  # the window is not full yet
    assert distill.trusted(
        {"alpha": math.nan}, {"alpha": 10}, 0.6, 10
    )  # one same level throughout: perfect agreement
    args = S.dataclasses.replace(
        S.Args(),
        distill=True,
        no_psi=True,
        distill_window=10,
        distill_kappa=0.6,
        judge_sample_rate=0.25,
        distill_audit_rate=0.05,
    )
    heads = distill.Distiller(2, args)
    monkeypatch.setattr(
        distill, "HOLDOUT", 0.0
    )  # trajectory 3's verdict trains the heads; the holdout is as written here
    trajs = [two_turns(i) for i in range(4)]
    feats = [
        torch.zeros(2),
        None,
        torch.ones(2),
        torch.ones(2),
    ]  # trajectory 1: a seat that never moved
    judged = {3: J.Judgement({"alpha": 1.0, "sigma": 0.0, "rho": 0.5})}
    for agreeing, trust in ((8, True), (6, False), (10, True), (4, False)):
        for k in ("alpha", "sigma", "rho"):
            heads.pairs[k].extend(pairs_at_kappa(agreeing if k == "sigma" else 10))  # sigma decides
        mod = S.modulate(
            trajs, judged, args.entering, args.beta
        )  # step 3, then --distill's call after it
        run = SimpleNamespace(distiller=heads, args=args, runner=None, recent=[])
        S.final_a_mod(run, trajs, feats, dict(judged), 0.2)
        estimates = {
            i: t.predicted["levels"]
            for i, t in enumerate(trajs)
            if t.predicted and t.predicted["used"]
        }
        assert heads.trusted is trust and heads.sample_rate() == (0.05 if trust else 0.25)
        assert sorted(estimates) == (
            [0, 2] if trust else []
        )  # every played trajectory without a verdict, or none
        assert trajs[0].phi == (S.phi(estimates[0], args.entering) if trust else mod["phi_mean"])
        assert (
            trajs[0].a_mod == trajs[0].a_game * trajs[0].phi
        )  # --no-psi: A_mod recomputed from the heads' phi
        verdict = {"alpha": 1.0, "sigma": 0.0, "rho": 0.5}
        assert (
            mod["phi_mean"] == S.phi(verdict, args.entering) and trajs[1].phi == mod["phi_mean"]
        )  # verdicts only
        assert heads.report["scored"] == {
            "judge": 1,
            "heads": 2 if trust else 0,
            "imputed": 0 if trust else 2,
        }


def level_of(key: str, q: float) -> float:
    levels = judge_prompts.RUBRICS[distill.RUBRIC_OF[key]]["levels"]
    return levels[0] if q < -0.43 else levels[2] if q > 0.43 else levels[1]


def test_Distiller_heads_learn_a_synthetic_teacher():
    """Sixteen features carry six hidden qualities linearly, with noise; the teacher's level of each dimension is its
    quality cut at +-0.43 (a third each). Fed step by step as a run feeds them (32 judged trajectories a step), the
    heads start at the middle level and reach kappa >= 0.8 on every dimension of their holdout, and are trusted."""
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(16, 6, generator=gen)  # [H, 6]
    args = S.dataclasses.replace(S.Args(), distill=True, distill_window=60, distill_lr=1e-2)
    heads = distill.Distiller(16, args)
    first = None
    for _ in range(30):
        quality = torch.randn(32, 6, generator=gen)  # [N, 6]
        feats = list(quality @ mix.T + 0.1 * torch.randn(32, 16, generator=gen))  # [H] each
        trajs = [two_turns(i) for i in range(32)]
        judged = {
            i: J.Judgement({k: level_of(k, q) for k, q in zip(distill.KEYS, quality[i].tolist())})
            for i in range(32)
        }
        heads.step(trajs, feats, judged)
        first = first or [t.predicted["levels"] for t in trajs]
    assert all(
        p == {"alpha": 0.5, "sigma": 0.5, "rho": 0.5, "d": 0.0, "a": 0.0, "c": 0.0} for p in first
    )
    report = heads.report
    assert report["trusted"] and min(report["kappa"].values()) >= 0.8, report["kappa"]
    assert report["holdout"] == dict.fromkeys(distill.KEYS, 60) and report["spearman"]["phi"] > 0.8
    assert report["scored"] == {
        "judge": 32,
        "heads": 0,
        "imputed": 0,
    }  # every trajectory judged: nothing to estimate


def test_Distiller_file_holds_out_a_quarter_of_the_verdicts_and_trains_on_the_rest():
    d = distill.Distiller(2, S.Args(distill=True, distill_window=10**6))
    verdict = J.Judgement({"alpha": 1.0, "sigma": 0.5, "rho": 0.0, "d": 1.0, "a": 0.0, "c": -1.0})
    trained = sum(d.file(torch.zeros(2), dict(verdict.scores), verdict) for _ in range(4000))
    assert 0.72 < trained / 4000 < 0.78 and len(d.pairs["alpha"]) == 4000 - trained == len(
        d.pairs["psi"]
    )


@pytest.mark.parametrize("rule", ["one_turn", "stagnant"])
def test_Distiller_file_neither_trains_on_nor_compares_the_levels_a_rule_set(rule):
    """d, a and c that a rule set (one turn, stagnation) are not the judge's word: the heads neither learn them
    nor are they measured against them; alpha, sigma and rho of the same verdict count."""
    d = distill.Distiller(2, S.Args(distill=True))
    verdict = J.Judgement(
        {"alpha": 1.0, "sigma": 0.5, "rho": 0.0, "d": -1.0, "a": -1.0, "c": 1.0}, rule=rule
    )
    for _ in range(200):
        d.file(torch.zeros(2), dict(verdict.scores), verdict)
    assert d.train_y and all(
        y["d"] is y["a"] is y["c"] is None and y["alpha"] == 1.0 for y in d.train_y
    )
    assert d.pairs["alpha"] and not d.pairs["d"] and not d.pairs["psi"]


def test_Distiller_step_with_trusted_heads_obeys_the_evolution_rules(monkeypatch):
    """Trusted heads score trajectories without a verdict, under the rules a judge's verdict is under: one turn
    is d = a = c = 0, stagnation is d = a = -1, whatever the heads say (here: +1 on every dimension)."""
    d = distill.Distiller(2, S.Args(distill=True))
    with torch.no_grad():
        d.heads.first_cut.fill_(-50.0)  # every head says its top level
    monkeypatch.setattr(distill, "trusted", lambda *args: True)
    one = S.Trajectory("G", 0, [S.Turn("o", "I think", "[1]", [], [])], 0.0)
    stagnant = S.Trajectory(
        "G",
        0,
        [
            S.Turn("o1", "I take cell 1", "[1]", [], []),
            S.Turn("o2", "I take cell 2", "[2]", [], []),
        ],
        0.0,
    )
    estimates = d.step([one, stagnant, two_turns(0)], [torch.zeros(2)] * 3, {})
    assert [tuple(estimates[i][k] for k in ("alpha", "d", "a", "c")) for i in range(3)] == [
        (1.0, 0.0, 0.0, 0.0),
        (1.0, -1.0, -1.0, 1.0),
        (1.0, 1.0, 1.0, 1.0),
    ]


def test_Distiller_takes_no_prediction_and_no_training_from_non_finite_features():
    """A diverged policy's hidden states (NaN, Inf) must not poison the heads: those trajectories get no
    prediction and no training; the judge's verdict on them still stands, and the heads stay finite."""
    d = distill.Distiller(8, S.Args(distill=True, distill_window=100))
    trajs = [two_turns(i) for i in range(8)]
    gen = torch.Generator().manual_seed(0)
    feats = [torch.randn(8, generator=gen) for _ in trajs]
    feats[1][0], feats[2][3], feats[3][:] = float("nan"), float("inf"), float("-inf")
    verdict = {"alpha": 1.0, "sigma": 0.5, "rho": 0.0, "d": 1.0, "a": 0.0, "c": -1.0}
    for _ in range(4):
        d.step(trajs, feats, {i: J.Judgement(dict(verdict)) for i in range(0, 8, 2)})
    assert all(torch.isfinite(p).all() for p in d.heads.parameters())
    assert (
        all(torch.isfinite(x).all() for x in d.train_x)
        and len(d.train_x) + len(d.pairs["alpha"]) == 4 * 3
    )
    assert [t.predicted is None for t in trajs] == [
        False,
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    assert d.report["scored"] == {"judge": 4, "heads": 0, "imputed": 4}


def test_features_are_the_mean_last_hidden_state_over_a_trajectorys_response_tokens(tiny):
    model, _ = fresh(tiny)
    trajs = [
        S.Trajectory(
            "toy",
            0,
            [S.Turn("", "", "", [5, 6, 7, 8], [9, 10]), S.Turn("", "", "", [11, 12], [13, 14, 15])],
            0.0,
        ),
        S.Trajectory("toy", 1, [], 0.0),  # a seat that never moved
        S.Trajectory("toy", 0, [S.Turn("", "", "", [16], [17])], 0.0),
    ]
    state = torch.get_rng_state()
    feats = distill.features(
        model.train(),
        trajs,
        S.collate,
        0,
        2,
        torch.device("cpu"),
        distributed.Dist(),
        watch.Timer(),
    )
    assert torch.equal(torch.get_rng_state(), state) and model.training  # no draw; the mode it had
    with torch.no_grad():

        def hidden(
            prompt, response
        ):  # unpadded, alone: the final norm's output at the response positions
            return model.model(torch.tensor([prompt + response])).last_hidden_state[
                0, -len(response) :
            ]  # [R, H]

        want = [
            torch.cat([hidden(t.prompt_ids, t.response_ids) for t in traj.turns]).mean(0)
            for traj in (trajs[0], trajs[2])
        ]
    assert feats[1] is None and feats[0].shape == (64,)
    assert torch.allclose(feats[0], want[0], atol=1e-5) and torch.allclose(
        feats[2], want[1], atol=1e-5
    )


def test_features_pass_leaves_the_policy_gradient_bit_identical(tiny):
    """With dropout switched on, a features pass in train mode would draw from torch's RNG and move every dropout
    mask of the update after it; the pass runs in eval mode under no_grad, so the update's gradient is the same bit
    for bit."""
    grads = []
    for with_features in (False, True):
        model, tok = fresh(tiny)
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.3
        model.train()
        batch = make_batch(tok("Obs").input_ids, [[3, 4], [5], [6, 7, 8]], [1.0, -0.5, 0.25])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

        def recording_step(model=model, step=optimizer.step):
            grads.append([p.grad.clone() for p in model.parameters()])
            return step()

        optimizer.step = recording_step
        torch.manual_seed(7)
        if with_features:
            distill.features(
                model,
                batch,
                S.collate,
                0,
                2,
                torch.device("cpu"),
                distributed.Dist(),
                watch.Timer(),
            )
        args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=2, max_grad_norm=1e9)
        S.policy_update(learner(model, optimizer, args, distributed.Dist()), batch, 24.0)
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and any(
        g.abs().max() > 0 for g in grads[0]
    )


def test_TokenTeacher_is_a_known_function_of_the_text():
    teacher = serve_judge.TokenTeacher(1)
    assert all(low < high for low, high in teacher.cuts)
    response = "I bet because the value is higher"
    text = {
        g: J.render_for_judge(S.Trajectory(g, 0, [S.Turn("obs", response, "[bet]", [], [])], 0.0))
        for g in teacher.OFFSETS
    }
    verdicts = {g: teacher.scores("transferability", t) for g, t in text.items()}
    z = teacher.z(response, "KuhnPoker-v1")
    want = [0.0 if v < low else 0.5 if v < high else 1.0 for v, (low, high) in zip(z, teacher.cuts)]
    assert verdicts["KuhnPoker-v1"] == dict(zip(("alpha", "sigma", "rho"), want))
    for dim, key in enumerate(
        ("alpha", "sigma", "rho")
    ):  # the game's offset moves the level its way, 2 apart
        by_offset = sorted(teacher.OFFSETS, key=lambda g: teacher.OFFSETS[g][dim])
        assert [verdicts[g][key] for g in by_offset] == sorted(verdicts[g][key] for g in by_offset)
        assert teacher.z(response, by_offset[-1])[dim] - teacher.z(response, by_offset[0])[
            dim
        ] == pytest.approx(4.0)
    assert (
        teacher.scores("transferability", text["KuhnPoker-v1"]) == verdicts["KuhnPoker-v1"]
    )  # deterministic
    assert teacher.scores("evolution", text["KuhnPoker-v1"]) == J.HeuristicJudge().scores(
        "evolution", text["KuhnPoker-v1"]
    )


def test_distill_without_trust_leaves_the_reference_run_as_it_was(tmp_path):
    """--distill with a window it never fills: the recorded reference run (the flag absent, before this change) is
    computed again bit for bit: metrics (loss, gradient norm, ...) and trajectories, once the heads' own fields are
    set aside."""
    out = tmp_path / "run"
    assert (
        run(
            REFERENCE_RUNS["stratagem"]
            + ["--distill", "--distill-window", "100000", "--out", str(out)]
        )
        == 0
    )
    rows = read_jsonl(out / "trajectories.jsonl")
    assert all("predicted" in r for r in rows if r["turns"]) and not any(
        r["predicted"]["used"] for r in rows if r["turns"]
    )
    (out / "trajectories.jsonl").write_text(
        "".join(
            json.dumps({k: v for k, v in r.items() if k != "predicted"}, ensure_ascii=False) + "\n"
            for r in rows
        )
    )
    got = json.loads(json.dumps(run_fingerprint(out)))
    assert all(m.pop("distill")["trusted"] is False for m in got["metrics"])
    assert_as_recorded(got, json.loads(REFERENCE.read_text())["stratagem"])


@pytest.fixture(scope="module")
def distilled_runs(tmp_path_factory):
    """A --distill run of 8 steps against the by-game teacher, and the same run stopped after 4 and resumed."""
    not_for_the_vllm_tests()
    root, server = tmp_path_factory.mktemp("distill"), JudgeServer(by_game)
    flags = DISTILL + ["--judge-base-url", server.url]
    try:
        assert run(flags + ["--steps", "8", "--out", str(root / "whole")]) == 0
        assert run(flags + ["--steps", "4", "--out", str(root / "part")]) == 0
        resume = ["--resume", "--out", str(root / "part"), "--steps", "8"]
        assert run(resume + ["--judge-base-url", server.url]) == 0
    finally:
        server.close()
    return root / "whole", root / "part"


def test_distill_run_earns_trust_and_then_asks_the_judge_less(distilled_runs):
    whole, _ = distilled_runs
    metrics, rows = read_jsonl(whole / "metrics.jsonl"), read_jsonl(whole / "trajectories.jsonl")
    trusted = [m["distill"]["trusted"] for m in metrics]
    assert True in trusted and not trusted[0], trusted
    for m, before in zip(metrics, [False] + trusted):
        d, mine = m["distill"], [r for r in rows if r["step"] == m["step"] and r["turns"]]
        assert d["judge_rate"] == (
            0.25 if before else 1.0
        )  # the audit rate while the last step left the heads trusted
        assert m["judge_requests"] == math.ceil(
            d["judge_rate"] * len(mine)
        )  # one rubric (--no-psi) a trajectory
        assert d["scored"] == {
            "judge": m["judge_judged"],
            "heads": len(mine) - m["judge_judged"] if d["trusted"] else 0,
            "imputed": 0 if d["trusted"] else len(mine) - m["judge_judged"],
        }
        assert set(d["kappa"]) == set(distill.KEYS) and d["used"] == ["alpha", "sigma", "rho"]
        for r in mine:
            levels = r["predicted"]["levels"]
            assert r["predicted"]["used"] == (d["trusted"] and r["scores"] is None)
            if r["predicted"]["used"]:  # the heads' levels, not the batch mean, in A_mod
                assert r["phi"] == pytest.approx(S.phi(levels))
                assert r["a_mod"] == pytest.approx(r["a_game"] * r["phi"] + 0.2 * r["psi"])
        assert d["trusted"] == all(
            d["holdout"][k] == 6 and (d["kappa"][k] is None or d["kappa"][k] >= 0.6)
            for k in d["used"]
        )
    assert [True, False] in [
        trusted[k : k + 2] for k in range(len(trusted))
    ]  # this run also loses trust
    assert (
        min(m["judge_requests"] for m in metrics) <= max(m["judge_requests"] for m in metrics) / 4
    )


def test_distill_run_resumes_exactly_heads_and_holdout_included(distilled_runs):
    whole, part = distilled_runs
    assert_resumed_exactly(whole, part, 8)
    a, b = (
        runfiles.load_state(r / "checkpoints/step-000008/trainer_state.pt", runfiles.TRAINER_STATE)[
            "distill"
        ]
        for r in (whole, part)
    )
    assert a["heads"].keys() == b["heads"].keys() and all(
        torch.equal(a["heads"][k], b["heads"][k]) for k in a["heads"]
    )
    assert a["pairs"] == b["pairs"] and a["rng"] == b["rng"] and a["trusted"] == b["trusted"]
    assert (
        all(torch.equal(x, y) for x, y in zip(a["train_x"], b["train_x"]))
        and a["train_y"] == b["train_y"]
    )
    assert str(a["optimizer"]) == str(b["optimizer"])


def test_show_prints_the_heads_beside_the_judge_and_agree_takes_them_as_a_judge(
    distilled_runs, capsys
):
    whole, _ = distilled_runs
    rows = read_jsonl(whole / "trajectories.jsonl")
    used = next(r for r in rows if r.get("predicted", {}).get("used"))
    index = [r for r in rows if r["step"] == used["step"]].index(used)
    assert run(["show", str(whole), "--step", str(used["step"]), "--index", str(index)]) == 0
    h = used["predicted"]["levels"]
    out = capsys.readouterr().out
    assert "judge: not sampled; the trusted heads' levels used (below)" in out
    assert (
        f"heads: alpha {h['alpha']:g}  sigma {h['sigma']:g}  rho {h['rho']:g}  -> phi = {used['phi']:.4f}  "
        "(scored this trajectory)"
    ) in out
    server = JudgeServer(by_game)
    try:
        assert (
            run(
                [
                    "agree",
                    str(whole),
                    "--judges",
                    f"openai:judge-test@{server.url}",
                    f"distilled:{whole}",
                    "--sample",
                    "24",
                    "--json",
                    str(whole / "agree.json"),
                ]
            )
            == 0
        )
    finally:
        server.close()
    table = json.loads((whole / "agree.json").read_text())["table"]
    assert min(table[f"kappa {k}"]["A~B"] for k in ("alpha", "sigma", "rho")) >= 0.6, table


def strict_json(line: str):
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def test_cohen_kappa_undefined_for_a_judge_of_one_level_leaves_every_file_json(tmp_path, capsys):
    """Cohen's kappa is undefined when the judge gives one level throughout: the run goes on, its files hold
    null (never NaN, which is not JSON), and the tools read them."""
    server = JudgeServer(lambda body: (200, completion('{"alpha": 1, "sigma": 1, "rho": 1}')))
    out = tmp_path / "run"
    try:
        assert (
            run(DISTILL + ["--judge-base-url", server.url, "--steps", "4", "--out", str(out)]) == 0
        )
    finally:
        server.close()
    metrics = [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [strict_json(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    for m in metrics:
        assert all(v is None or math.isfinite(v) for v in m["distill"]["kappa"].values())
        assert all(v is None or math.isfinite(v) for v in m["distill"]["spearman"].values())
    assert run(["plot", str(out)]) == 0 and run(["show", str(out), "--judged"]) == 0
