# `make run`: set up .venv (once) and run the pipeline on the embedded corpus. `make test`: set up, run the tests.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=60
export DO_NOT_TRACK=1
export MLFLOW_DISABLE_TELEMETRY=true
export DVC_NO_ANALYTICS=1
export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export GX_ANALYTICS_ENABLED=false

.PHONY: setup run repro test bench ui clean

# The fused CPU kernels (RMSNorm, rotary: ultrathink/model/cpu_kernels.py) are compiled for this machine once,
# here, so no run pays for them; a second call finds them cached (~1 s). A machine without a C++ compiler is told
# so and trains without them.
setup: $(STAMP)
	$(BIN)/python -c "from ultrathink.model.cpu_kernels import prebuild; prebuild()"

# Reinstall only when the dependency list or the pins change. torch goes first, alone, so pip takes the local
# CPU build and nothing later can ask for a CUDA one.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,ray]"
	touch $(STAMP)

# The project needs a git repo (DVC records lineage against it) with DVC initialised, analytics off.
.dvc/config:
	test -d .git || (git init -q && git add -A && git -c user.name=ultrathink -c user.email=ultrathink@localhost commit -qm "initial")
	$(BIN)/dvc init -q 2>/dev/null || true
	$(BIN)/dvc config core.analytics false

run: setup .dvc/config
	$(BIN)/ultrathink run

repro: setup .dvc/config
	$(BIN)/dvc repro

test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: setup
	$(BIN)/python benchmarks/train_throughput.py

ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db

clean:
	rm -rf artifacts data/validated data/prepared reports mlflow.db mlartifacts
