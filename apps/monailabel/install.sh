#!/usr/bin/env bash
# Smallest MONAI Label install that serves this app without touching the project's CPU torch:
# a separate virtual environment that sees the project's .venv (a .pth file) and gets monailabel 0.8.5
# and its light server dependencies pinned in requirements-monailabel.txt, all with --no-deps (no CUDA
# torch, no torchvision, no numpy<2, no sam2).
# Usage (from the repository root): bash apps/monailabel/install.sh [PROJECT_VENV] [TARGET_VENV]
set -euo pipefail
cd "$(dirname "$0")/../.."
project="${1:-.venv}"
target="${2:-.venv-monailabel}"
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
"$project/bin/python" -m venv "$target"
"$project/bin/python" -c "$purelib" > "$("$target/bin/python" -c "$purelib")/_project_venv.pth"
"$target/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-monailabel.txt
"$target/bin/python" -c "import monailabel.app, torch, numpy; print('monailabel', monailabel.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"
