"""Tests of LoRA through PEFT (machinery/lora.py, memory.py): the flags, the update through the adapters, the
merge, a whole run and its resume, torchrun, and the memory projection."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import stratagem as S
from machinery import distributed
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    HERE,
    LORA,
    SMALL,
    dry_run,
    error_of,
    fresh,
    learner,
    no_process_left_behind,
    only_the_vllm_tests,
    read_jsonl,
    run,
    tiny_fixture,
    torchrun,
)

ALL_LINEAR = tuple(S.Args.lora_targets.split(","))  # --lora-targets' default: every linear layer


# ---- LoRA through PEFT: the flags, the update, the merge, a run, under torchrun, the memory
def test_lora_rank_and_its_flags_are_checked_in_one_line_before_any_work(tmp_path, capsys):
    for argv, message in [
        (
            ["--lora-alpha", "16"],
            "--lora-alpha, --lora-dropout and --lora-targets shape LoRA's adapters: give",
        ),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
        (
            ["--lora-rank", "4", "--lora-targets", "q_proj,"],
            "--lora-targets must be comma-separated layer names",
        ),
        (["--lora-rank", "4", "--lora-targets", "nope_proj"], "--lora-targets nope_proj: "),
    ]:
        assert message in error_of(capsys, ["--tiny", "--out", str(tmp_path / "r"), *argv]), argv
        assert not (tmp_path / "r").exists()
    assert (
        S.Args().lora_rank == 0
        and S.Args().lora_alpha == 0
        and S.Args(lora_rank=8).lora_alpha == 16.0
    )


TOY = [([5, 6, 7], [3, 4], 1.0), ([8, 9], [5], -0.5), ([10, 11, 12, 13], [6, 7, 8], 0.25)]


def toy_batch(items=TOY) -> list[S.Trajectory]:
    return [S.Trajectory("toy", 0, [S.Turn("", "", "", p, r)], 0.0, a_mod=a) for p, r, a in items]


def lora_model(tiny, rank: int = 4):
    from machinery import lora

    return lora.add_adapters(fresh(tiny)[0], S.Args(tiny=True, model="tiny", lora_rank=rank))


def test_policy_update_with_lora_is_the_full_gradient_through_the_adapters_and_spares_the_base(
    tiny,
):
    """Same loss, normaliser and update: at B = 0 the adapted model computes the base's log-probs, so dL/dB =
    (alpha / R) dL/dW A^T, dL/dA = 0, with dL/dW the full fine-tuning gradient of the same batch; the base is frozen
    bit for bit, and Adam holds state for the adapters alone."""
    from machinery import lora

    args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=1, max_grad_norm=1e9)
    full, _ = fresh(tiny)
    before = {n: p.detach().clone() for n, p in full.named_parameters()}
    S.policy_update(
        learner(full, torch.optim.SGD(full.parameters(), lr=1.0), args, distributed.Dist()),
        toy_batch(),
        24.0,
    )
    grad = {
        n: before[n] - p.detach() for n, p in full.named_parameters()
    }  # lr 1: the step is the gradient
    model = lora_model(tiny)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapters) == 2 * 7 * 2 and all(p.dtype == torch.float32 for p in adapters.values())
    S.policy_update(
        learner(model, torch.optim.SGD(lora.trainable(model), lr=1.0), args, distributed.Dist()),
        toy_batch(),
        24.0,
    )
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in frozen.items())
    for module, scale in lora.adapter_scalings(model).items():
        a = adapters[f"{module}.lora_A.default.weight"]
        w = grad[module.removeprefix("base_model.model.") + ".weight"]
        step_b = (
            adapters[f"{module}.lora_B.default.weight"] - after[f"{module}.lora_B.default.weight"]
        )
        assert scale == 2.0 and torch.allclose(step_b, scale * w @ a.T, rtol=1e-4, atol=1e-7), (
            module
        )
        assert torch.equal(after[f"{module}.lora_A.default.weight"], a)
    assert max(g.abs().max() for g in grad.values()) > 0


def test_merged_weights_of_lora_are_pefts_merge_under_the_base_models_names(tiny):
    import copy

    from machinery import lora

    model = lora_model(tiny)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    merged = lora.merged_weights(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    base, _ = fresh(tiny)
    assert set(merged) == {n for n, _ in base.named_parameters()}
    assert all(torch.allclose(merged[n], reference[n], atol=1e-6) for n in merged)
    assert not torch.equal(
        merged["model.layers.0.mlp.down_proj.weight"], base.model.layers[0].mlp.down_proj.weight
    )
    assert torch.equal(merged["model.embed_tokens.weight"], base.model.embed_tokens.weight)


def adapter_of(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(ckpt / "adapter_model.safetensors")


def test_lora_rank_run_resumes_exactly_saves_pefts_format_and_merges_into_a_model_eval_loads(
    tmp_path, capsys
):
    from transformers import AutoModelForCausalLM

    from machinery import lora, memory

    flags = SMALL + LORA + ["--mode", "spiral"]  # A_mod = A_game: every step moves the adapters
    whole, part, merged = tmp_path / "whole", tmp_path / "part", tmp_path / "merged"
    assert run(flags + ["--steps", "2", "--out", str(whole)]) == 0
    assert run(flags + ["--steps", "1", "--out", str(part)]) == 0
    assert run(["--resume", "--out", str(part), "--steps", "2"]) == 0
    assert read_jsonl(part / "trajectories.jsonl") == read_jsonl(whole / "trajectories.jsonl")
    drop = ("time_s", "elapsed_s", "time_split_s")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in drop} for r in rows]  # noqa: E731
    assert strip(read_jsonl(part / "metrics.jsonl")) == strip(read_jsonl(whole / "metrics.jsonl"))
    ckpt = whole / "checkpoints/step-000002"
    a, b = adapter_of(ckpt), adapter_of(part / "checkpoints/step-000002")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads(
        (ckpt / "adapter_config.json").read_text()
    )  # PEFT's own format, beside the run's state
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert set(config["target_modules"]) == set(S.Args.lora_targets.split(","))
    assert (
        not (ckpt / "model.safetensors").exists() and all("lora_" in k for k in a) and len(a) == 28
    )
    assert max(t.abs().max() for k, t in a.items() if "lora_B" in k) > 0  # the adapters learned
    adam = torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"]["state"].values()
    trained = sum(s["exp_avg"].numel() for s in adam)  # Adam holds state for the adapters alone
    shape = S.model_shape(S.Args(tiny=True, seed=1))
    assert (
        trained
        == sum(t.numel() for t in a.values())
        == memory.adapter_parameters(shape, 4, ALL_LINEAR)
    )
    assert sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in adam) == 8 * trained
    assert run(["merge-lora", str(whole), str(merged)]) == 0
    assert "merged the adapter of" in capsys.readouterr().out
    S.build_random_model(str(tmp_path / "base"), 1)  # the run's base (--tiny, --seed 1)
    base = S.load_policy(str(tmp_path / "base"), S.torch.device("cpu"))[0]
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        plain = base(ids).logits
        adapted = lora.load_adapters(base, ckpt, trainable=False)(
            ids
        ).logits  # PEFT's own reading of the adapter
        whole_model = AutoModelForCausalLM.from_pretrained(merged)(
            ids
        ).logits  # a plain HF checkpoint, like a full run's
    assert torch.allclose(whole_model, adapted, atol=1e-5) and not torch.allclose(
        whole_model, plain, atol=1e-5
    )
    eval_json = tmp_path / "e.json"
    argv = [
        "eval",
        str(merged),
        "--games",
        "TicTacToe-v0",
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--json",
        str(eval_json),
    ]
    assert run(argv) == 0 and len(json.loads(eval_json.read_text())["games"]) == 2
    # the LoRA run itself, as its closing line prints `eval RUN`: merged in memory, the same games
    # (this was "holds a LoRA adapter, not a whole model: write one with ... merge-lora")
    lora_json = tmp_path / "lora.json"
    assert run(["eval", str(whole), *argv[2:-1], str(lora_json)]) == 0
    played = [json.loads(p.read_text())["games"] for p in (eval_json, lora_json)]
    assert played[0] == played[1]
    assert "vLLM loads whole models; write one with python stratagem.py merge-lora" in error_of(
        capsys, ["eval", str(whole), "--backend", "vllm", "--n", "1"]
    )
    assert "already exists" in error_of(capsys, ["merge-lora", str(whole), str(merged)])
    assert "no LoRA adapter there" in error_of(
        capsys, ["merge-lora", str(tmp_path), str(tmp_path / "m2")]
    )


FSDP_LORA_WORKER = """
import sys, torch
from types import SimpleNamespace
from pathlib import Path
sys.path.insert(0, {here!r})
import stratagem as S
from machinery import distributed, lora, runfiles
dist = distributed.Dist()
model, tok = S.load_policy({model!r}, torch.device("cpu"))
model = lora.add_adapters(model, S.Args(tiny=True, model="tiny", lora_rank=4))
distributed.shard(model)
args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=1, max_grad_norm=1e9)
items = {items!r}
mine = items[:2] if dist.main else items[2:]  # two micro-batches on rank 0, one on rank 1
batch = [S.Trajectory("toy", 0, [S.Turn("", "", "", p, r)], 0.0, a_mod=a) for p, r, a in mine]
optimizer = torch.optim.Adam(lora.trainable(model), lr=1e-2)
learner = SimpleNamespace(model=model, optimizer=optimizer, args=args, device=torch.device("cpu"), tokenizer=tok,
                            dist=dist, reference=None)
S.policy_update(learner, batch, 3 * 8 / dist.world)
merged = lora.merged_weights(model)  # a collective: every rank
if dist.main:
    torch.save(merged, {out!r})
    (Path({run!r}) / "checkpoints").mkdir(parents=True)
runfiles.save_checkpoint(Path({run!r}), 1, model, tok, optimizer, shared={{}}, own={{}}, dist=dist)
dist.close()
distributed.leave(0)  # as a run's rank leaves: gloo's threads can abort the interpreter's teardown
"""


@pytest.mark.slow
def test_policy_update_with_lora_under_fsdp2_equals_one_process_and_saves_the_adapter(
    tiny, tmp_path
):
    """Two CPU ranks (gloo) shard the adapted model; one Adam step on their halves of the batch gives the adapters,
    the merged weights the engine gets and the checkpoint's adapter of one process on the whole batch."""
    from machinery import lora

    script = tmp_path / "worker.py"
    out, saved = tmp_path / "merged.pt", tmp_path / "run"
    script.write_text(
        FSDP_LORA_WORKER.format(
            here=str(HERE), model=str(tiny), items=TOY, out=str(out), run=str(saved)
        )
    )
    torchrun([str(script)], tmp_path)
    model = lora_model(tiny)
    optimizer = torch.optim.Adam(lora.trainable(model), lr=1e-2)
    args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=1, max_grad_norm=1e9)
    S.policy_update(learner(model, optimizer, args, distributed.Dist()), toy_batch(), 24.0)
    sharded, single = torch.load(out), lora.merged_weights(model)
    assert set(sharded) >= set(single) and all(
        torch.allclose(sharded[n], single[n], atol=1e-6) for n in single
    )
    adapter = adapter_of(saved / "checkpoints/step-000001")
    mine = {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}
    assert set(adapter) == set(mine) and all(
        torch.allclose(adapter[n], mine[n], atol=1e-6) for n in mine
    )
    assert max(t.abs().max() for n, t in adapter.items() if "lora_B" in n) > 1e-3


def test_project_lora_memory_against_an_independent_count_and_the_tiny_model_measured(tiny):
    """Qwen3-4B-Base: 4,022,468,096 parameters (its config.json's shapes, counted by hand below); full fine-tuning
    holds 16 bytes a parameter in weights, gradients and Adam (fp32 each; ZeRO's count, arXiv:1910.02054); LoRA rank
    16 on every projection trains 16 x (in + out) per projection and layer. The tiny model: the projection's
    parameters, adapters and Adam bytes are those the CPU holds after one step."""
    from machinery import lora, memory

    shape = S.model_shape(S.Args(model="Qwen/Qwen3-4B-Base"))
    h, i, q, kv, v, layers = 2560, 9728, 32 * 128, 8 * 128, 151936, 36
    by_hand = (
        v * h + layers * (h * q + 2 * h * kv + q * h + 3 * h * i + 2 * 128 + 2 * h) + h
    )  # tied head
    assert memory.parameters(shape) == by_hand == 4_022_468_096
    full = memory.project(shape, 0, [], 4, 4096, False, gpu=True)
    assert (
        full["weights"] + full["gradients"] + full["adam"] == 16 * by_hand
        and full["bf16_copies"] == 2 * by_hand
    )
    adapters = 16 * layers * (2 * (h + q) + 2 * (h + kv) + 3 * (h + i))
    lora16 = memory.project(shape, 16, list(ALL_LINEAR), 2, 4096, True, gpu=True)
    assert lora16["trained"] == adapters == 33_030_144
    assert (lora16["weights"], lora16["adam"], lora16["gradients"]) == (
        2 * by_hand + 4 * adapters,
        8 * adapters,
        4 * adapters,
    )
    assert lora16["kv_per_token"] == 2 * layers * kv * 2 and lora16["vllm_weights"] == 2 * by_hand
    card = memory.verdict(
        lora16, 24564 * 2**20, 0.45
    )  # the sync: vLLM's bf16 weights awake + the merged bf16 copy
    assert card["syncing"] == lora16["weights"] + lora16["adam"] + 4 * by_hand
    assert card["peak"] == max(card["generating"], card["learning"], card["syncing"])
    for rank in (0, 4):  # the tiny model on the CPU, after one Adam step
        model = lora_model(tiny, rank) if rank else fresh(tiny)[0]
        optimizer = torch.optim.Adam(lora.trainable(model), lr=1e-3)
        args = S.Args(tiny=True, max_new_tokens=8, micro_batch_size=1)
        S.policy_update(learner(model, optimizer, args, distributed.Dist()), toy_batch(), 24.0)
        m = memory.project(
            S.model_shape(S.Args(tiny=True, tiny_init="random", seed=0)),
            rank,
            list(ALL_LINEAR),
            1,
            8,
            False,
            gpu=False,
        )
        held = {id(p): p for p in model.parameters()}.values()
        assert m["parameters"] == sum(p.numel() for p in held if not rank or not p.requires_grad)
        assert m["weights"] == sum(p.numel() * p.element_size() for p in held)
        state = optimizer.state_dict()["state"].values()
        assert m["adam"] == sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in state)
        assert m["gradients"] == m["adam"] / 2 and m["bf16_copies"] == 0


def saved_bytes_per_token(layers: int, tokens: tuple[int, int] = (2, 7)) -> float:
    """What autograd saves for the backward pass of the learner's forward (sequence_logprobs) under bf16 autocast, CPU
    autocast standing in for CUDA's: bytes per token, each storage once, autocast's cached weight copies set apart."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {**S.ARCHS["tiny"], "num_hidden_layers": layers, "vocab_size": 200}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True)).train()
    weights = {tuple(p.shape) for p in model.parameters()}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = (
            t.untyped_storage().nbytes(),
            tuple(t.shape),
            t.dtype,
        )
        return t

    ids = torch.randint(0, 200, tokens)
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        S.sequence_logprobs(model, ids, torch.ones_like(ids), tokens[1] - 1, 1.0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = [
        n
        for ptr, (n, shape, dtype) in seen.items()
        if ptr not in params and not (dtype == torch.bfloat16 and shape in weights)
    ]
    return sum(kept) / (tokens[0] * tokens[1])


def test_project_counts_the_activations_autograd_saves():
    """The projection's bytes per token and decoder layer, 26h + 8i + 10.25q + 10kv, against autograd's saved tensors
    of one more layer of the tiny Qwen3 (h 64, i 128, q 128, kv 64)."""
    from machinery import memory

    measured = saved_bytes_per_token(2) - saved_bytes_per_token(1)
    projected = memory.project({**S.ARCHS["tiny"], "vocab_size": 200}, 0, [], 1, 1, False, gpu=True)
    h, i, q, kv = 64, 128, 128, 64
    assert 26 * h + 8 * i + 10.25 * q + 10 * kv == 4640
    assert measured == pytest.approx(4640, rel=0.02)
    tokens = memory.PROMPT_TOKENS + 1  # one sequence: the assumed prompt and a one-token response
    assert (
        projected["activations"] == 2 * tokens * 4640 + 12 * 200 * 2
    )  # two layers, and the head's logits


def memory_lines(out: str) -> list[str]:
    """The dry run's memory lines for the cards (the learner, vLLM's share, the verdicts), without this
    machine's own ("this CPU: ... GiB free now"), which no doc can quote."""
    return [x for x in out.splitlines() if not x.startswith("this CPU: ")]


@pytest.mark.slow
def test_dry_run_says_whether_the_papers_model_fits_on_each_card_with_or_without_lora():
    lines = memory_lines(dry_run().stdout)
    assert (
        "memory per device, GiB (4.02 B parameters; full fine-tuning): weights 15.0, gradients 15.0, Adam 30.0"
        in lines[-3]
    )
    assert (
        lines[-1].startswith(  # each card's --micro-batch-size auto: the paper's flags fit an H200
            "will it fit? 24 GB (RTX 4090): micro-batch 1, gradient checkpointing on: does NOT fit"
        )
        and "141 GB (H200): micro-batch 1: fits" in lines[-1]
    )
    recipe = dry_run(
        "--lora-rank",
        "16",
        "--gradient-checkpointing",
        "--micro-batch-size",
        "2",
        "--vllm-gpu-memory-utilization",
        "0.6",
    )
    assert recipe.returncode == 0 and recipe.stderr == ""
    lines = memory_lines(recipe.stdout)
    assert (
        "(4.02 B parameters; LoRA rank 16: 33.03 M trained)" in lines[-3]
        and "memory of vLLM on the cards below (the engine --backend auto takes on a GPU; not on"
        in lines[-2]
        and ": 0.6 of the device" in lines[-2]
    )
    assert (
        "24 GB (RTX 4090): does NOT fit" in lines[-1] and "48 GB (L40S, A6000): fits" in lines[-1]
    )
    speed = (HERE / "docs" / "speed.md").read_text()
    assert all(line in speed for line in lines[-3:])  # the recipe's projection is quoted as printed


def test_bench_with_lora_sets_adam_state_beside_full_fine_tuning(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    argv = [
        "bench",
        "--json",
        str(out),
        "--tiny",
        *LORA,
        "--steps",
        "1",
        "--batch-size",
        "8",
        "--num-envs",
        "4",
        "--max-new-tokens",
        "8",
    ]
    assert run(argv) == 0
    res = read_jsonl(out)[0]["results"]
    from machinery import memory

    shape = S.model_shape(S.Args(tiny=True, seed=1))
    assert res["lora"]["trained_parameters"] == memory.adapter_parameters(shape, 4, ALL_LINEAR)
    assert res["full"]["trained_parameters"] == memory.parameters(shape)
    for mode in ("lora", "full"):  # two fp32 moments per trained parameter, and Adam's step counts
        assert res[mode]["optimizer_state_mb"] * 2**20 >= 8 * res[mode]["trained_parameters"]
        assert set(res[mode]["time_split"]) == {
            "generate",
            "game",
            "judge",
            "learn",
            "sync",
            "other",
        }
    printed = capsys.readouterr().out
    assert re.search(
        r"Adam state MB\s+[\d.]+\s+[\d.]+", printed
    ) and "lora        full" in printed.replace("  ", "  ")
