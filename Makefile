# Two commands for a fresh machine (see README.md):
#   make demo   set up .venv, build, and run the compressed-vs-plain DDP demo (2 namespace nodes
#               on a 1 Gbit/s link as root, else 2 local ranks)
#   make test   set up .venv, build (also the nvcc compile of the CUDA sources), run the tests
#   make test-fast   build, then the single-process tests only, in about a minute
# The venv's interpreter. A Linux distribution's python3 is built with profile-guided and
# link-time optimisation, a from-source build (pyenv's default) is not: the distribution's
# imports torch 12 % faster and runs the test suite, processes that start torch, in 13-18 %
# less CPU. So make takes /usr/bin/python3 when it can make a venv to build against (3.10 or
# newer, with ensurepip and Python.h), else python3; PYTHON=... overrides.
SYSTEM_PYTHON := $(shell /usr/bin/python3 -c 'import ensurepip, os, sys, sysconfig; \
	sys.exit(sys.version_info < (3, 10) or not os.path.exists( \
	os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null && echo /usr/bin/python3)
PYTHON ?= $(or $(SYSTEM_PYTHON),python3)
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup build demo test test-fast cuda-check cuda-check-kernels cuda-check-hooks \
	compat-check gpu-check gpu-check-plan gpu-profile bench stress-restart lint clean

$(BIN)/python:
	@echo "venv: $$($(PYTHON) -c 'import sys; print(sys.executable, sys.version.split()[0])')"
	$(PYTHON) -m venv $(VENV)

# Dependencies once per venv. torch is pinned and installed first: the extension must be built
# against exactly this torch, with --no-build-isolation. pip compiles no bytecode
# (--no-compile): compiling every file it installs took 29 of the install's 66 CPU s. The one
# import below compiles what every process of the demo and the tests imports (6 CPU s), also
# where PYTHONDONTWRITEBYTECODE is set (each process would compile torch's modules again); any
# other module is compiled where it is first imported.
PIP_INSTALL := $(BIN)/pip install -q --no-compile
$(VENV)/.deps: $(BIN)/python pyproject.toml
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) "$(TORCH)"
	$(PIP_INSTALL) numpy ninja pybind11 setuptools wheel "cmake>=3.28" \
		pytest pytest-timeout pytest-benchmark ruff rich matplotlib
	# The integration tests run fastddp's hook inside these frameworks.
	$(PIP_INSTALL) lightning accelerate
	# cuobjdump and nvdisasm, for the SASS check of make cuda-check (benchmarks/sass_check.py).
	$(PIP_INSTALL) nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -c 'import torch, torch.distributed.run, torch._dynamo, numpy, rich, \
		torch.distributed.algorithms.ddp_comm_hooks'
	touch $@

setup: $(VENV)/.deps

build: setup
	$(BIN)/pip install -q --no-build-isolation --no-deps -e .

demo: build
	$(BIN)/python -m fastddp.demo $(DEMO_ARGS)

# Compile and link the CUDA sources with nvcc for sm_80/sm_90 (no GPU needed), with the ops'
# other sources but not the DDP hooks (host code that `make build` compiles the same way), then
# check that the library holds device code for both, leaves nothing of fastddp's own unresolved,
# and that the kernels' PTX keeps bit parity with the CPU (benchmarks/ptx_check.py), and that
# every vector kernel's sm_90 SASS loads and stores 128 bits in its loop, and no kernel touches
# local memory (benchmarks/sass_check.py).
# Without nvcc this is skipped with a message, unless REQUIRE_CUDA_CHECK=1 (as in CI).
NVCC := $(shell command -v nvcc 2>/dev/null)
# cuobjdump from PATH, else the one make setup installs (expanded when used, after setup).
CUOBJDUMP = $(firstword $(shell command -v cuobjdump 2>/dev/null) \
	$(wildcard $(VENV)/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump))
cuda-check: setup
ifeq ($(NVCC),)
	@if [ "$(REQUIRE_CUDA_CHECK)" = 1 ]; then echo "nvcc not found; the CUDA check is required"; exit 1; fi
	@echo "nvcc not found: skipping the CUDA compile check"
else
	# Its two parts side by side: each is mostly one compiler process, and under make test this
	# check, niced below the tests, runs last, where one part alone would leave a core idle.
	$(MAKE) --no-print-directory -j2 cuda-check-kernels cuda-check-hooks
	@echo "CUDA sources compiled and linked for sm_80 and sm_90; their PTX keeps CPU parity;"
	@echo "their sm_90 SASS moves memory 16 bytes at a time and uses no local memory;"
	@echo "the DDP hooks' CUDA-only code compiles"
endif

ifeq ($(NVCC),)
cuda-check-kernels cuda-check-hooks:
	@echo "nvcc not found: make $@ compiles with it"; exit 1
else
cuda-check-kernels: setup
	$(BIN)/cmake -S . -B build-cmake -G Ninja -DPython_EXECUTABLE=$(abspath $(BIN))/python \
		-DCMAKE_MAKE_PROGRAM=$(abspath $(BIN))/ninja -DCMAKE_CUDA_COMPILER=$(realpath $(NVCC)) \
		-DFASTDDP_UNITY=ON -DFASTDDP_DDP_HOOKS=OFF
	# Without make's flags: they name make -j2's job pipe, which make does not pass to this
	# command, and ninja would report its descriptors invalid.
	MAKEFLAGS= $(BIN)/cmake --build build-cmake
	readelf -S build-cmake/_C.so | grep -q .nv_fatbin
	# A cubin for each architecture (cuobjdump lists them; nvcc compresses a large fatbin, so
	# their text is not in the file as it is).
	$(CUOBJDUMP) -lelf build-cmake/_C.so | grep -q 'sm_80\.cubin'
	$(CUOBJDUMP) -lelf build-cmake/_C.so | grep -q 'sm_90\.cubin'
	! nm -uC build-cmake/_C.so | grep -q 'fastddp::'
	# Bit parity with the CPU: no FMA nvcc or ptxas could contract, no approximate math, in the
	# PTX of every kernel, compiled with the flags of the build above.
	$(BIN)/python benchmarks/ptx_check.py --build-dir build-cmake
	# Memory in 16-byte accesses: a loop of each vector kernel holds LDG.E.128 and STG.E.128;
	# no LDL or STL anywhere.
	$(BIN)/python benchmarks/sass_check.py --build-dir build-cmake

# The DDP hooks' code for CUDA builds only (FASTDDP_WITH_CUDA in csrc/ddp), which
# cuda-check-kernels leaves out: checked against torch's, pybind11's and CUDA's headers, both
# files in one unit (the headers parsed once: 13 CPU s rather than 26).
cuda-check-hooks: setup
	printf '#include "csrc/ddp/switch_hook.cpp"\n#include "csrc/ddp/native_hook.cpp"\n' | \
	$(CXX) -std=c++17 -fsyntax-only -w -DFASTDDP_WITH_CUDA=1 -I. -Icsrc/include \
		$$($(NVCC) --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$$ INCLUDES="\(.*\)"/\1/p') \
		$$($(BIN)/python -c 'import sysconfig, pybind11; \
		from torch.utils import cpp_extension as c; print(" ".join("-I" + p for p in \
		c.include_paths() + [sysconfig.get_paths()["include"], pybind11.get_include()]))') \
		-x c++ -
endif

# Eight concurrent pytest streams (tests/streams.py): the multi-node jobs on namespaces and the
# launcher's jobs, which mostly wait (start-ups, links, timeouts), each split into the jobs
# broken on purpose (`faults`) and the others; the rest, on pooled ranks and in one process;
# and the emu tests, once, under
# AddressSanitizer (its runtime preloaded), split into the checks and the planted defects. The
# CUDA compile check runs beside them as one more stream, at the lowest priority, rather than
# holding the tests back for its one-core tail; it fails the command as a stream would. It
# starts with the extension's build, which the tests wait for, on the core the build's serial
# parts leave idle. Each stream's output is printed whole as it ends, with pytest's list of its
# slowest tests, then each stream's time and CPU time. Multi-rank tests share pooled rank
# processes (tests/_dist.py). The suite starts hundreds of Python processes, each of which would
# compile fastddp's sources again where PYTHONDONTWRITEBYTECODE is set, and each stream the
# tests' modules: for the tests, compiled modules are cached (__pycache__, ignored by git).
# The runner needs only the standard library, so it starts before the venv exists: the install
# keeps one core busy for half a minute, and the emulator's objects (tests/emu_objects.py,
# which the emu streams would compile later) are compiled on the other meanwhile.
test:
	PYTHONDONTWRITEBYTECODE= $(PYTHON) tests/streams.py --python $(BIN)/python \
		--setup "$(MAKE) --no-print-directory setup" \
		--early emu-objects "$(PYTHON) tests/emu_objects.py" \
		--first "$(MAKE) --no-print-directory build" \
		--also cuda-check "$(MAKE) --no-print-directory cuda-check" \
		$(if $(PYTEST_ARGS),-- $(PYTEST_ARGS))

# The single-process tests only (no ranks, launchers, namespaces or emulator), for a quick
# loop; one area alone: `.venv/bin/python -m pytest tests/hooks`.
test-fast: build
	$(BIN)/python -m pytest -m "not multiproc and not netns and not emu" $(PYTEST_ARGS)

# The GPU machine's torch, here: the extension built with CUDA (sm_90) against torch 2.11.0+cu130
# (the GPU image's; a 530 MB wheel from the package index), then the tests of the ranks, single
# and launcher streams run on it (torchrun's options and the examples under fastddp.launch too).
# What a GPU session's first minutes would find out (a header or an API that differs between
# torch releases), found without one. The working tree is copied to $(COMPAT_DIR)/src; its venv
# is kept between runs. Not in `make test`.
COMPAT_TORCH ?= torch==2.11.0
COMPAT_DIR ?= build-compat
# The toolkit of the nvcc on the PATH, which may be a wrapper script: the TOP it reports.
COMPAT_CUDA_HOME ?= $(or $(CUDA_HOME),$(shell echo | $(NVCC) -dryrun -x cu -c - -o /dev/null 2>&1 \
	| sed -n 's/^\#\$$ TOP=//p' | head -1))
COMPAT_PYTEST ?= -m "not emu and not netns and not faults" --deselect tests/hooks/test_integrations.py
$(COMPAT_DIR)/venv/.deps:
	$(PYTHON) -m venv $(COMPAT_DIR)/venv
	# torch 2.11 asks for setuptools < 82; pyproject.toml's license needs >= 77.
	$(COMPAT_DIR)/venv/bin/pip install -q "$(COMPAT_TORCH)" "setuptools>=77,<82" numpy ninja \
		pybind11 wheel pytest pytest-timeout pytest-benchmark rich matplotlib
	touch $@

compat-check: $(COMPAT_DIR)/venv/.deps
ifeq ($(NVCC),)
	@echo "nvcc not found: the compatibility check builds the CUDA sources and needs it"; exit 1
endif
	rm -rf $(COMPAT_DIR)/src && mkdir -p $(COMPAT_DIR)/src
	git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C $(COMPAT_DIR)/src
	cd $(COMPAT_DIR)/src && CUDA_HOME=$(COMPAT_CUDA_HOME) FORCE_CUDA=1 \
		TORCH_CUDA_ARCH_LIST=9.0 ../venv/bin/pip install -q --no-build-isolation --no-deps -e .
	cd $(COMPAT_DIR)/src && ../venv/bin/python -c \
		"import torch, fastddp; print('built against', torch.__version__, fastddp.build_info())"
	cd $(COMPAT_DIR)/src && ../venv/bin/python -m pytest -q $(COMPAT_PYTEST) $(PYTEST_ARGS)

# The GPU proof (benchmarks/gpu_check.py): where a GPU is present, builds against the installed
# torch (no venv), runs the CUDA tests, the four compute-sanitizer tools, the bandwidth and the
# step-cost tables in one command of at most 480 s, and writes summary.md, summary.json and
# logs.tar.gz into $(OUT); elsewhere says so in one line and exits 0. PART=1..3 runs one part of
# the plan, for a command cut short. `make gpu-check-plan` prints the plan and fails if it could
# run past 480 s.
GPU_PYTHON ?= python3
OUT ?= gpu-check-out
PART ?=
gpu-check:
	@$(GPU_PYTHON) benchmarks/gpu_check.py $(OUT) $(if $(PART),--part $(PART))

gpu-check-plan:
	@$(GPU_PYTHON) benchmarks/gpu_check.py $(OUT) $(if $(PART),--part $(PART)) --dry-run

# Nsight Compute over every op's kernels (a command of its own, about 60 s on an H100): the
# report, its details page and a table per kernel of what bounds it, into $(OUT).
gpu-profile:
	@$(GPU_PYTHON) benchmarks/gpu_profile.py $(OUT)

bench: build
	$(BIN)/python -m pytest benchmarks --benchmark-enable --benchmark-only \
		--benchmark-columns=min,median,mean,rounds

# Every restart case of fastddp.testing.restarts, many times (README, "Restarts"), under
# fastddp.launch and, in the first 5 rounds, plain torchrun (its hung runs cost the timeout).
STRESS_ARGS ?= --runs 50 --multi-node-runs 20 --launchers fastddp torchrun --torchrun-runs 5 \
	--timeout 75 --json benchmarks/results/restart_stress.json
stress-restart: build
	$(BIN)/python benchmarks/restart_stress.py $(STRESS_ARGS)

lint: setup
	$(BIN)/ruff check fastddp tests benchmarks examples conftest.py
	$(BIN)/ruff format --check fastddp tests benchmarks examples conftest.py

clean:
	rm -rf build build-cmake fastddp/_C*.so *.egg-info
