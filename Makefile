# Every target sets itself up: `make demo` and `make test` work on a fresh machine.
# The environment is rebuilt only when pyproject.toml or this Makefile change (stamp file).
SHELL   := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON  ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip --disable-pip-version-check -q
STAMP   := $(VENV)/.recserve-installed
DEMO    ?= build/demo
# tritonclient for the Open Inference Protocol tests, in a venv of its own: it pins protobuf<7, the
# server's stubs need protobuf>=7.35 (tests/test_oip.py runs it through a subprocess).
TRITON_VENV  ?= .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.tritonclient-installed
TRITONCLIENT_VERSION ?= 2.73.0
# KServe's SDK, to read deploy/kserve/*.yaml with its model classes (tests/test_kserve.py), in a venv
# of its own too: it brings its own server stack (fastapi, pydantic, the Kubernetes client).
KSERVE_VENV  ?= .venv-kserve
KSERVE_STAMP := $(KSERVE_VENV)/.kserve-installed
KSERVE_VERSION ?= 0.21.0
TORCH_VERSION    ?= 2.13.0
FBGEMM_VERSION   ?= 1.8.0
TORCHREC_VERSION ?= 1.8.0
# The CUDA build of fbgemm where a GPU is present, the CPU build elsewhere (same import name).
FBGEMM_PKG := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo fbgemm-gpu || echo fbgemm-gpu-cpu)
# PyPI's torch for Linux x86_64 is the CUDA build (with GBs of nvidia-* wheels): the CPU build comes from
# PyTorch's own index.
TORCH_INDEX := $(if $(filter fbgemm-gpu-cpu,$(FBGEMM_PKG)),--index-url https://download.pytorch.org/whl/cpu)

.PHONY: all venv triton-venv kserve-venv demo test protos cpp-loader loadtest clean

all: test

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing torch $(TORCH_VERSION), $(FBGEMM_PKG) $(FBGEMM_VERSION), torchrec $(TORCHREC_VERSION) into $(VENV)"
	@# torch alone from that index (--no-deps): its dependencies come with the project's below, from the
	@# default index. Asked of the torch index, each of them cost about 10 s of retries where that
	@# index is unreachable and a local wheel of torch stands in (pip's find-links).
	$(PIP) install --no-deps $(TORCH_INDEX) "torch==$(TORCH_VERSION)" 2>&1 | { grep -v "is ignored" || true; }
	$(PIP) install "$(FBGEMM_PKG)==$(FBGEMM_VERSION)" 2>&1 | { grep -v "is ignored" || true; }
	@# torchrec last, without its dependencies: its wheel requires "fbgemm-gpu" (the CPU build is named
	@# fbgemm-gpu-cpu) and torchmetrics==1.0.3; what it really needs is in pyproject.toml. Installed
	@# before the project, pip's resolver would print an ERROR about it on every install.
	@$(PY) -m pip uninstall -q -y torchrec >/dev/null 2>&1 || true
	$(PIP) install -e ".[dev,tracing]" 2>&1 | { grep -v "is ignored" || true; }
	$(PIP) install --no-deps "torchrec==$(TORCHREC_VERSION)" 2>&1 | { grep -v "is ignored" || true; }
	$(PY) -c "import torch, fbgemm_gpu, torchrec, grpc; print('torch', torch.__version__, '| fbgemm', fbgemm_gpu.__version__, '| torchrec', torchrec.__version__, '| grpcio', grpc.__version__)"
	@touch $(STAMP)

triton-venv: $(TRITON_STAMP)

$(TRITON_STAMP): Makefile
	@test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip --disable-pip-version-check -q install "tritonclient[grpc,http]==$(TRITONCLIENT_VERSION)" numpy 2>&1 | { grep -v "is ignored" || true; }
	@touch $(TRITON_STAMP)

kserve-venv: $(KSERVE_STAMP)

$(KSERVE_STAMP): Makefile
	@test -x $(KSERVE_VENV)/bin/python || $(PYTHON) -m venv $(KSERVE_VENV)
	$(KSERVE_VENV)/bin/python -m pip --disable-pip-version-check -q install "kserve==$(KSERVE_VERSION)" pyyaml 2>&1 | { grep -v "is ignored" || true; }
	@touch $(KSERVE_STAMP)

# Train a tiny model, export it, serve it, query it.
demo: $(STAMP)
	$(PY) -m recserve.demo --workdir $(DEMO)

# Locust against a server it starts, headless, a fixed time: HTML report and CSV in build/loadtest/.
loadtest: $(STAMP)
	$(PY) loadtest/run.py --out build/loadtest

test: $(STAMP) $(TRITON_STAMP) $(KSERVE_STAMP) cpp-loader
	$(PY) -m pytest -q

# The C++ loader, built against the libtorch inside the installed torch wheel.
CPP_LOADER := cpp_loader/build/recserve-cpp-loader
cpp-loader: $(CPP_LOADER)

$(CPP_LOADER): $(STAMP) cpp_loader/CMakeLists.txt cpp_loader/main.cpp cpp_loader/mini_json.hpp cpp_loader/sha256.hpp
	cmake -S cpp_loader -B cpp_loader/build -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
	  -DFBGEMM_DIR="$$($(PY) -c 'import fbgemm_gpu, os; print(os.path.dirname(fbgemm_gpu.__file__))' 2>/dev/null | tail -1)" > cpp_loader/build.log 2>&1 || (cat cpp_loader/build.log; exit 1)
	cmake --build cpp_loader/build -j 2 >> cpp_loader/build.log 2>&1 || (tail -50 cpp_loader/build.log; exit 1)
	@echo "built $(CPP_LOADER)"

# Regenerate the committed Python stubs of protos/ (grpcio-tools 1.84.0: the stubs then need
# grpcio>=1.84 and protobuf>=7.35.1, which both the CPU and the GPU machines have).
protos: $(STAMP)
	$(PIP) install "grpcio-tools==1.84.0"
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
	  protos/recserve/v1/inference.proto protos/recserve/oip/grpc_predict_v2.proto

clean:
	rm -rf build cpp_loader/build cpp_loader/build.log
