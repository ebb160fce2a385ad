"""Tests of --micro-batch-size auto and --device-memory (machinery/memory.py's choose, fit, plan_lines) and of the
update's retry when the projection was wrong (machinery/lifecycle.py's halve_on_oom): pure arithmetic and in-process
calls on the tiny model, but for one short run (slow tier)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import stratagem as S
from machinery import UserError, distributed, flags, lifecycle, memory, runfiles, saved_config
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    error_of,
    fresh,
    learner,
    make_batch,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    tiny_fixture,
)

CARD = {name.split()[0]: mib * 2**20 for name, mib in memory.DEVICES.items()}  # "141": bytes


def paper(*argv: str) -> S.Args:
    """The paper's command, `python stratagem.py --beta 0.2`, with `argv` added: parsed, nothing run."""
    return S.parse_args(["--beta", "0.2", *argv])


def qwen3_4b(args: S.Args) -> dict:
    return memory.checked(args, S.model_shape(args))[0]


def learning(args: S.Args, micro_batch: int, checkpointing: bool, gpu: bool = True) -> float:
    """The learning phase's bytes, summed by hand from memory.project's parts (vLLM asleep)."""
    shape = memory.checked(args, S.model_shape(args))[0]
    targets = args.lora_targets.split(",")
    m = memory.project(
        shape, args.lora_rank, targets, micro_batch, args.max_new_tokens, checkpointing, gpu
    )
    return m["weights"] + m["adam"] + m["gradients"] + m["bf16_copies"] + m["activations"]


# ---- choose: the largest power of two that fits; checkpointing only where even 1 does not fit without it
def test_choose_picks_the_largest_micro_batch_whose_learning_phase_fits_each_card():
    full, lora16 = paper(), paper("--lora-rank", "16")
    # full fine-tuning of Qwen3-4B: 67.5 GiB of weights, gradients, Adam and bf16 copies, + 40.7 GiB a sequence
    assert learning(full, 1, False) <= CARD["141"] < learning(full, 2, False)
    assert memory.choose(full, qwen3_4b(full), "141 GB (H200)", CARD["141"], True, 0.45) == (
        1,
        False,
        "micro-batch 1 (auto: the largest that fits 141 GB (H200)), gradient checkpointing off",
    )
    # 80 GB: 1 does not fit without checkpointing (108 GiB); with it 77.2, and 2 would be 86.8
    assert learning(full, 1, False) > CARD["80"]
    assert learning(full, 1, True) <= CARD["80"] < learning(full, 2, True)
    assert memory.choose(full, qwen3_4b(full), "80 GB (H100, A100)", CARD["80"], True, 0.45)[
        :2
    ] == (
        1,
        True,
    )
    # LoRA rank 16 on a 48 GB card: 4 with checkpointing (43.1 of 45.0 GiB), 8 would be 78
    assert learning(lora16, 1, False) > CARD["48"]
    assert learning(lora16, 4, True) <= CARD["48"] < learning(lora16, 8, True)
    size, on, line = memory.choose(
        lora16, qwen3_4b(lora16), "48 GB (L40S, A6000)", CARD["48"], True, 0.45
    )
    assert (size, on) == (4, True) and line == (
        "micro-batch 4 (auto: the largest that fits 48 GB (L40S, A6000)), gradient checkpointing on "
        "(auto: needed to fit)"
    )
    # nothing fits a 24 GB card in full fine-tuning: the least memory, said so
    assert learning(full, 1, True) > CARD["24"]
    assert memory.choose(full, qwen3_4b(full), "24 GB (RTX 4090)", CARD["24"], True, 0.45) == (
        1,
        True,
        "micro-batch 1 (auto: not even 1 fits 24 GB (RTX 4090): the least memory), gradient "
        "checkpointing on (auto: needed to fit)",
    )


def test_choose_stays_within_the_batch_per_rank_and_a_cpu_s_most():
    args = paper("--tiny", "--micro-batch-size", "auto", "--batch-size", "20")
    shape = memory.checked(args, S.model_shape(args))[0]
    big = 100 * memory.GiB
    assert memory.choose(args, shape, "cuda", big, True, None)[:2] == (16, False)  # 16 <= 20 < 32
    assert memory.choose(args, shape, "cuda", big, True, None, world=4)[0] == 4  # 5 a rank
    size, _, line = memory.choose(args, shape, "cuda", big, True, None, world=2)
    assert size == 8 and "at most the batch per rank, 10" in line
    size, _, line = memory.choose(args, shape, "this CPU", big, False, None, most=memory.CPU_MOST)
    assert size == 8 and "at most 8 on a CPU" in line


def test_gradient_checkpointing_given_stays_on_and_auto_turns_it_on_only_when_needed():
    given = paper("--gradient-checkpointing", "--device-memory", "141")
    size, on, line = memory.choose(given, qwen3_4b(given), "141 GB (H200)", CARD["141"], True, 0.45)
    assert on and line.endswith("gradient checkpointing on (--gradient-checkpointing)")
    assert learning(given, size, True) <= CARD["141"] < learning(given, 2 * size, True)  # 4
    assert size == 4
    args = paper()
    assert not memory.choose(args, qwen3_4b(args), "141 GB (H200)", CARD["141"], True, 0.45)[1]


# ---- fit: auto resolved for the run's own device before the policy loads
def test_fit_on_a_cpu_uses_the_free_memory_at_most_8_and_leaves_a_number_alone(monkeypatch):
    args = paper("--tiny", "--micro-batch-size", "auto")  # batch 32
    shape = S.model_shape(args)
    cpu = torch.device("cpu")
    monkeypatch.setattr(memory, "free_memory", lambda: 64 * memory.GiB)
    line = memory.fit(args, shape, cpu, 1, None, "auto")
    assert (args.micro_batch_size, args.gradient_checkpointing) == (8, False)
    assert line.startswith(
        "micro-batch 8 (auto: it fits this machine's free memory (64.0 GiB); at most 8"
    )
    tight = (
        learning(args, 2, False, gpu=False) - 1
    )  # 1 fits, 2 does not: the CPU's projection (fp32)
    monkeypatch.setattr(memory, "free_memory", lambda: tight)
    args = paper("--tiny", "--micro-batch-size", "auto")
    memory.fit(args, shape, cpu, 1, None, "auto")
    assert args.micro_batch_size == 1
    args = paper("--tiny")  # the preset's 8, a number: left alone
    assert memory.fit(args, shape, cpu, 1, None, "auto") is None and args.micro_batch_size == 8
    args = paper()
    assert memory.fit(args, None, cpu, 1, None, "auto") == (
        "micro-batch 1 (auto: Qwen/Qwen3-4B-Base's shape is not known offline (no config.json here): the "
        "smallest), gradient checkpointing off"
    )
    assert args.micro_batch_size == 1


def test_cpu_line_gives_the_runs_own_fp32_peak_against_the_free_memory(monkeypatch):
    # --dry-run on a CPU projected only for GPU cards; what the run itself takes here was not said
    # (SmolLM2, docs/real-model.md: 4.1 GiB projected, 4.0 GiB measured whole-process)
    monkeypatch.setattr(memory, "free_memory", lambda: 64 * memory.GiB)
    args = paper("--tiny", "--micro-batch-size", "2", "--max-new-tokens", "32")
    shape = memory.checked(args, S.model_shape(args))[0]
    peak = learning(args, 2, False, gpu=False)
    assert memory.cpu_line(args, shape, 1) == (
        f"this CPU: fits (the learner's peak {memory.gb(peak)} GiB in fp32, micro-batch 2, of 64.0 GiB free now)"
    )
    plan = memory.plan_lines(args, S.model_shape(args), torch.device("cpu"), 1, None, "auto")
    assert memory.cpu_line(args, shape, 1) in plan and plan[-1].startswith("will it fit? 24 GB")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    args.backend = "vllm"
    assert memory.cpu_line(args, shape, 1).endswith(
        "; vLLM adds its bf16 weights 0.0 + its KV cache 1 GiB"
    )


def test_device_memory_projects_for_that_card_even_here():
    args = paper("--device-memory", "141")
    memory.fit(args, qwen3_4b(args), torch.device("cpu"), 1, None, "auto")
    assert (args.micro_batch_size, args.gradient_checkpointing) == (1, False)  # not this CPU's RAM
    assert memory.card(48) == ("48 GB (L40S, A6000)", 46068 * 2**20)  # the table's, nvidia-smi's
    assert memory.card(40) == ("40 GB", 40 * memory.GiB)


# ---- --dry-run: the paper's command fits the card named
def test_plan_lines_of_the_papers_command_fit_141_gb_and_with_lora_16_48_gb():
    cpu = torch.device("cpu")
    args = paper("--device-memory", "141")
    lines = memory.plan_lines(args, S.model_shape(args), cpu, 1, None, "auto")
    assert lines[-2:] == [
        "micro-batch 1 (auto: the largest that fits 141 GB (H200)), gradient checkpointing off",
        "will it fit? 141 GB (H200): fits (peak 108.1 of 140.4, KV cache 55.7: 79 sequences)",
    ]
    assert (
        "activations 40.7 (micro-batch 1 x 5,120 tokens; with --gradient-checkpointing: 9.7)"
        in lines[0]
    )
    args = paper("--lora-rank", "16", "--device-memory", "48")
    lines = memory.plan_lines(args, S.model_shape(args), cpu, 1, None, "auto")
    assert lines[-2:] == [
        "micro-batch 4 (auto: the largest that fits 48 GB (L40S, A6000)), gradient checkpointing on "
        "(auto: needed to fit)",
        "will it fit? 48 GB (L40S, A6000): fits (peak 43.1 of 45.0, KV cache 12.8: 18 sequences)",
    ]
    cards = memory.plan_lines(paper(), S.model_shape(paper()), cpu, 1, None, "auto")[-1].split("; ")
    assert cards[0].startswith(
        "will it fit? 24 GB (RTX 4090): micro-batch 1, gradient checkpointing on: does NOT fit while learning"
    )
    assert cards[2].startswith(
        "80 GB (H100, A100): micro-batch 1, gradient checkpointing on: does NOT fit while generating"
    )
    assert cards[3].startswith("141 GB (H200): micro-batch 1: fits")


def test_device_memory_dry_run_of_the_papers_command_says_fits():
    from tests.common import dry_run

    dry = dry_run("--beta", "0.2", "--device-memory", "141", "--judge", "heuristic")
    assert dry.returncode == 0 and dry.stderr == ""
    assert dry.stdout.splitlines()[-1].startswith("will it fit? 141 GB (H200): fits (peak ")


# ---- the flags: auto or a whole number, one line for anything else
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        (
            ["--micro-batch-size", "foo"],
            "argument --micro-batch-size: a whole number or auto, got 'foo'",
        ),
        (["--micro-batch-size", "2.5"], "a whole number or auto, got '2.5'"),
        (
            ["--device-memory", "-1"],
            "--device-memory must be in [0, 100000] (GB; 0: the device's own)",
        ),
        (["--device-memory", "inf"], "--device-memory must be in [0, 100000]"),
    ],
)
def test_micro_batch_size_and_device_memory_refuse_bad_values_in_one_line(capsys, argv, message):
    assert message in error_of(capsys, ["--dry-run", *argv])


def test_micro_batch_size_is_auto_or_a_number_in_a_saved_config_and_a_resume_may_change_it():
    assert S.Args().micro_batch_size == "auto" and paper("--tiny").micro_batch_size == 8
    assert paper("--micro-batch-size", "16").micro_batch_size == 16
    for value, wording in (
        (2, None),
        ("auto", None),
        ("2", "an integer or auto"),
        (True, "an integer or auto"),
    ):
        assert (
            saved_config.flaw("micro_batch_size", value, S.Args, flags.CHOICES, flags.BOUNDS)
            == wording
        )
    saved = dataclasses.asdict(S.Args(micro_batch_size=2, out="runs/x"))  # what config.json records
    resumed = {"resume": True, "out": "runs/x"}
    assert S.resolve_args(resumed, saved).micro_batch_size == 2
    again = S.resolve_args(
        {**resumed, "micro_batch_size": "auto", "gradient_checkpointing": True}, saved
    )
    assert again.micro_batch_size == "auto" and again.gradient_checkpointing


# ---- halve_on_oom: the projection wrong at run time
def out_of_memory_above(monkeypatch, rows: int, always: bool = False) -> list[int]:
    """S.sequence_logprobs runs out of memory for a micro-batch of more than `rows` sequences (or always);
    returns the sizes it was called with."""
    real, sizes = S.sequence_logprobs, []

    def scored(model, ids, *rest):
        sizes.append(ids.shape[0])
        if always or ids.shape[0] > rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")
        return real(model, ids, *rest)

    monkeypatch.setattr(S, "sequence_logprobs", scored)
    return sizes


def a_run(tiny, tmp_path, micro_batch: int, **kw):
    model = fresh(tiny)[0]
    args = S.Args(
        tiny=True, max_new_tokens=8, micro_batch_size=micro_batch, max_grad_norm=1e9, **kw
    )
    namespace = learner(
        model, torch.optim.SGD(model.parameters(), lr=1.0), args, distributed.Dist()
    )
    namespace.updates, namespace.out = 0, tmp_path
    # as a run's folder holds before step 1
    runfiles.write_config(tmp_path, flags.as_config(args), 0)
    return namespace


BATCH = (
    [[3, 4], [5], [6, 7, 8], [9], [10, 11], [12, 13, 14], [15], [16, 17]],
    [1.0, -0.5, 0.25, 0.7] * 2,
)


def test_halve_on_oom_retries_the_step_at_half_the_micro_batch_with_the_same_loss(
    tiny, tmp_path, monkeypatch, capsys
):
    halved = a_run(tiny, tmp_path, 2)
    batch = make_batch([1, 2], *BATCH)
    want = lifecycle.halve_on_oom(S.policy_update, halved, batch, 24.0, 3)
    assert capsys.readouterr().out == ""
    sizes = out_of_memory_above(monkeypatch, 2)
    tried = a_run(tiny, tmp_path, 4)
    got = lifecycle.halve_on_oom(S.policy_update, tried, make_batch([1, 2], *BATCH), 24.0, 3)
    assert sizes[0] == 4 and set(sizes[1:]) == {2}  # one try at 4, then the step at 2
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["loss"] != 0
    moved = [
        torch.cat([p.detach().flatten() for p in r.model.parameters()]) for r in (halved, tried)
    ]
    assert torch.allclose(*moved, atol=1e-6)  # the failed try left no gradient behind
    assert tried.args.micro_batch_size == 2  # kept for the steps after, and recorded
    assert capsys.readouterr().out == (
        "step 3: out of memory at micro-batch 4: trying the step again at micro-batch 2, kept for the steps "
        "after (config.json)\n"
    )
    assert json.loads((tmp_path / "config.json").read_text())["micro_batch_size"] == 2


def test_halve_on_oom_a_second_out_of_memory_ends_in_one_line(tiny, tmp_path, monkeypatch):
    out_of_memory_above(monkeypatch, 0, always=True)
    tried = a_run(tiny, tmp_path, 4)
    with pytest.raises(UserError) as e:
        lifecycle.halve_on_oom(S.policy_update, tried, make_batch([1, 2], *BATCH), 24.0, 7)
    assert str(e.value) == (
        "step 7: out of memory in the update again at micro-batch 2 (after 4); its last checkpoint is kept: "
        f"resume with --micro-batch-size 1 or --gradient-checkpointing (--resume --out {tmp_path}), or start "
        "again with --lora-rank R or a smaller --max-new-tokens (docs/speed.md#will-it-fit-before-the-run)"
    )
    assert "\n" not in str(e.value) and all(p.grad is None for p in tried.model.parameters())
    one = a_run(tiny, tmp_path, 1, gradient_checkpointing=True)
    with pytest.raises(
        UserError, match=r"^step 7: out of memory in the update at micro-batch 1; .*: start again"
    ):
        lifecycle.halve_on_oom(S.policy_update, one, make_batch([1, 2], *BATCH), 24.0, 7)


def test_halve_on_oom_does_not_retry_under_torchrun_or_after_an_adam_step(
    tiny, tmp_path, monkeypatch
):
    out_of_memory_above(monkeypatch, 2)
    ranks = a_run(tiny, tmp_path, 4)
    ranks.dist = SimpleNamespace(world=2, main=True, gather=lambda x: [x, x])
    with pytest.raises(UserError, match="under torchrun, which does not halve it"):
        lifecycle.halve_on_oom(S.policy_update, ranks, make_batch([1, 2], *BATCH), 24.0, 1)
    assert ranks.args.micro_batch_size == 4

    def stepped_then_failed(run_, trajs, normaliser):  # --ppo-epochs: the second epoch runs out
        run_.updates += 1
        raise torch.OutOfMemoryError("CUDA out of memory")

    moved = a_run(tiny, tmp_path, 4)
    with pytest.raises(UserError, match="after an Adam step of the update"):
        lifecycle.halve_on_oom(stepped_then_failed, moved, [], 24.0, 1)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # not out of memory: untouched
        lifecycle.halve_on_oom(
            lambda *_: (_ for _ in ()).throw(RuntimeError("shape mismatch")), moved, [], 1.0, 1
        )


def test_out_of_memory_knows_the_allocators_failures():
    assert lifecycle.out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert lifecycle.out_of_memory(MemoryError())
    assert lifecycle.out_of_memory(
        RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes"
        )
    )
    assert not lifecycle.out_of_memory(RuntimeError("shape mismatch"))


@pytest.mark.slow
def test_reinforce_halves_the_micro_batch_on_out_of_memory_and_a_resume_keeps_it(
    tmp_path, monkeypatch, capsys
):
    """A run whose update runs out of memory at micro-batch 8 finishes its step at 4, says so, and records 4 in
    config.json (config_history.jsonl says when): the resume uses it. The start line says what auto chose."""
    monkeypatch.setattr(memory, "free_memory", lambda: 64 * memory.GiB)
    sizes = out_of_memory_above(monkeypatch, 4)
    out = tmp_path / "run"
    argv = ["--tiny", "--micro-batch-size", "auto", "--batch-size", "8", "--num-envs", "4"]
    argv += ["--max-new-tokens", "8", "--out", str(out)]
    assert run([*argv, "--steps", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith(
        "| micro-batch 8 (auto: it fits this machine's free memory (64.0 GiB); at most the batch per rank, 8), "
        "gradient checkpointing off"
    )
    assert (
        "step 1: out of memory at micro-batch 8: trying the step again at micro-batch 4, kept for the steps "
        "after (config.json)" in printed
    )
    assert sizes[0] == 8 and max(sizes[1:]) == 4
    assert json.loads((out / "config.json").read_text())["micro_batch_size"] == 4
    assert read_jsonl(out / "config_history.jsonl") == [
        {"step": 1, "changed": {"micro_batch_size": [8, 4]}}
    ]
    sizes.clear()
    assert run(["--resume", "--out", str(out), "--steps", "2"]) == 0
    assert "out of memory" not in capsys.readouterr().out and max(sizes) == 4


def test_halve_on_oom_counts_the_importance_ratio_of_the_retry_alone(tiny, tmp_path):
    tried = a_run(tiny, tmp_path, 4)
    tried.overlap = SimpleNamespace(sums={"ratio": 0.0, "capped": 0.0, "tokens": 0.0})
    tries = []

    def update(run, trajs, normaliser):  # each try scores 10 tokens; the first runs out of memory
        run.overlap.sums = {k: v + 10.0 for k, v in run.overlap.sums.items()}
        tries.append(run.args.micro_batch_size)
        if len(tries) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")
        return {"loss": 0.5}

    assert lifecycle.halve_on_oom(update, tried, [], 24.0, 3) == {"loss": 0.5}
    assert tries == [4, 2] and tried.overlap.sums == dict.fromkeys(
        ("ratio", "capped", "tokens"), 10.0
    )
