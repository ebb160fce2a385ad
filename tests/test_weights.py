"""Tests of the weights a run saves and loads, and of the code a model folder could carry: only finite, float,
code-free weights are saved or loaded (the fifth attack, docs/reliability.md). Each failed before its fix."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import stratagem as S
from machinery import UserError, lifecycle, memory, modelfiles
from tests.common import (  # noqa: F401  (fixtures, found by their names; the autouse two apply by being imported)
    SMALL,
    error_of,
    fresh,
    no_process_left_behind,
    not_for_the_vllm_tests,
    one_step_run_fixture,
    only_the_vllm_tests,
    read_jsonl,
    run,
    tiny_fixture,
    tree_of,
)

KEEP = ["--eval-every", "1", "--eval-n", "2", "--eval-games", "KuhnPoker-v1", "--keep-best"]
EVAL = ["--n", "1", "--games", "KuhnPoker-v1"]


def copy_of(folder: Path, tmp_path: Path, name: str = "copy") -> Path:
    shutil.copytree(folder, tmp_path / name)
    return tmp_path / name


def edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# ---- 1. a non-finite update stops the run before anything of it is played, kept or saved
def test_resume_refuses_a_nan_in_adams_state_naming_the_file_and_the_tensor(
    one_step_run, tmp_path, capsys
):
    out = copy_of(one_step_run, tmp_path)
    path = out / "checkpoints" / "step-000001" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"]["state"][0]["exp_avg"][0, 0] = float("nan")
    torch.save(state, path)
    before = tree_of(out)
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "3", "--save-every", "1"])
    assert err == (
        f"stratagem: error: --resume: {path}: optimizer.state.0.exp_avg is not finite (NaN or "
        "infinity); restore it\n"
    )
    after = tree_of(out)
    assert {k: v for k, v in after.items() if k != "run.lock"} == {
        k: v for k, v in before.items() if k != "run.lock"
    }


def test_check_update_stops_a_run_whose_update_makes_the_weights_nan_keeping_the_good_files(
    tmp_path, capsys, monkeypatch
):
    """A NaN planted in Adam's state before step 3's update (finite gradients, NaN weights after it): the run stops
    in one line naming step 3, before step 3 is evaluated, logged, kept as best or saved."""
    real = S.make_optimizer

    def poisoned(model, args):
        optimizer = real(model, args)

        def plant(opt, *_):
            state = next(iter(opt.state.values()), None)
            if state and state["step"].item() == 2:
                state["exp_avg"].view(-1)[0] = float("nan")

        optimizer.register_step_pre_hook(plant)
        return optimizer

    monkeypatch.setattr(S, "make_optimizer", poisoned)
    out = tmp_path / "run"
    argv = SMALL + KEEP + ["--steps", "4", "--save-every", "1", "--out", str(out)]
    err = error_of(capsys, argv)
    assert err.startswith(
        "stratagem: error: step 3: the policy diverged, weight model.embed_tokens.weight is not "
        "finite after its update; its last checkpoint is kept"
    )
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]
    weights = load_file(out / "checkpoints" / "step-000002" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    assert json.loads((out / "best" / "best.json").read_text())["step"] <= 2
    best = load_file(out / "best" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in best.values())


# ---- 2. weights are finite floats, or refused in one line naming the file and the tensor
EMBED = "model.embed_tokens.weight"


@pytest.mark.parametrize(
    "plant, message",
    [
        (
            lambda w: w[EMBED].view(-1).__setitem__(5, float("nan")),
            f"tensor {EMBED} is not finite (it holds NaN or infinity)",
        ),
        (
            lambda w: w["model.norm.weight"].fill_(float("inf")),
            "tensor model.norm.weight is not finite",
        ),
        (
            lambda w: w.update({EMBED: w[EMBED].to(torch.int32)}),
            f"tensor {EMBED} is of type I32, not a floating-point type",
        ),
        (
            lambda w: w.update({EMBED: w[EMBED] > 0}),
            f"tensor {EMBED} is of type BOOL, not a floating-point type",
        ),
    ],
)
def test_load_policy_refuses_non_finite_or_integer_weights_in_eval_resume_and_best(
    one_step_run, tmp_path, capsys, plant, message
):
    out = copy_of(one_step_run, tmp_path)
    ckpt = out / "checkpoints" / "step-000001"
    weights = load_file(ckpt / "model.safetensors")
    plant(weights)
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    expected = f"{ckpt / 'model.safetensors'}: {message}"
    assert expected in error_of(capsys, ["eval", str(ckpt), *EVAL])
    assert expected in error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert (ckpt / "model.safetensors").is_file()  # nothing removed


@pytest.mark.parametrize(
    "plant, message",
    [
        (
            lambda w, k: w[k].view(-1).__setitem__(0, float("nan")),
            "is not finite (NaN or infinity)",
        ),
        (lambda w, k: w.update({k: w[k].to(torch.int32)}), "is of type I32"),
    ],
)
def test_load_adapters_refuse_non_finite_or_integer_tensors(tmp_path, capsys, plant, message):
    out = tmp_path / "run"
    assert run(SMALL + ["--steps", "1", "--lora-rank", "4", "--out", str(out)]) == 0
    path = out / "checkpoints" / "step-000001" / "adapter_model.safetensors"
    weights = load_file(path)
    key = sorted(k for k in weights if "lora_B" in k)[0]
    plant(weights, key)
    save_file(weights, str(path), metadata={"format": "pt"})
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "2"])
    assert f"{path}: tensor " in err and message in err
    assert message in error_of(capsys, ["merge-lora", str(out), str(tmp_path / "merged")])
    assert not (tmp_path / "merged").exists()


# ---- 3. no code from a model folder, ever
@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_check_folder_refuses_auto_map_before_transformers_reads_it(
    tiny, tmp_path, capsys, monkeypatch, name
):
    model = copy_of(tiny, tmp_path, "model")
    marker = tmp_path / "ran"
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    edit_json(model / name, auto_map={"AutoConfig": "evil.Config", "AutoTokenizer": "evil.T"})
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked to run code"))
    err = error_of(capsys, ["eval", str(model), *EVAL])
    assert f"{model / name} names code of its own (auto_map)" in err and not marker.exists()


@pytest.mark.parametrize("method", ["gguf", "bitsandbytes"])
def test_check_folder_refuses_a_claimed_quantization_before_any_step(
    tiny, tmp_path, capsys, method
):
    # A folder saved from a GGUF load without deleting quantization_config trained one step, then its
    # checkpoint ended in a traceback ("quantized with gguf and is not serializable"); vLLM refused it.
    model = copy_of(tiny, tmp_path, "model")
    edit_json(model / "config.json", quantization_config={"quant_method": method})
    out = tmp_path / "run"
    argv = ["--model", str(model), "--judge", "heuristic", "--steps", "1", "--batch-size", "4"]
    err = error_of(
        capsys, argv + ["--max-new-tokens", "8", "--micro-batch-size", "4", "--out", str(out)]
    )
    assert f"{model / 'config.json'} claims {method} quantization (quantization_config)" in err
    assert "real-model" in err and not out.exists()


@pytest.mark.parametrize(
    "eos, shown",
    [("abc", "'abc'"), ([2, "a"], "[2, 'a']"), (True, "True"), (10**6, "1000000")],
)
def test_load_policy_refuses_an_ill_typed_eos_naming_the_file_key_and_value(
    tiny, tmp_path, capsys, eos, shown
):
    model = copy_of(tiny, tmp_path, "model")
    edit_json(model / "generation_config.json", eos_token_id=eos, num_beams="x")
    err = error_of(capsys, ["eval", str(model), *EVAL])
    assert err == (
        f"stratagem: error: {model / 'generation_config.json'}: eos_token_id must be a token id "
        f"in [0, 787) or a list of them, got {shown}\n"
    )


def test_load_policy_reads_nothing_of_the_generation_config_but_its_eos(tiny, tmp_path):
    model = copy_of(tiny, tmp_path, "model")
    edit_json(model / "generation_config.json", num_beams="x", temperature="hot")
    loaded, _ = S.load_policy(str(model), torch.device("cpu"))
    config = loaded.generation_config
    assert config.num_beams != "x" and config.temperature != "hot" and config.eos_token_id == 2


@pytest.fixture(scope="module", name="llama")
def llama_fixture(tiny, tmp_path_factory):
    """A tiny Llama (a family whose own chat template format_prompt renders) with the tiny tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    tok = AutoTokenizer.from_pretrained(tiny)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def with_template(llama: Path, tmp_path: Path, template) -> Path:
    model = copy_of(llama, tmp_path, "model")
    (model / "chat_template.jinja").unlink()
    edit_json(model / "tokenizer_config.json", chat_template=template)
    return model


LOOP = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ 'x' * 1500000000 }}" + LOOP, "rendering it failed (MemoryError)"),
        (
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}" + LOOP,
            "it ran past 3 s of CPU",
        ),
        ("{{ 'x' * 2000000 }}" + LOOP, "it writes more than 1,048,576 characters"),
        ("{{ raise_exception('one user turn') }}", "(TemplateError: one user turn)"),
        ("{{ messages.__class__.__mro__ }}" + LOOP, "(SecurityError: access to attribute"),
        ("{% for m in messages %}{{ m.content|upper }}{% endfor %}", "exactly once"),
        ("{% for m in messages %}{{ m.content|replace('a', 'b') }}{% endfor %}", "rewrites"),
        ("x" * (1 << 20) + LOOP, "no plain string of at most 1 MiB"),
    ],
)
def test_load_policy_refuses_a_chat_template_that_is_unbounded_fails_or_rewrites_the_text(
    llama, tmp_path, capsys, monkeypatch, template, message
):
    monkeypatch.setattr(modelfiles, "CPU_SECONDS", 3)
    model = with_template(llama, tmp_path, template)
    err = error_of(capsys, ["eval", str(model), *EVAL])
    assert err.startswith(f"stratagem: error: {model}: its chat template is refused: ")
    assert message in err


def test_format_prompt_writes_what_the_template_makes_of_the_text_trimmed_or_not(llama, tmp_path):
    for name, trim in (("kept", ""), ("trimmed", "|trim")):
        template = (
            "{{ eos_token }}{% for m in messages %}<u>{{ m.content" + trim + " }}</u>{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}"
        )
        _, tok = S.load_policy(
            str(with_template(llama, tmp_path / name, template)), torch.device("cpu")
        )
        for observation in ("[0] a {b}\n c", "\n padded \n"):
            text = S.format_prompt(tok, observation, 0, "{observation}")
            message = [{"role": "user", "content": observation}]
            assert text == tok.apply_chat_template(
                message, tokenize=False, add_generation_prompt=True
            )


# ---- 4. sizes of a model config; best/ never through a link and replaced whole
@pytest.mark.parametrize(
    "edit, message",
    [
        ({"hidden_size": True}, "hidden_size must be a whole number in [1, 65,536], got True"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be a whole number"),
        (
            {"head_dim": None, "num_attention_heads": 6},
            "hidden_size 64 is not divisible by num_attention_heads 6",
        ),
    ],
)
def test_shape_of_refuses_a_size_of_true_and_a_width_its_heads_do_not_divide(
    tiny, tmp_path, capsys, edit, message
):
    model = copy_of(tiny, tmp_path, "model")
    config = json.loads((model / "config.json").read_text())
    config.update(edit)
    (model / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None})
    )
    err = error_of(capsys, ["eval", str(model), *EVAL])
    assert message in err
    with pytest.raises(UserError, match=re.escape(message)):
        memory.shape_of(config, "config.json")


@pytest.fixture(scope="module", name="best_run")
def best_run_fixture(tmp_path_factory):
    not_for_the_vllm_tests()
    out = tmp_path_factory.mktemp("best") / "run"
    assert run(SMALL + KEEP + ["--steps", "1", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("where", ["best", "best/model.safetensors"])
def test_resume_refuses_a_link_as_best_or_inside_it_before_reading_or_writing(
    best_run, tmp_path, capsys, where
):
    out = copy_of(best_run, tmp_path, "run")
    elsewhere = copy_of(out / where, tmp_path, "elsewhere") if where == "best" else None
    if elsewhere is None:
        elsewhere = tmp_path / "elsewhere.safetensors"
        shutil.copyfile(out / where, elsewhere)
    target = tree_of(tmp_path / "elsewhere") if where == "best" else elsewhere.read_bytes()
    shutil.rmtree(out / where) if where == "best" else (out / where).unlink()
    (out / where).symlink_to(elsewhere)
    before = tree_of(out)
    err = error_of(capsys, ["--resume", "--out", str(out), "--steps", "3"])
    assert f"{out / where} is a symbolic link" in err
    assert tree_of(out) == before
    assert (tree_of(elsewhere) if where == "best" else elsewhere.read_bytes()) == target


def test_keep_best_stopped_between_its_two_renames_leaves_the_old_best_whole(tiny, tmp_path):
    """A stop (here raised by the rename that puts the new best in place) after the old best was moved aside: the
    next read finds the old one, every file of it. A remove-then-rename keep_best fails this."""
    out = tmp_path / "run"
    out.mkdir()
    model, tokenizer = fresh(tiny)
    args = S.Args(keep_best=True, eval_every=5)
    run_ = type("R", (), {"args": args, "out": out, "model": model, "tokenizer": tokenizer})()
    lifecycle.keep_best(run_, 5, {"win_rate": 0.4})
    old = tree_of(out / "best")
    real = Path.rename

    def stopped(self, target):
        if self.name == ".best-tmp":
            raise KeyboardInterrupt
        return real(self, target)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "rename", stopped)
        with pytest.raises(KeyboardInterrupt):
            lifecycle.keep_best(run_, 10, {"win_rate": 0.9})
    assert lifecycle.read_best(out) == {"step": 5, "win_rate": 0.4}
    assert tree_of(out / "best") == old
    assert os.path.exists(
        out / ".best-tmp"
    )  # the new one, left aside: the next keep_best removes it
