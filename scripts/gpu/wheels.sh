#!/usr/bin/env bash
# The packages a lent GPU machine lacks, as wheels in .gpu-wheels/ (git-ignored), to carry there and install
# offline: that machine has its own torch, Lightning, timm and OpenCV for Python 3.12, and no network.
#
#   scripts/gpu/wheels.sh            # here, where the package index is reachable: download into .gpu-wheels/
#   scripts/gpu/wheels.sh install    # on the GPU machine: install them from .gpu-wheels/ alone (no index)
#
# What is downloaded: the packages below and every dependency of theirs, at the versions of this checkout's .venv
# (what the tests pass with), for CPython 3.12 on x86_64 Linux, except the torch stack the GPU machine brings.
# The install resolves against what is installed there, so a dependency it already has is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.gpu-wheels
# pytest is there for make test-gpu PY=python. wandb and onnxruntime stay out (the carried folder is limited to 64 MiB): the GPU check logs to no service,
# and export checks its ONNX file with onnxruntime only where it is installed.
PACKAGES=(segmentation-models-pytorch albumentations jsonargparse onnx onnxscript torchmetrics pytest)
PYTHON="${PYTHON:-.venv/bin/python}"

if [[ "${1:-}" == "install" ]]; then
    python -m pip install --quiet --no-index --find-links "$WHEELS" "${PACKAGES[@]}" "jsonargparse[signatures]"
    echo "installed ${PACKAGES[*]} from $WHEELS"
    exit 0
fi
# The dependency closure of PACKAGES in .venv, pinned, without what the GPU machine has (torch and its CUDA
# libraries and their dependencies, Lightning, timm and its Hugging Face hub, OpenCV, NumPy, Pillow).
mapfile -t pins < <("$PYTHON" - "${PACKAGES[@]}" "typeshed-client" "docstring-parser" <<'PY'
import importlib.metadata as md, re, sys
HAS = re.compile(
    r"^(torch|torchvision|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec"
    r"|typing-extensions|pytorch-lightning|lightning.*|timm|huggingface-hub|hf-xet|safetensors|opencv-.*|numpy"
    r"|pillow|packaging|pyyaml|requests|urllib3|certifi|idna|charset-normalizer|tqdm|setuptools)$"
)
seen, todo = {}, list(sys.argv[1:])
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or HAS.match(name):
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue  # an optional dependency this environment does not install
    seen[name] = dist.version
    for req in dist.requires or []:
        if "extra ==" not in req:
            todo.append(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PY
)
mkdir -p "$WHEELS"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform linux_x86_64 --platform any --dest "$WHEELS" "${pins[@]}"
echo "${#pins[@]} wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1))"
