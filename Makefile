# Every user-facing target depends on the virtual environment, so a fresh clone needs nothing but `make <target>`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# The two stages. DATA: dataset root (absent: the demo profile on generated data); NORM: bn, syncbn, gn,
# brn, mabn or an ablation preset; GPUS per node (0: CPU) and NODES; BACKBONE: stage-1 file for stage 2;
# ARGS: further LightningCLI arguments, e.g. ARGS="--trainer.max_epochs 10".
NORM     ?= mabn
DATA     ?=
GPUS     ?= 0
NODES    ?= 1
BACKBONE ?=
ARGS     ?=
CKPT     ?=
STAGE_ARGS = --norm $(NORM) --gpus $(GPUS) --nodes $(NODES) $(if $(DATA),--data "$(DATA)") \
	$(if $(BACKBONE),--backbone "$(BACKBONE)") -- $(ARGS)

.PHONY: venv test lint pretrain cityscapes export plots bench bench-norm clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

pretrain: $(STAMP)
	$(PY) -m mabn pretrain $(STAGE_ARGS)

cityscapes: $(STAMP)
	$(PY) -m mabn cityscapes $(STAGE_ARGS)

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

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
