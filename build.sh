#!/usr/bin/env bash
# Installs deepinfer and its dependencies for DEEPINFER_ACCELERATOR (nvidia | cpu | ascend)
# into the Python that `python3` (or $PYTHON) runs. Test dependencies too unless
# DEEPINFER_SKIP_TEST_DEPS=1.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
ACC=${DEEPINFER_ACCELERATOR:-nvidia}
case "$ACC" in
  cpu|nvidia) ;;
  ascend) echo "build.sh: DEEPINFER_ACCELERATOR=ascend is not supported in this build of deepinfer" >&2; exit 2 ;;
  *) echo "build.sh: DEEPINFER_ACCELERATOR must be nvidia, cpu or ascend (got '$ACC')" >&2; exit 2 ;;
esac
pip() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
pip -r "requirements/$ACC.txt"
pip -e .
# Structured outputs: xgrammar without its torch / triton requirements (installed above).
pip -r requirements/structured.txt
pip --no-deps xgrammar==0.2.9
if [ "${DEEPINFER_SKIP_TEST_DEPS:-0}" != 1 ]; then
  pip -r requirements/test.txt
  # NeMo AutoModel is the V4.1 test oracle; never with its dependencies (megatron, quack, torchao, ...).
  "$PY" -m pip install -q --no-deps nemo-automodel==0.7.0
fi
"$PY" -c "import torch, deepinfer, xgrammar; print(f'deepinfer ready: torch {torch.__version__}, accelerator $ACC')"
