#!/usr/bin/env bash
# CLI test of roundpipe-train --frozen-weights (run by CTest): a LoRA run of
# the tiny Llama on NF4 frozen weights trains like one on bf16 frozen
# weights (final losses within 2 %), the start-up log names the format and
# the packed bytes, FP4 and int8 train too, a resumed run repeats the
# uninterrupted one exactly (the packed weights round-trip through the
# checkpoint), --save-hf writes the dequantized base, and bad requests fail
# with a message naming the fix.
#
#   tests/cli/test_train_frozen_weights.sh path/to/roundpipe-train
set -uo pipefail
bin=${1:?usage: test_train_frozen_weights.sh path/to/roundpipe-train}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
lora=(--devices cpu:2 --batch-size 8 --seq-len 32 --warmup-steps 3 --lr 1e-2 --quiet --dtype bf16
      --lora-rank 8 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)

# Prints "step loss" for each training record of a metrics file.
losses() {
  python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["type"] == "train":
        print(r["step"], repr(r["loss"]))
PY
}

# 1. Bad requests: exit 2 and a message saying what to change.
bad() {
  local expect=$1; shift
  "$bin" "$@" >"$tmp/bad.out" 2>"$tmp/bad.err"
  local rc=$?
  if [ "$rc" -ne 2 ]; then
    fail "'$*' exited with $rc, expected 2"; cat "$tmp/bad.err"
  elif ! grep -qi -- "$expect" "$tmp/bad.err"; then
    fail "'$*': stderr lacks '$expect':"; cat "$tmp/bad.err"
  fi
}
bad "add --lora-rank R" --frozen-weights nf4 --steps 1
bad "every weight is trained" --frozen-weights int8 --lora-rank 0 --steps 1
bad "frozen-weights" --lora-rank 4 --frozen-weights nf5 --steps 1
grep -q "steps" "$tmp/bad.out" && fail "a --frozen-weights error came after the start-up summary"

# 2. NF4 against bf16 frozen weights: the same run, final losses within 2 %.
"$bin" "${lora[@]}" --steps 20 --metrics "$tmp/bf16.jsonl" >"$tmp/bf16.log" 2>&1 || { fail "bf16 LoRA run"; cat "$tmp/bf16.log"; }
"$bin" "${lora[@]}" --steps 20 --frozen-weights nf4 --metrics "$tmp/nf4.jsonl" --save-hf "$tmp/hf" \
  >"$tmp/nf4.log" 2>&1 || { fail "nf4 LoRA run"; cat "$tmp/nf4.log"; }
grep -qE "weights  .*; frozen projection weights nf4: [0-9.]+[KMG] in host memory \(0\.5[0-9]+ B/weight; 1\.5M in bf16\)" "$tmp/nf4.log" ||
  { fail "the weights line does not give the format and the packed bytes"; cat "$tmp/nf4.log"; }
grep -q "frozen projection weights" "$tmp/bf16.log" && fail "a bf16 run reports packed weights"
grep -q "Hugging Face model written to $tmp/hf .*dequantized" "$tmp/nf4.log" || { fail "--save-hf of an nf4 run"; cat "$tmp/nf4.log"; }
python3 - "$tmp/bf16.jsonl" "$tmp/nf4.jsonl" <<'PY' || fail "nf4 against bf16 frozen weights (above)"
import json, math, sys
def train(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r["type"] == "train"]
bf16, nf4 = train(sys.argv[1]), train(sys.argv[2])
assert len(bf16) == len(nf4) == 20
assert all(math.isfinite(l) for l in bf16 + nf4), "a loss is not finite"
tail = lambda l: sum(l[-5:]) / 5
ratio = tail(nf4) / tail(bf16)
print(f"LoRA final loss (mean of last 5): nf4 {tail(nf4):.4f}, bf16 {tail(bf16):.4f}, ratio {ratio:.4f}")
assert tail(nf4) < 0.95 * nf4[0], f"nf4: the loss did not fall ({nf4[0]} -> {tail(nf4)})"
assert abs(ratio - 1) <= 0.02, f"nf4 / bf16 final loss {ratio:.4f} is not within 2 %"
PY

# 3. FP4 and int8 train too (int8 with an fp32 model).
"$bin" "${lora[@]}" --steps 4 --frozen-weights fp4 >"$tmp/fp4.log" 2>&1 &&
  grep -q "frozen projection weights fp4" "$tmp/fp4.log" || { fail "fp4 LoRA run"; cat "$tmp/fp4.log"; }
"$bin" "${lora[@]}" --dtype fp32 --steps 4 --frozen-weights int8 >"$tmp/int8.log" 2>&1 &&
  grep -qE "frozen projection weights int8: .*\(1\.[0-9]+ B/weight; 3\.0M in fp32\)" "$tmp/int8.log" ||
  { fail "int8 LoRA run"; cat "$tmp/int8.log"; }

# 4. Checkpoint and resume with packed weights: steps 7..12 after resuming at
# 6 equal the uninterrupted run's, bit for bit.
run=("${lora[@]}" --frozen-weights nf4 --steps 12 --save-every 6)
"$bin" "${run[@]}" --checkpoint "$tmp/a.ckpt" --metrics "$tmp/a.jsonl" >"$tmp/a.log" 2>&1 || { fail "run a"; cat "$tmp/a.log"; }
"$bin" "${run[@]}" --stop-after 6 --checkpoint "$tmp/b.ckpt" --metrics "$tmp/b.jsonl" >"$tmp/b.log" 2>&1 || { fail "run b"; cat "$tmp/b.log"; }
"$bin" "${run[@]}" --resume "$tmp/b.ckpt" --checkpoint "$tmp/c.ckpt" --metrics "$tmp/c.jsonl" >"$tmp/c.log" 2>&1 || { fail "run c"; cat "$tmp/c.log"; }
losses "$tmp/a.jsonl" >"$tmp/a.txt"
(losses "$tmp/b.jsonl"; losses "$tmp/c.jsonl") >"$tmp/bc.txt"
if [ "$(wc -l <"$tmp/a.txt")" -ne 12 ] || ! cmp -s "$tmp/a.txt" "$tmp/bc.txt"; then
  fail "resumed nf4 losses differ from the uninterrupted run's:"; diff "$tmp/a.txt" "$tmp/bc.txt"
else
  echo "nf4 resume at step 6: steps 7..12 equal the uninterrupted run's losses"
fi

# Resuming a packed run's checkpoint without --frozen-weights names the flag.
bad "this run: --frozen-weights none" "${lora[@]}" --steps 12 --resume "$tmp/b.ckpt"

# 5. --save-hf of an NF4 run: transformers + PEFT load the dequantized base
# and the adapter, and give the run's evaluation loss (fp32 model).
py=${ROUNDPIPE_TEST_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
if "$py" -c "import transformers, peft" 2>/dev/null; then
  python3 - "$tmp" <<'PY'
import array, sys
text = ("the quick brown fox jumps over the lazy dog. " * 200).encode()
array.array("H", list(text)).tofile(open(sys.argv[1] + "/train.bin", "wb"))
array.array("H", list(text[:2000])).tofile(open(sys.argv[1] + "/val.bin", "wb"))
PY
  "$bin" "${lora[@]}" --dtype fp32 --steps 6 --frozen-weights nf4 --data "$tmp/train.bin" --eval-data "$tmp/val.bin" \
    --eval-batches 1 --save-hf "$tmp/hf32" >"$tmp/hf32.log" 2>&1 || { fail "nf4 run with --save-hf"; cat "$tmp/hf32.log"; }
  "$py" - "$tmp/hf32" "$tmp/val.bin" "$tmp/hf32.log" <<'PY' || fail "--save-hf of an nf4 run does not load as the run's model (above)"
import array, re, sys
import torch, transformers, peft
out, val, log = sys.argv[1:4]
expected = float(re.search(r"eval loss ([0-9.]+)", open(log).read()).group(1))
tokens = array.array("H")
tokens.frombytes(open(val, "rb").read())
rows = torch.tensor([tokens[w * 32:w * 32 + 33].tolist() for w in range(8)])
model = peft.AutoPeftModelForCausalLM.from_pretrained(out)
with torch.no_grad():
    logits = model(input_ids=rows[:, :32]).logits.float()
got = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
assert abs(got - expected) < 1e-4, f"PEFT over the written base: eval loss {got:.6f}, the run printed {expected:.4f}"
print(f"--save-hf nf4: PEFT over the dequantized base gives the run's eval loss {expected:.4f}")
PY
else
  echo "skipped the --save-hf loading check: $py cannot import transformers and peft"
fi

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "roundpipe-train --frozen-weights: all checks passed"
