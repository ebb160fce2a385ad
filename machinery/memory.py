"""Will it fit? The memory a run takes per device, projected before anything is loaded (pure arithmetic), as
`--dry-run` prints it beside the judge's cost.

The learner (bytes; P parameters, T of them trained: all of them in full fine-tuning, the adapters with LoRA):
    weights      4P fp32 (full); LoRA: the frozen base 2P in bf16 on a GPU (4P on a CPU) + 4T adapters
    gradients    4T fp32                         Adam    8T (two fp32 moments)
    bf16 copies  2T: autocast's casts of the fp32 weights it trains, cached for the backward pass (GPU only)
    activations  a micro-batch of --micro-batch-size sequences of PROMPT_TOKENS + --max-new-tokens tokens: per token
                 and layer 26h + 8i + 10.25q + 10kv bytes (h hidden, i MLP, q = heads x head size, kv = KV heads x
                 head size; counted from the tensors autograd saves, under bf16 autocast, for Qwen3's layer), or 4h
                 per layer with --gradient-checkpointing plus one layer recomputed; and the head: 12 bytes per
                 vocabulary entry and response token (bf16 logits, their scaled copy, fp32 log-softmax)
Under torchrun FSDP2 shards weights, gradients and Adam over the ranks. With --kl-coef the frozen initial policy adds
its weights again.
vLLM (--backend vllm, colocated): --vllm-gpu-memory-utilization of the device while it generates (its bf16 weights
2P, the rest mostly KV cache); asleep while the learner steps (level 1: weights to host memory, KV cache freed).
A step's peak is the largest of three phases: generating (learner weights and Adam + vLLM's share), learning
(everything the learner holds, vLLM asleep) and syncing (learner weights and Adam, vLLM's weights awake again, and
the bf16 copy of the (merged) weights being loaded into it, machinery/vllm_engine.py).
"""

from __future__ import annotations

from machinery import UserError

GiB = 2**30
# An assumption: a turn's prompt (the game so far). The longest of 20 games of each training game played by random legal
# players was 2,850 characters, ~710 tokens at 4 a token; negotiators who write long messages can pass it.
PROMPT_TOKENS = 1024
# Memory totals as nvidia-smi reports them (MiB), the smallest card of each class.
DEVICES = {
    "24 GB (RTX 4090)": 24564,
    "48 GB (L40S, A6000)": 46068,
    "80 GB (H100, A100)": 81559,
    "141 GB (H200)": 143771,
}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The sizes a model's config.json gives, checked before anything is allocated: each a positive integer below a bound
# no real model reaches (a hostile config of 10**12 vocabulary entries or 2 million layers ends in one line, not in
# a hang while memory grows). GPT-2-style names (n_embd, ...) are read as their Llama-style equivalents.
SIZES = {
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 4096,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
}
ALIASES = {
    "n_embd": "hidden_size",
    "n_inner": "intermediate_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}


def shape_of(config: dict, where: str) -> dict:
    """A config.json's sizes under Llama-style names, checked: positive integers within SIZES, the attention heads a
    multiple of the KV heads and, without head_dim, a divisor of the width; anything else is one line (UserError)."""
    shape = {
        **config,
        **{ALIASES[k]: v for k, v in config.items() if k in ALIASES and v is not None},
    }
    if shape.get("intermediate_size") is None and "n_embd" in config:
        shape["intermediate_size"] = 4 * shape.get(
            "hidden_size", 0
        )  # GPT-2's MLP: 4 x the width by default
    for key, bound in SIZES.items():
        value = shape.get(key)
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and 0 < value <= bound
        ):
            raise UserError(
                f"{where}: {key} must be a whole number in [1, {bound:,}], got {value!r:.40}"
            )
    heads, kv = shape.get("num_attention_heads"), shape.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise UserError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if (
        heads
        and shape.get("hidden_size")
        and not shape.get("head_dim")
        and shape["hidden_size"] % heads
    ):
        raise UserError(
            f"{where}: hidden_size {shape['hidden_size']} is not divisible by num_attention_heads {heads}"
        )
    return shape


NEEDED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear projection of one decoder layer of a Qwen/Llama-style model."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def parameters(shape: dict) -> int:
    """Parameters of a Qwen3 causal LM: embeddings, per layer the projections, q/k norms and two RMSNorms, the final
    norm, and an untied head."""
    h, v, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    per_layer = sum(a * b for a, b in linear_shapes(shape).values()) + 2 * d + 2 * h
    head = 0 if shape.get("tie_word_embeddings", True) else v * h
    return v * h + layers * per_layer + h + head


def adapter_parameters(shape: dict, rank: int, targets: list[str]) -> int:
    """LoRA's trained parameters: R x (in + out) for every targeted projection of every layer."""
    return shape["num_hidden_layers"] * sum(
        rank * (a + b) for name, (a, b) in linear_shapes(shape).items() if name in targets
    )


def project(
    shape: dict,
    lora_rank: int,
    lora_targets: list[str],
    micro_batch: int,
    max_new_tokens: int,
    checkpointing: bool,
    gpu: bool,
    world: int = 1,
    reference: bool = False,
) -> dict:
    """The learner's bytes per device, by part (see the module's docstring)."""
    p = parameters(shape)
    t = adapter_parameters(shape, lora_rank, lora_targets) if lora_rank else p
    h, i, layers, vocab = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_hidden_layers"],
        shape["vocab_size"],
    )
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    base = (2 if gpu else 4) * p if lora_rank else 0  # the frozen base
    weights = base + 4 * t
    tokens = micro_batch * (PROMPT_TOKENS + max_new_tokens)
    layer = 26 * h + 8 * i + 10.25 * q + 10 * kv  # bytes per token and layer
    head = 12 * vocab * micro_batch * (max_new_tokens + 1)
    full = layers * tokens * layer + head
    recomputed = layers * tokens * (4 if not (lora_rank and gpu) else 2) * h + tokens * layer + head
    return {
        "parameters": p,
        "trained": t,
        "weights": weights / world,
        "gradients": 4 * t / world,
        "adam": 8 * t / world,
        "bf16_copies": 2 * t if gpu else 0,
        "activations": recomputed if checkpointing else full,
        "activations_other": full if checkpointing else recomputed,
        "reference": weights / world if reference else 0,
        "vllm_weights": 2 * p,
        "kv_per_token": 2 * layers * kv * 2,  # K and V, bf16
        "sequence_tokens": PROMPT_TOKENS + max_new_tokens,
    }


def verdict(m: dict, total: float, utilisation: float | None) -> dict:
    """Peak bytes while generating, while learning and while syncing on a device of `total` bytes; vLLM's share when
    it is the engine (`utilisation`), else None; whether every phase fits, and vLLM's room for KV cache."""
    static = m["weights"] + m["adam"] + m["reference"]
    vllm = utilisation * total if utilisation is not None else 0.0
    generating = static + vllm
    learning = static + m["gradients"] + m["bf16_copies"] + m["activations"]
    syncing = (
        static + 2 * m["vllm_weights"] if utilisation is not None else 0.0
    )  # vLLM's weights awake + the bf16 copy
    kv = vllm - m["vllm_weights"] if utilisation is not None else None
    peak = max(generating, learning, syncing)
    fits = peak <= total and (kv is None or kv > m["kv_per_token"] * m["sequence_tokens"])
    return {
        "generating": generating,
        "learning": learning,
        "syncing": syncing,
        "peak": peak,
        "kv_cache": kv,
        "fits": fits,
    }


def gb(x: float) -> str:
    return f"{x / GiB:,.1f}"


def plan_lines(
    args, shape: dict | None, device, world: int, device_total: float | None, requested: str
) -> list[str]:
    """--dry-run's memory lines: the learner by part, vLLM's share, and the verdict for this device (a GPU) or for
    24 / 48 / 80 / 141 GB cards (none here: vLLM is their engine unless --backend hf was `requested`)."""
    if shape is None:
        return [
            f"memory: {args.model}'s shape is not known offline (no config.json here): no projection"
        ]
    shape = shape_of(shape, f"{args.model}'s config.json")
    if missing := [k for k in NEEDED if shape.get(k) is None]:
        return [
            f"memory: {args.model}'s config.json gives no {missing[0]} (nor a known alias): no projection"
        ]
    shape.setdefault(
        "num_key_value_heads", shape["num_attention_heads"]
    )  # no grouped-query attention
    gpu = device.type == "cuda" or device_total is None  # no GPU here: the cards' figures
    m = project(
        shape,
        args.lora_rank,
        args.lora_targets.split(","),
        args.micro_batch_size,
        args.max_new_tokens,
        args.gradient_checkpointing,
        gpu,
        world,
        bool(args.kl_coef),
    )
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"  # noqa: E731
    kind = (
        f"LoRA rank {args.lora_rank}: {count(m['trained'])} trained"
        if args.lora_rank
        else "full fine-tuning"
    )
    other = "without" if args.gradient_checkpointing else "with"
    lines = [
        f"memory per device, GiB ({count(m['parameters'])} parameters; {kind}"
        + (f", {world} ranks" if world > 1 else "")
        + f"): weights {gb(m['weights'])}, gradients {gb(m['gradients'])}, Adam {gb(m['adam'])}, bf16 copies "
        f"{gb(m['bf16_copies'])}, activations {gb(m['activations'])} (micro-batch {args.micro_batch_size} x "
        f"{m['sequence_tokens']:,} tokens; {other} --gradient-checkpointing: {gb(m['activations_other'])})"
        + (f", KL reference {gb(m['reference'])}" if m["reference"] else ""),
    ]
    vllm = args.backend == "vllm" if device_total else requested != "hf"
    utilisation = args.vllm_gpu_memory_utilization if vllm and gpu else None
    if utilisation is not None:
        lines.append(
            f"memory of vLLM: {utilisation:g} of the device while it generates (--vllm-gpu-memory-utilization; its "
            f"bf16 weights {gb(m['vllm_weights'])}, the rest KV cache at {m['kv_per_token'] / 2**10:,.0f} KiB a "
            "token); asleep while the learner steps"
        )
    sizes = (
        {str(device): device_total}
        if device_total
        else {k: mib * 2**20 for k, mib in DEVICES.items()}
    )
    verdicts = []
    for name, total in sizes.items():
        v = verdict(m, total, utilisation)
        peak = v["peak"]
        kv = max(v["kv_cache"] or 0.0, 0.0)
        sequences = kv / (m["kv_per_token"] * m["sequence_tokens"])
        room = "" if v["kv_cache"] is None else f", KV cache {gb(kv)}: {sequences:,.0f} sequences"
        verdicts.append(
            f"{name}: {'fits' if v['fits'] else 'does NOT fit'} (peak {gb(peak)} of {gb(total)}{room})"
        )
    return lines + ["will it fit? " + "; ".join(verdicts)]
