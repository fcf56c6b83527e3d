# Every user-facing target depends on the virtual environment, so a fresh clone needs nothing but `make <target>`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# The two stages. DATA: dataset root (absent: the demo profile on generated data); NORM: bn, syncbn, gn,
# brn, mabn or an ablation preset; GPUS per node (0: CPU; without CUDA, GPUS CPU processes under DDP) and
# NODES pick a preset in configs/trainer/; BACKBONE: stage-1 file for stage 2; RESUME: auto (the newest
# checkpoint of the stage and norm, if any) or a checkpoint path; ARGS: further LightningCLI arguments,
# e.g. ARGS="--trainer.max_epochs 10".
NORM     ?= mabn
DATA     ?=
GPUS     ?= 0
NODES    ?= 1
BACKBONE ?=
RESUME   ?=
ARGS     ?=
CKPT     ?=
NORM_ARGS  = --norm $(NORM) $(if $(DATA),--data "$(DATA)") $(if $(BACKBONE),--backbone "$(BACKBONE)")
STAGE_ARGS = $(NORM_ARGS) --gpus $(GPUS) --nodes $(NODES) $(if $(RESUME),--resume "$(RESUME)") -- $(ARGS)
# make slurm: the STAGE to submit; DRY_RUN=1 prints the sbatch and srun commands and checks the Trainer arguments.
STAGE    ?= cityscapes
DRY_RUN  ?=

.PHONY: venv test test-gpu gpu-check lint pretrain cityscapes slurm export plots bench bench-norm ablation clean

venv: $(STAMP)

# The stamp depends on pyproject.toml: editing dependencies reinstalls, otherwise a second call installs nothing.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The default suite (what CI runs): lint, then every test not marked slow.
test: lint
	$(PY) -m pytest -q -m "not slow"

# On a machine with a GPU: the CUDA kernels held to the float64 references, CUDA-graph and compiled training
# against eager.
GPU_TESTS = tests/test_mabn_kernels.py tests/test_norm_reference.py tests/test_norm_state.py tests/test_cenconv.py \
	tests/test_cudagraph.py tests/test_loss_scale.py tests/test_compile.py
test-gpu: $(STAMP)
	MABN_TEST_DEVICE=cuda $(PY) -m pytest -q $(GPU_TESTS)

# The first thing to run whenever a GPU is at hand (sized for 8 minutes on one H100): the GPU tests, then the PSPNet-101
# training step at crops 512 and 712, eager beside CUDA graphs and (at 712) torch.compile, into docs/bench-cuda.md.
gpu-check: test-gpu
	$(PY) -m mabn.bench check

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

pretrain: $(STAMP)
	$(PY) -m mabn pretrain $(STAGE_ARGS)

cityscapes: $(STAMP)
	$(PY) -m mabn cityscapes $(STAGE_ARGS)

# A stage as a SLURM job with one task per GPU (GPUS per node, NODES); requeued on preemption, and the
# requeued job resumes from the newest checkpoint.
slurm: $(STAMP)
	GPUS=$(GPUS) NODES=$(NODES) PYTHON=$(PY) scripts/slurm/submit.sh $(if $(DRY_RUN),--dry-run) $(STAGE) \
		$(NORM_ARGS) -- $(ARGS)

# A trained checkpoint -> folded TorchScript and ONNX models beside it (checked before they are written).
export: $(STAMP)
	@test -n "$(CKPT)" || { echo "usage: make export CKPT=runs/cityscapes/checkpoints/<file>.ckpt [ARGS=...]"; exit 2; }
	$(PY) -m mabn export "$(CKPT)" $(ARGS)

# A run's figures from its CSV log (per-layer norm statistics, training curves) as PNG files in $(RUN)/plots
# or OUT; RUN is a stage folder (the latest csv/version_N is used) or one csv/version_N folder.
RUN ?= runs/cityscapes
OUT ?=
plots: $(STAMP)
	$(PY) -m mabn.plots "$(RUN)" $(if $(OUT),--out "$(OUT)")

# The cost table (norm layers, PSPNet-101 training step, inference) on CUDA when present, else the CPU.
bench: $(STAMP)
	$(PY) -m mabn.bench all $(ARGS)

bench-norm: $(STAMP)
	$(PY) -m mabn.bench norm --out docs/bench-norm-$$($(PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')").md

# The paper's ImageNet ablation (Tables 2 and 6) at small scale: 11 rows x 3 seeds of a small ResNet, table
# and figures in runs/ablation/ (about 10-25 minutes on 2 CPU cores). DATA: an ImageFolder root (absent: the
# generated shape set); ARGS: further options, e.g. ARGS="--rows bn32,bn2,mabn2 --seeds 1".
ablation: $(STAMP)
	$(PY) -m mabn.ablation $(if $(DATA),--data "$(DATA)") $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
