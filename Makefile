# Every user-facing target depends on the virtual environment, so a fresh clone needs nothing but `make <target>`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# The two stages. DATA: dataset root (absent: the demo profile on generated data; a DATA without the dataset's
# layout is an error); NORM: bn, syncbn, gn, brn, mabn, frozenbn (stage 2) or an ablation preset (stage 1 also bn32: BN over each
# device's batch of 32, the backbone of the paper's BN, BRN and SyncBN rows); GPUS per node (0: CPU; without
# CUDA, GPUS CPU processes under DDP) and NODES pick a preset in configs/trainer/; BACKBONE: for stage 2, a
# stage-1 file or torchvision ResNet-101 weights (docs/backbones.md); INIT: for stage 1, beyond the paper, a BN
# network's file (torchvision ResNet-101 weights or a stage-1 bn/bn32 file) that NORM=mabn starts from for a short
# re-pretraining (configs/pretrain-warm.yaml; runs/pretrain/mabn-warm, pretrain/warm/; docs/backbones.md);
# RUN_DIR: the experiment folder (default runs/<stage>/<norm>, runs/demo/<stage>/<norm> for the demo);
# RESUME: auto (the experiment folder's checkpoint with the highest step, if any) or a checkpoint path; ARGS: further
# LightningCLI arguments, e.g. ARGS="--trainer.max_epochs 10".
NORM     ?= mabn
DATA     ?=
GPUS     ?= 0
NODES    ?= 1
BACKBONE ?=
INIT     ?=
RESUME   ?=
RUN_DIR  ?=
ARGS     ?=
CKPT     ?=
NORM_ARGS  = --norm $(NORM) $(if $(DATA),--data "$(DATA)") $(if $(BACKBONE),--backbone "$(BACKBONE)") \
	$(if $(INIT),--init "$(INIT)") $(if $(RUN_DIR),--run-dir "$(RUN_DIR)")
# DRY_RUN=1: print the run's plan (batches, lr, schedule, backbone) and LightningCLI arguments, check them, train nothing.
DRY_RUN  ?=
STAGE_ARGS = $(NORM_ARGS) --gpus $(GPUS) --nodes $(NODES) $(if $(RESUME),--resume "$(RESUME)") $(if $(DRY_RUN),--dry-run) \
	-- $(ARGS)
# make slurm: the STAGE to submit (pretrain, cityscapes or segment; GPUS per node: 8 when left at 0); AFTER=<job id>
# starts it only once that job has succeeded (stage 2 after stage 1, whose backbone the check then expects from it).
# Every submission is checked first (the stage's dry run in the job's layout): a job that fails it is not
# submitted, every problem is printed and the exit status is 2. DRY_RUN=1 prints the sbatch and srun commands,
# checks, and submits nothing.
STAGE    ?= cityscapes
AFTER    ?=

.PHONY: venv test test-slow triton-compilers test-torch test-gpu gpu-check gpu-wheels lint pretrain cityscapes segment slurm export test-split predict plots bench bench-norm ablation clean

venv: $(STAMP)

# The releases of constraints.txt, the ones the suite is tested with. The stamp depends on pyproject.toml and
# constraints.txt: editing either reinstalls, otherwise a second call installs nothing.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The test runs keep Python's bytecode caches (__pycache__, git-ignored) also where the environment sets
# PYTHONDONTWRITEBYTECODE: every pytest worker would otherwise rewrite and compile each test module again on every
# run, a quarter of its collection.
KEEP_BYTECODE := PYTHONDONTWRITEBYTECODE=

# The default suite: lint, then every test not marked slow, one pytest-xdist worker per core (under two minutes
# on 2 CPU cores); each module runs in one worker, so that its fixtures are built once. CI runs both.
test: lint
	$(KEEP_BYTECODE) $(PY) -m pytest -q -m "not slow" -n auto --dist loadfile

# The tests too long for the default suite (variants of its runs, multi-process failure and timing cases, inductor
# compiles, GPU-sized benchmarks), one worker per core taking the next test as it finishes one: its modules are
# few tests of very different lengths.
test-slow: $(STAMP)
	$(KEEP_BYTECODE) $(PY) -m pytest -q -m slow -n auto --dist worksteal

# The Tritons of the supported torch releases besides the environment's own (3.6.0: torch 2.11's), each in
# .venv-triton<version>/ (git-ignored, Triton alone), where tests/test_kernels_compile.py (make test-slow) compiles
# every kernel with it; a second call installs nothing. CI runs it before make test-slow.
TRITONS ?= 3.6.0
triton-compilers: $(STAMP)
	for v in $(TRITONS); do \
		test -d .venv-triton$$v/triton || $(PY) -m pip install --quiet --no-deps --target .venv-triton$$v "triton==$$v" || exit 1; \
	done

# The suite against a second torch, in an environment built as a user's is: a new $(TORCH_VENV) (git-ignored) with
# torch $(TORCH) and torchvision $(TORCHVISION) installed first, then `pip install ".[dev]"` without constraints.txt,
# which must keep them (pip's report of what it installed names neither); then the default suite on the checkout's
# src/, and the install tests with the installed package (a wheel's stage dry run from another folder, which the
# checkout's src/ on PYTHONPATH would stand in for, and pip keeping that torch). torch===: PyPI's
# build, not a local "+cpu" file of the same version, beside which PyPI's torchvision cannot load its operators.
# Its defaults are the GPU image's software: Python 3.12, torch 2.11 (with Triton 3.6) and its torchvision.
# TORCH_PINS: Triton 3.6's interpreter, which runs the kernels on CPU tensors in the suite (never on a GPU), reads
# one-element arrays as Python ints, which NumPy 2.4 refuses.
# python3.12 where it runs, else pyenv's newest 3.12 (whose shim runs it only where pyenv selects that version).
TORCH_PYTHON ?= $(shell python3.12 -c '' >/dev/null 2>&1 && echo python3.12 || \
	{ prefix=$$(pyenv prefix 3.12 2>/dev/null) && echo "$$prefix/bin/python3.12"; } || echo python3.12)
TORCH        ?= 2.11.0
TORCHVISION  ?= 0.26.0
TORCH_PINS   ?= "numpy<2.4"
TORCH_VENV   := .venv-torch$(TORCH)
test-torch:
	rm -rf $(TORCH_VENV)
	$(TORCH_PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TORCH_VENV)/bin/python -m pip install --quiet "torch===$(TORCH)" "torchvision==$(TORCHVISION)" $(TORCH_PINS)
	$(TORCH_VENV)/bin/python -m pip install --quiet --report $(TORCH_VENV)/install.json ".[dev]"
	! grep -E '"name": "(torch|torchvision)"' $(TORCH_VENV)/install.json
	$(TORCH_VENV)/bin/python -c 'import sys, torch, torchvision; print(sys.version.split()[0], torch.__version__, torchvision.__version__)'
	PYTHONPATH="$(CURDIR)/src" $(TORCH_VENV)/bin/python -m pytest -q -m "not slow" -n auto --dist loadfile
	$(TORCH_VENV)/bin/python -m pytest -q -m slow tests/test_wheel_install.py

# On a machine with a GPU, the tests marked gpu: the CUDA kernels held to the float64 references, CUDA-graph and
# compiled training against eager, the host work per MABN layer.
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	MABN_TEST_DEVICE=cuda PYTHONPATH="$(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH))" $(PY) -m pytest -q -m gpu

# The first thing to run whenever a GPU is at hand (docs/testing.md#on-a-gpu), in one call of under 8 minutes:
# sections in order of value, each stopped at its own time limit (475 s in all), the report in
# runs/bench/bench-cuda.md (OUT=docs: docs/bench-cuda.md; on a machine lent for one call, OUT="$OUT") rewritten as
# each ends, every row naming the commit and the path MABN's steps took: the recipes' kernel variants and the
# history shift on the device (the compiled Triton kernels against the float64 references), stage 2's PSPNet-101
# step in float32 through CUDA graphs captured whole and per stage, the chain of a real stage-2 run (fits killed
# and resumed, CUDA graphs against eager, test, predict, export, two ranks under bf16-mixed), stage 1's ResNet-101
# step, both stages' kernels' GPU time, stage 2's other paths, the other kernel tests; each ratio MABN / BN against
# its target. SECTIONS=compiled: stage 2's step compiled, a call of its own (480 s). SECTIONS=stage1,stage2: some
# of them, in the order given (kernels, stage2, chain, stage1, profile, stage2_more, more_kernels, compiled);
# DRY_RUN=1: the sections, their limits and the report's path; ARGS: further options of scripts/gpu/check.py,
# e.g. ARGS="--limits chain=240". The check is a tool of the checkout, not of the package: it runs the checkout's
# tests and measures with the package's benchmarks.
# PY=python: the machine's own Python instead of .venv, which is then not built (a lent GPU machine with its own
# torch, after scripts/gpu/wheels.sh install); the checkout's src/ is on its path either way. make test-gpu after it.
SECTIONS ?=
gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	PYTHONPATH="$(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH))" $(PY) scripts/gpu/check.py \
		$(if $(OUT),--out "$(OUT)") $(if $(SECTIONS),--sections "$(SECTIONS)") $(if $(DRY_RUN),--dry-run) $(ARGS)

# The wheels a lent GPU machine lacks (smp, albumentations, jsonargparse, ...) into .gpu-wheels/, to carry there.
gpu-wheels: $(STAMP)
	PYTHON=$(PY) scripts/gpu/wheels.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts

pretrain: $(STAMP)
	$(PY) -m mabn pretrain $(STAGE_ARGS)

cityscapes: $(STAMP)
	$(PY) -m mabn cityscapes $(STAGE_ARGS)

# Stage 2's recipe on a dataset of your own (docs/your-data.md): DATA holds images/{train,val}/*, masks/{train,val}/*.png
# (paired by name) and classes.yaml; the rest as for make cityscapes (runs/segment/<dataset>-<digest>/<norm>, the stage-1 backbone).
segment: $(STAMP)
	$(PY) -m mabn segment $(STAGE_ARGS)

# A stage as a SLURM job with one task per GPU (GPUS per node, NODES), checked here before sbatch; requeued on
# preemption, and the requeued job resumes from the latest checkpoint.
slurm: $(STAMP)
	GPUS=$(if $(filter 0,$(GPUS)),8,$(GPUS)) NODES=$(NODES) AFTER=$(AFTER) PYTHON=$(PY) \
		scripts/slurm/submit.sh $(if $(DRY_RUN),--dry-run) $(STAGE) \
		$(NORM_ARGS) -- $(ARGS)

# A trained checkpoint -> the folded model beside it as TorchScript, a torch.export program and ONNX (each checked
# before it is written).
export: $(STAMP)
	@test -n "$(CKPT)" || { echo "usage: make export CKPT=runs/cityscapes/mabn/checkpoints/<file>.ckpt [ARGS=...]"; exit 2; }
	$(PY) -m mabn export "$(CKPT)" $(ARGS)

# A stage-2 checkpoint scored on a split of its dataset by sliding windows, with the per-class IoU table. DATA and
# SPLIT default to the checkpoint's root and val split; ARGS: --flip, --scales 0.75 1 1.25, --crop N.
SPLIT  ?=
IMAGES ?=
test-split: $(STAMP)
	@test -n "$(CKPT)" || { echo "usage: make test-split CKPT=runs/cityscapes/mabn/checkpoints/<file>.ckpt [DATA=...] [SPLIT=val] [ARGS=...]"; exit 2; }
	$(PY) -m mabn test "$(CKPT)" $(if $(DATA),--data "$(DATA)") $(if $(SPLIT),--split "$(SPLIT)") $(ARGS)

# A stage-2 checkpoint's predictions of a split (DATA, SPLIT) or of IMAGES (a folder, an image or a glob such as
# 'photos/*.jpg') as mask PNGs (Cityscapes labelIds, or the values of your classes.yaml), colour masks and
# (ARGS=--overlay) overlays, in OUT (default: <run>/predictions/<ckpt>-<split or images>).
predict: $(STAMP)
	@test -n "$(CKPT)" || { echo "usage: make predict CKPT=runs/cityscapes/mabn/checkpoints/<file>.ckpt [DATA=... SPLIT=val | IMAGES=<folder, image or glob>] [OUT=<folder>] [ARGS=...]"; exit 2; }
	$(PY) -m mabn predict "$(CKPT)" $(if $(DATA),--data "$(DATA)") $(if $(SPLIT),--split "$(SPLIT)") \
		$(if $(IMAGES),--images "$(IMAGES)") $(if $(OUT),--out "$(OUT)") $(ARGS)

# A run's figures from its CSV log (per-layer norm statistics, training curves) as PNG files in $(RUN)/plots
# or OUT; RUN is an experiment folder (default: the demo run of make cityscapes with NORM).
RUN ?= runs/demo/cityscapes/$(NORM)
OUT ?=
plots: $(STAMP)
	$(PY) -m mabn plots "$(RUN)" $(if $(OUT),--out "$(OUT)")

# The cost table (norm layers, PSPNet-101 training step, inference) on CUDA when present, else the CPU; reports in
# runs/bench/ (OUT=docs: in docs/, the reports the docs quote); ARGS: further options of python -m mabn bench.
bench: $(STAMP)
	$(PY) -m mabn bench all $(if $(OUT),--out "$(OUT)") $(ARGS)

bench-norm: $(STAMP)
	$(PY) -m mabn bench norm --out "$(or $(OUT),runs/bench)" $(ARGS)

# The paper's ImageNet ablation (Tables 2 and 6) at small scale: the key rows BN(32), BN(2), BRN(2), modified
# BN(2) and MABN(2) x 8 paired seeds of a small ResNet, with paired t-tests against BN(32); table and figures
# in runs/ablation/ (docs/ablation/ablation.md). DATA: an ImageFolder root (absent: the generated noisy-shape
# set); ARGS: further options, e.g. ARGS="--rows all" (Tables 2 and 6 in full) or ARGS="--device cuda".
ablation: $(STAMP)
	$(PY) -m mabn ablation $(if $(DATA),--data "$(DATA)") $(ARGS)

clean:
	rm -rf $(VENV) .venv-torch* .venv-triton* .pytest_cache build src/*.egg-info
