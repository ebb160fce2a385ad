"""LoRA through PEFT (`--lora-rank R`, R > 0): the paper's model on one 24-48 GB GPU.

The base weights are frozen (bf16 on a GPU, fp32 on a CPU as a full run's are); low-rank adapters
W + (alpha / R) B A on every linear projection of attention and MLP (--lora-targets) are fp32, and Adam holds
state for them alone. The loss, its normaliser and the update are otherwise those of full fine-tuning.

    add_adapters      fresh adapters, initialised from the run's seed (every torchrun rank the same ones), or a
                      checkpoint's (resume)
    merge_adapters    the merged weights W + (alpha / R) B A under the base model's own names, computed beside
                      the base (never merged into it and out again, which would round the frozen weights each step)
    merged_weights    what the generation engine plays with after every update: the merged weights, or the
                      full model's own when there are no adapters

A checkpoint holds the adapter in PEFT's own format (adapter_config.json, adapter_model.safetensors); `python
stratagem.py merge-lora` (tools/merge_lora.py) writes a full Hugging Face checkpoint from it. peft is imported
only when adapters are asked for.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from machinery import UserError, modelfiles, runfiles
from machinery.distributed import full_weights


@dataclass
class LoraFlags:
    """--lora-rank and the adapters' shape: stratagem.Args's LoRA flags."""

    # --- LoRA ---
    lora_rank: int = 0
    """rank R of LoRA adapters trained through PEFT, the base frozen; 0:
    full fine-tuning, the paper's setting (docs/speed.md#one-48-gb-gpu-lora)
    """
    lora_alpha: float = 0.0
    """LoRA's scale numerator: an adapter adds (alpha / R) B A to its
    weight; 0: 2 x --lora-rank"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input while learning (the engine samples
    without it)"""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """comma-separated names of the linear layers that get adapters
    (default: all of them)"""


ADAPTER = "default"  # PEFT's name for a model's one adapter
FILES = ("adapter_config.json", "adapter_model.safetensors")  # what PEFT's save_pretrained writes


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def lora_config(args):
    """PEFT's LoraConfig of the run's flags."""
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=args.lora_targets.split(","),
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_adapters(model, args, checkpoint=None):
    """The base `model` with adapters (fp32: PEFT casts bf16 adapters up, autocast_adapter_dtype): fresh ones drawn
    under a generator seeded by --seed (not from the run's streams, so that every torchrun rank draws the same
    ones, and the run's own draws are those a full run makes), or the checkpoint's, trainable."""
    if checkpoint is not None:
        return load_adapters(model, checkpoint, trainable=True)
    from peft import get_peft_model

    model.requires_grad_(False)
    with warnings.catch_warnings(), torch.random.fork_rng():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # peft reads an attribute transformers 5 has deprecated
        torch.manual_seed(args.seed)
        try:
            model = get_peft_model(model, lora_config(args))
        except ValueError as e:  # a --lora-targets name the model does not have
            raise UserError(
                f"--lora-targets {args.lora_targets}: {str(e).strip().splitlines()[0]}"
            ) from None
    model.peft_config[
        ADAPTER
    ].base_model_name_or_path = args.model  # not the folder it was read from
    return model


def check_adapter_config(checkpoint) -> dict:
    """adapter_config.json read as untrusted: a JSON object whose rank is a whole number in [1, 4096], whose alpha a
    finite number and whose targets names, else one line naming the file."""
    path = Path(checkpoint) / "adapter_config.json"
    try:
        config = json.loads(runfiles.read_small(path))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}); restore it") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a LoRA adapter's config (not a JSON object)")
    r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if not (isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= 4096):
        raise UserError(f"{path}: r must be a whole number in [1, 4096], got {r!r:.40}")
    if not (
        isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < abs(alpha) <= 65536
    ):
        raise UserError(f"{path}: lora_alpha must be a number in (0, 65536], got {alpha!r:.40}")
    if not (isinstance(targets, (list, str)) and all(isinstance(t, str) for t in targets)):
        raise UserError(f"{path}: target_modules must be layer names, got {targets!r:.60}")
    return config


def load_adapters(model, checkpoint, trainable: bool):
    """The base `model` with the adapter saved in `checkpoint` (PEFT's format), checked whole: its config, and every
    adapter tensor the config makes there in the file, none more, each of its shape, a float, finite."""
    from peft import PeftModel
    from safetensors import safe_open

    check_adapter_config(checkpoint)
    model.requires_grad_(False)
    weights = Path(checkpoint) / "adapter_model.safetensors"
    try:
        runfiles.refuse_special(weights)
        with safe_open(str(weights), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=trainable)
    except Exception as e:  # noqa: BLE001 - whatever a damaged adapter makes PEFT raise is one line
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise UserError(
            f"{checkpoint}: its LoRA adapter cannot be loaded ({type(e).__name__}: {first})"
        ) from None
    modelfiles.refuse_integers(weights, dtypes)
    wanted = {
        k.replace(f".{ADAPTER}.", "."): tuple(v.shape)
        for k, v in peft_model.state_dict().items()
        if ".lora_" in k
    }
    problems = [f"{k} is missing" for k in sorted(set(wanted) - set(saved))]
    problems += [f"{k} is not one of the adapter's" for k in sorted(set(saved) - set(wanted))]
    problems += [
        f"{k} has shape {saved[k]}, the adapter's is {v}"
        for k, v in wanted.items()
        if saved.get(k, v) != v
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(
            f"{weights} does not fit its adapter_config.json: tensor {problems[0]}{more}"
        )
    lora = [(k, v) for k, v in peft_model.named_parameters() if ".lora_" in k]
    if name := modelfiles.first_nonfinite(lora):
        raise UserError(f"{weights}: tensor {name} is not finite (NaN or infinity); restore it")
    return peft_model


def adapter_scalings(model) -> dict[str, float]:
    """alpha / R of every adapted layer, by the layer's name in the model's state dict."""
    return {name: m.scaling[ADAPTER] for name, m in model.named_modules() if hasattr(m, "lora_A")}


def merge_adapters(
    weights: dict[str, torch.Tensor], scalings: dict[str, float]
) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict -> the base model's, adapters merged: W' = W + s B A, computed in fp32 and returned
    in W's dtype (s = alpha / R per layer, `scalings`). Names lose PEFT's `base_model.model.` prefix and
    `.base_layer`; the adapters' own tensors are dropped. W [out, in], A [R, in], B [out, R]."""
    merged = {}
    for name, tensor in weights.items():
        if ".lora_" in name:
            continue
        layer, _, kind = name.removeprefix("base_model.model.").rpartition(
            "."
        )  # kind: weight / bias
        module = name.rpartition(".")[0].removesuffix(".base_layer")
        if module in scalings and kind == "weight":
            a = weights[f"{module}.lora_A.{ADAPTER}.weight"].float()  # [R, in]
            b = weights[f"{module}.lora_B.{ADAPTER}.weight"].float()  # [out, R]
            tensor = (tensor.float() + scalings[module] * (b @ a)).to(tensor.dtype)  # [out, in]
        merged[f"{layer.removesuffix('.base_layer')}.{kind}"] = tensor
    return merged


def merged_weights(model) -> dict[str, torch.Tensor]:
    """All of the policy's weights under the base model's names, as the generation engine loads them (under FSDP a
    collective: every rank calls it)."""
    weights = full_weights(model)
    return merge_adapters(weights, adapter_scalings(model)) if is_lora(model) else weights


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters Adam updates: every one in full fine-tuning, the adapters' with LoRA."""
    return [p for p in model.parameters() if p.requires_grad]
