#!/usr/bin/env bash
# golden_logits.sh: record or compare `moe logits` of every parity model moe runs, at every ISA
# level and both KV cache types, so a change to the engine can show that it left the logits of
# the architectures it did not mean to touch identical bit for bit.
#
#   scripts/golden_logits.sh record DIR   # before the change: DIR/<model>.<isa>.<kv>.f32
#   scripts/golden_logits.sh compare DIR  # after: every file must be byte-identical
#
# MOE_BIN (default ./moe) is the binary; SHARED (default ../shared) the fixtures. Models whose
# architecture the binary does not know are skipped at record time (and so not compared); models
# with an MTP head moe runs also get their `--mtp` logits recorded.
set -euo pipefail
mode=${1:?record|compare}
dir=${2:?output directory}
bin=${MOE_BIN:-./moe}
shared=${SHARED:-../shared}
mkdir -p "$dir"
status=0
n=0
for gguf in "$shared"/parity/*.gguf "$shared"/models/stories260K/stories260K.gguf; do
  name=$(basename "$gguf" .gguf)
  tokens_json="$shared/parity/$name.tokens.json"
  if [ -f "$tokens_json" ]; then
    ids=$(python3 -c 'import json,sys; print(",".join(map(str, json.load(open(sys.argv[1]))["all_tokens"])))' "$tokens_json")
  else
    ids=1,403,407,261,378,432,383,286,261,376,298,315,421,395,317,426
  fi
  for head in main mtp; do
    flag=$([ $head = mtp ] && echo --mtp || true)
    for isa in scalar avx2 avx512 avx512vnni amx; do
      for kv in f32 f16; do
        out="$dir/$name.$head.$isa.$kv.f32"
        if [ "$mode" = record ]; then
          if ! MOE_ISA=$isa "$bin" logits "$gguf" --tokens "$ids" --kv-type $kv $flag \
              --out "$out" >/dev/null 2>"$dir/$name.err"; then
            [ $head = main ] && echo "skip $name ($(tail -1 "$dir/$name.err"))"
            rm -f "$out"
            continue 3
          fi
          n=$((n + 1))
        elif [ -f "$out" ]; then
          MOE_ISA=$isa "$bin" logits "$gguf" --tokens "$ids" --kv-type $kv $flag \
            --out "$dir/now.f32" >/dev/null 2>&1 || true
          n=$((n + 1))
          if ! cmp -s "$out" "$dir/now.f32"; then
            echo "DIFFERENT: $name $head $isa kv=$kv"
            status=1
          fi
          rm -f "$dir/now.f32"
        fi
      done
    done
  done
done
rm -f "$dir/now.f32" "$dir"/*.err
echo "$mode: $n logits files ($([ $status = 0 ] && echo identical || echo 'some differ'))"
exit $status
