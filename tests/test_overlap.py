"""--async-level 1 (machinery/overlap.py): the truncated importance ratio's gradient, the lag each
batch records, the exact resume, and the combinations refused before anything runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import stratagem as S
from machinery import UserError, lifecycle, lora, overlap, runfiles
from tests.common import (  # noqa: F401 - the session's fixture
    assert_resumed_exactly,
    error_of,
    fresh,
    learner,
    make_batch,
    no_process_left_behind,
    read_jsonl,
    run,
    tiny_fixture,
)


def planted(model, trajs, shift):
    """Each turn's log mu planted: the model's own log-probs of its response less `shift` (one
    value a response), so that pi / mu = exp(shift) exactly."""
    for traj, s in zip(trajs, shift):
        for turn in traj.turns:
            ids = torch.tensor([turn.prompt_ids + turn.response_ids])  # [1, T]
            with torch.no_grad():
                logps = S.sequence_logprobs(
                    model, ids, torch.ones_like(ids), len(turn.response_ids), 1.0
                )
            turn.behaviour = logps[0] - s  # [r]


def test_corrected_gradient_is_the_hand_computed_truncated_ratio_and_level_0_computes_none(tiny):
    model, _ = fresh(tiny)
    args = S.Args(tiny=True, micro_batch_size=2, max_grad_norm=1e9)
    trajs = make_batch([5, 6, 7], [[8, 9, 10], [11, 12], [13, 14, 15, 16]], [1.0, -0.5, 2.0])
    shift = [1.5, -0.5, 0.25]  # ratios e^1.5 = 4.48 (capped at 2), e^-0.5 = 0.61, e^0.25 = 1.28
    planted(model, trajs, shift)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    # the update's own path: SGD at lr 1 moves each weight by minus its gradient
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    lagged = learner(model, sgd, args)
    lagged.overlap = SimpleNamespace(
        cap=2.0, sums=dict.fromkeys(("ratio", "capped", "tokens"), 0.0)
    )
    S.policy_update(lagged, trajs, 10.0)
    moved = {n: start[n] - p.detach() for n, p in model.named_parameters()}

    # by hand: -sum_t A_mod * min(exp(shift), 2) * grad log pi(y_t) / 10, one sequence at a time
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    model.zero_grad()
    loss = 0.0
    for traj, s in zip(trajs, shift):
        turn = traj.turns[0]
        ids = torch.tensor([turn.prompt_ids + turn.response_ids])  # [1, T]
        logps = S.sequence_logprobs(model, ids, torch.ones_like(ids), len(turn.response_ids), 1.0)
        loss = loss - traj.a_mod * min(torch.e**s, 2.0) * logps.sum() / 10.0
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(moved[n], p.grad, atol=1e-6, rtol=1e-4), n
    assert lagged.overlap.sums["tokens"] == 9 and lagged.overlap.sums["capped"] == 3

    # --async-level 0: the weights go back untouched (the same tensor), nothing computed
    weights = torch.ones(2, 3)
    assert overlap.corrected(SimpleNamespace(overlap=None), None, [], weights) is weights
    assert overlap.corrected(learner(model, sgd, args), None, [], weights) is weights


TINY = ["--tiny", "--batch-size", "16", "--num-envs", "4", "--async-level", "1"]


def test_batch_records_its_lag_and_an_async_run_resumes_to_the_losses_of_an_uninterrupted_one(
    tmp_path,
):
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run([*TINY, "--steps", "4", "--out", str(whole)]) == 0
    assert run([*TINY, "--steps", "2", "--out", str(part)]) == 0
    assert run(["--resume", "--steps", "4", "--out", str(part)]) == 0
    metrics = read_jsonl(whole / "metrics.jsonl")
    # batch t is played by the weights of step t - 2 (the first, by the initial ones): lag 1
    assert [m["async"]["played_by"] for m in metrics] == [0, 0, 1, 2]
    assert [m["async"]["lag"] for m in metrics] == [0, 1, 1, 1]
    assert metrics[0]["async"]["is_ratio_mean"] == 1.0  # equal weights: the ratio is exactly 1
    assert all(0 < m["async"]["is_ratio_mean"] <= 2 for m in metrics)
    assert all("wait" in m["time_split_s"] for m in metrics[:3])  # the learner's idle time
    assert_resumed_exactly(whole, part, 4)  # the losses, the trajectories, the weights


def test_lora_rank_at_async_level_1_checkpoints_the_adapters_alone_and_resumes_exactly(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    lora = [*TINY, "--lora-rank", "4"]
    assert run([*lora, "--steps", "3", "--out", str(whole)]) == 0
    assert run([*lora, "--steps", "2", "--out", str(part)]) == 0
    assert run(["--resume", "--steps", "3", "--out", str(part)]) == 0
    assert [m["async"]["lag"] for m in read_jsonl(whole / "metrics.jsonl")] == [0, 1, 1]
    state = torch.load(whole / "checkpoints/step-000003/trainer_state.pt", weights_only=True)
    kept = state["overlap"]["weights"]  # step 2's adapters, the base left out
    assert state["overlap"]["version"] == 2 and kept and all("lora_" in k for k in kept)
    assert_resumed_exactly(whole, part, 3)


def test_own_is_the_adapters_alone_and_sync_copies_them_while_the_base_is_shared(tiny):
    model, _ = fresh(tiny)
    args = S.Args(tiny=True, lora_rank=4, async_level=1)
    learner_model = lora.add_adapters(model, args)
    o = overlap.Overlap(
        SimpleNamespace(args=args, policy=SimpleNamespace(), model=learner_model, start=0), None
    )
    mine, theirs = dict(learner_model.named_parameters()), dict(o.engine.model.named_parameters())
    for name, p in mine.items():
        assert (theirs[name] is p) == ("lora_" not in name), name  # the base shared, adapters own
    with torch.no_grad():
        next(p for n, p in mine.items() if "lora_B" in n).add_(1.0)  # an update moves the learner
    assert overlap.own(o.engine.model).keys() == overlap.own(learner_model).keys()
    assert not all(torch.equal(theirs[n], p) for n, p in mine.items())
    o.sync(SimpleNamespace(model=learner_model), 2)  # before update 2: update 1's weights
    assert all(torch.equal(theirs[n], p) for n, p in mine.items()) and o.version == 1


def test_async_level_0_writes_no_record_and_no_generator(tmp_path):
    out = tmp_path / "zero"
    assert (
        run(["--tiny", "--batch-size", "8", "--num-envs", "2", "--steps", "1", "--out", str(out)])
        == 0
    )
    assert "async" not in read_jsonl(out / "metrics.jsonl")[0]
    state = torch.load(out / "checkpoints/step-000001/trainer_state.pt", weights_only=True)
    assert "overlap" not in state


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--async-level", "2"], "--async-level must be 0 or 1, got 2"),
        (["--is-cap", "3"], "--is-cap bounds --async-level 1's importance ratio"),
        (["--async-level", "1", "--is-cap", "0.5"], "--is-cap must be in [1, 1000], got 0.5"),
        (["--async-level", "1", "--backend", "vllm"], "cannot overlap with --backend vllm"),
        (["--async-level", "1", "--distill"], "cannot overlap with --distill"),
        (["--async-level", "1", "--ppo-epochs", "2"], "cannot overlap with --ppo-epochs"),
        (
            ["--async-level", "1", "--opponents", "self=0.5,random=0.5"],
            "cannot overlap with --opponents",
        ),
    ],
)
def test_check_refuses_what_cannot_overlap_in_one_line_before_anything_runs(
    capsys, tmp_path, flags, said
):
    err = error_of(capsys, ["--tiny", "--steps", "1", "--out", str(tmp_path / "r"), *flags])
    assert said in err
    assert not (tmp_path / "r").exists()


def test_dry_run_counts_the_generators_copy_of_the_weights(capsys):
    assert run(["--dry-run", "--model", "tiny", "--tiny"]) == 0
    plain = capsys.readouterr().out
    assert run(["--dry-run", "--model", "tiny", "--tiny", "--async-level", "1"]) == 0
    beside = capsys.readouterr().out
    assert "frozen copies" not in plain and "frozen copies" in beside
    lora_flags = ["--lora-rank", "4", "--async-level", "1"]
    assert run(["--dry-run", "--model", "tiny", "--tiny", *lora_flags]) == 0
    assert "frozen copies" not in capsys.readouterr().out  # its generator shares the base


def test_problem_names_a_checkpointed_generator_of_another_shape_step_or_level(tiny):
    model, _ = fresh(tiny)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    one, zero = SimpleNamespace(async_level=1), SimpleNamespace(async_level=0)
    state = lambda version, w: {"step": 3, "overlap": {"version": version, "weights": w}}  # noqa: E731
    assert overlap.problem(one, state(2, weights), model) is None
    assert "this run has --async-level 0" in overlap.problem(zero, state(2, weights), model)
    assert "'overlap' is null" in overlap.problem(one, {"step": 3, "overlap": None}, model)
    for version in (4, 1):  # every checkpoint at level 1 holds the step before its own
        said = f"holds step {version}'s weights, not step 2's"
        assert said in overlap.problem(one, state(version, weights), model)
    key = next(iter(weights))
    cut = weights | {key: weights[key][:1]}
    assert "another shape" in overlap.problem(one, state(2, cut), model)
    whole = weights | {key: weights[key].to(torch.int64)}  # cast silently, were it loaded
    assert "another shape or dtype" in overlap.problem(one, state(2, whole), model)
    ok = runfiles.TRAINER_STATE["overlap"][1]
    assert ok(None) and ok(state(2, weights)["overlap"])
    assert not ok({"version": "2", "weights": weights}) and not ok(
        {"version": 2, "weights": {"w": 1}}
    )


@pytest.mark.slow
def test_async_level_1_runs_on_hf_with_a_judge_adaptive_beta_and_evaluations(tmp_path):
    out = tmp_path / "slow"
    argv = [*TINY, "--steps", "5", "--eval-every", "2", "--eval-n", "2", "--beta-share", "0.3"]
    assert run([*argv, "--out", str(out)]) == 0
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if "transitions" in m]
    assert [m["async"]["lag"] for m in metrics] == [0, 1, 1, 1, 1]
    assert all(m["beta"]["value"] > 0 for m in metrics)
    assert [m["step"] for m in metrics if "eval" in m] == [2, 4]


def test_start_refuses_a_model_with_dropout_in_one_line(tiny):
    args = SimpleNamespace(async_level=1, is_cap=2.0)
    model, _ = fresh(tiny)
    model.config.attention_dropout = 0.1
    with pytest.raises(UserError, match=r"without dropout \(attention_dropout 0\.1\)"):
        overlap.start(SimpleNamespace(args=args, dist=SimpleNamespace(world=1), model=model), None)
    model, _ = fresh(tiny)
    model.model.layers[0].mlp = torch.nn.Sequential(
        model.model.layers[0].mlp, torch.nn.Dropout(0.2)
    )
    assert overlap.dropouts(model) == "a Dropout of p 0.2"
    assert overlap.dropouts(fresh(tiny)[0]) == ""  # the tiny model: none, so it overlaps


@pytest.mark.parametrize("level", [0, 1])
def test_checkpointing_at_level_1_leaves_the_random_state_to_the_thread(tiny, level):
    """torch's recompute in backward draws what the forward drew (its RNG state set back) at level 0;
    at 1 it must not touch the process's state, which the playing thread samples from."""
    model, _ = fresh(tiny)
    model.gradient_checkpointing_enable(overlap.checkpointing(SimpleNamespace(async_level=level)))
    model.train()
    drawn = []
    model.model.layers[0].input_layernorm.register_forward_pre_hook(
        lambda *_: drawn.append(torch.rand(1).item())
    )
    torch.manual_seed(0)
    ids = torch.tensor([[5, 6, 7, 8]])  # [1, T]
    model(ids).logits.sum().backward()
    assert len(drawn) == 2  # the forward, then the recompute
    assert (drawn[0] == drawn[1]) == (level == 0)


def test_backend_auto_on_a_gpu_with_vllm_plays_hf_at_level_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        lifecycle, "pick_backend", lambda spec, device: ("vllm", "auto: a GPU and vLLM")
    )
    flags = ["--tiny", "--dry-run", "--async-level", "1", "--out", str(tmp_path / "r")]
    assert run(flags) == 0
    assert "auto: --async-level 1 plays on a second copy, with HF" in capsys.readouterr().out
    assert "--backend vllm" in error_of(capsys, flags + ["--backend", "vllm"])
