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

import warnings

import torch

from machinery import UserError
from machinery.distributed import full_weights

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
        warnings.simplefilter("ignore", FutureWarning)  # peft reads an attribute transformers 5 has deprecated
        torch.manual_seed(args.seed)
        try:
            model = get_peft_model(model, lora_config(args))
        except ValueError as e:  # a --lora-targets name the model does not have
            raise UserError(f"--lora-targets {args.lora_targets}: {str(e).strip().splitlines()[0]}") from None
    model.peft_config[ADAPTER].base_model_name_or_path = args.model  # not the folder it was read from
    return model


def load_adapters(model, checkpoint, trainable: bool):
    """The base `model` with the adapter saved in `checkpoint` (PEFT's format)."""
    from peft import PeftModel

    model.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(model, str(checkpoint), is_trainable=trainable)


def adapter_scalings(model) -> dict[str, float]:
    """alpha / R of every adapted layer, by the layer's name in the model's state dict."""
    return {name: m.scaling[ADAPTER] for name, m in model.named_modules() if hasattr(m, "lora_A")}


def merge_adapters(weights: dict[str, torch.Tensor], scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """A PEFT model's state dict -> the base model's, adapters merged: W' = W + s B A, computed in fp32 and returned
    in W's dtype (s = alpha / R per layer, `scalings`). Names lose PEFT's `base_model.model.` prefix and
    `.base_layer`; the adapters' own tensors are dropped. W [out, in], A [R, in], B [out, R]."""
    merged = {}
    for name, tensor in weights.items():
        if ".lora_" in name:
            continue
        layer, _, kind = name.removeprefix("base_model.model.").rpartition(".")  # kind: weight / bias
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
