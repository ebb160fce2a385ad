"""`stratagem.py merge-lora`: a LoRA run's adapter merged into its base model, saved as a whole Hugging Face
checkpoint that `eval`, lm-evaluation-harness and `vllm serve` load as they load a full run's."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from machinery import UserError, lora, modelfiles, saved_config
from machinery.flags import FriendlyParser
from machinery.runfiles import check_writable_dir, latest_checkpoint
from machinery.watch import quiet_transformers
from stratagem import WARM_START, Args, build_random_model, load_policy


def adapter_and_run(path: Path) -> tuple[Path, Path | None]:
    """A run directory stands for its newest checkpoint; a checkpoint's run is the folder two levels up."""
    ckpt = latest_checkpoint(path) if (path / "checkpoints").is_dir() else path
    if ckpt is None or not all((ckpt / name).is_file() for name in lora.FILES):
        raise UserError(
            f"{path}: no LoRA adapter there ({' and '.join(lora.FILES)}); a full run's checkpoint is already a "
            "whole model, which eval and vLLM load as it is"
        )
    run = ckpt.parent.parent
    return ckpt, run if (run / "config.json").is_file() else None


def merged_model(ckpt: Path, run: Path | None, base: str = ""):
    """(model, tokenizer, base): the run's base model (`base`, else the run's --model; --tiny's is the shipped warm
    start, or with --tiny-init random rebuilt offline from the run's seed) with the adapter of `ckpt` merged in,
    W + (alpha / R) B A in fp32, in memory; the tokenizer is the base's, as load_policy reads it."""
    config = saved_config.run_config(run, Args) if run is not None else {}
    if not base and not config:
        raise UserError(f"{ckpt} is not inside a run directory: name its base model with --base")
    quiet_transformers()
    rebuild = not base and config.get("tiny") and config.get("tiny_init", "random") == "random"
    if not base:
        base = str(WARM_START) if config.get("tiny") and not rebuild else config["model"]
    with tempfile.TemporaryDirectory() as tiny_dir:
        if rebuild:  # the run's base, rebuilt from its seed as the run built it
            build_random_model(tiny_dir, config["seed"])
        model, tokenizer = load_policy(tiny_dir if rebuild else base, torch.device("cpu"))
        merged = lora.load_adapters(model, ckpt, trainable=False).merge_and_unload()
    if name := modelfiles.first_nonfinite(merged.named_parameters()):
        raise UserError(f"the merged weights are not finite (tensor {name}): nothing written")
    return merged, tokenizer, base


def main(argv: list[str]) -> int:
    p = FriendlyParser(
        prog="stratagem.py merge-lora",
        description=(
            "Merge a LoRA run's adapter (its newest checkpoint, or the checkpoint given) into the run's base model, "
            "W + (alpha / R) B A in fp32, and save the whole model and the run's tokenizer to OUT: a Hugging Face "
            "checkpoint like a full run's, for eval, lm-evaluation-harness and vLLM."
        ),
    )
    p.add_argument(
        "adapter", help="a LoRA run directory (its newest checkpoint) or one of its checkpoints"
    )
    p.add_argument("out", help="output directory (must not exist)")
    p.add_argument(
        "--base",
        default="",
        help="the base model, a hub id or a directory (default: the run's --model; --tiny's is the shipped warm "
        "start, or with --tiny-init random rebuilt offline from the run's seed)",
    )
    ns = p.parse_args(argv)
    ckpt, run = adapter_and_run(Path(ns.adapter))
    if os.path.exists(ns.out):
        raise UserError(f"{ns.out} already exists")
    check_writable_dir(Path(ns.out), "out")
    merged, _, base = merged_model(ckpt, run, ns.base)
    from transformers import AutoTokenizer

    modelfiles.refuse_code(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=False)  # the run's own
    merged.save_pretrained(ns.out)
    tokenizer.save_pretrained(ns.out)
    print(f"merged the adapter of {ckpt} into {base}: a whole model in {ns.out}")
    return 0
