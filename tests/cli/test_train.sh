#!/usr/bin/env bash
# CLI test of roundpipe-train (run by CTest): the loss falls on the embedded
# default, bad flags fail cleanly with a message, Hugging Face weights and
# token files load, a resumed run repeats the uninterrupted run's losses
# exactly, and the compact optimizer state trains and resumes.
#
#   tests/cli/test_train.sh path/to/roundpipe-train
set -uo pipefail
bin=${1:?usage: test_train.sh path/to/roundpipe-train}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
small=(--devices cpu:2 --batch-size 8 --seq-len 32 --warmup-steps 5 --lr 3e-3 --quiet)

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

# 1. Training on the embedded default lowers the loss.
if "$bin" "${small[@]}" --steps 50 --eval-every 25 --metrics "$tmp/train.jsonl" >"$tmp/train.log" 2>&1; then
  python3 - "$tmp/train.jsonl" <<'PY' || fail "loss did not fall (see above)"
import json, math, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in recs if r["type"] == "train"]
evals = [r for r in recs if r["type"] == "eval"]
assert [r["step"] for r in train] == list(range(1, 51)), "one record per step 1..50"
for r in train:
    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "peak_memory_bytes", "elapsed_s"):
        assert key in r, f"step {r['step']} lacks {key}"
    assert set(r["peak_memory_bytes"]) == {"cpu:0", "cpu:1"}, r["peak_memory_bytes"]
assert [r["step"] for r in evals] == [25, 50], f"eval records at {[r['step'] for r in evals]}"
first = train[0]["loss"]
last5 = sum(r["loss"] for r in train[-5:]) / 5
print(f"loss {first:.4f} -> mean of last 5 {last5:.4f}")
assert math.isfinite(last5) and last5 < 0.85 * first, f"{last5} is not 15% below {first}"
assert evals[-1]["eval_loss"] < 0.9 * first
PY
else
  fail "training run exited with $?"; cat "$tmp/train.log"
fi
grep -q "^done: 50 steps" "$tmp/train.log" || fail "no summary line in the output"

# 2. Bad flags: non-zero exit (not a crash) and a message.
bad() {
  local expect=$1; shift
  "$bin" "$@" >"$tmp/bad.out" 2>"$tmp/bad.err"
  local rc=$?
  if [ "$rc" -eq 0 ] || [ "$rc" -ge 128 ]; then
    fail "'$*' exited with $rc"
  elif ! grep -qi -- "$expect" "$tmp/bad.err"; then
    fail "'$*': stderr lacks '$expect':"; cat "$tmp/bad.err"
  fi
}
bad "not expected" --no-such-flag
bad "steps" --steps 0
bad "dtype" --dtype fp8
bad "preset" --preset gpt2
bad "data" --data "$tmp/missing.bin"
bad "excludes" --preset qwen3 --config "$tmp/train.log"
bad "microbatches" --batch-size 2 --microbatches 3
bad "max_position_embeddings" --seq-len 4096
bad "checkpoint" --save-every 5
bad "min-lr" --lr 1e-4 --min-lr 1e-3
# A bad --devices spec is named as the flag, not as the variable it sets.
for spec in cpu:zero gpu:2; do
  bad "--devices $spec" --devices "$spec" --steps 1
  grep -q ROUNDPIPE_DEVICES "$tmp/bad.err" && { fail "--devices $spec: the error names ROUNDPIPE_DEVICES"; cat "$tmp/bad.err"; }
done
bad "bf16" --devices cpu:1 --dtype fp16 --steps 1
bad "optimizer-state" --optimizer-state int8
bad "not supported with --dtype fp16" --dtype fp16 --optimizer-state compact
printf 'abc' >"$tmp/odd.bin"
bad "odd.bin" --data "$tmp/odd.bin" --steps 1
# Out-of-range integers name the range (no saturation, no 300-digit bound).
bad "an integer from 1 to 1000000000000" --steps 99999999999999999999
bad "an integer from 1 to 1000000000000" --steps 0
bad "from 1 to the hidden size (128)" --lora-rank 4096 --steps 1
# Every output path is checked before training starts (no run lost to a typo).
for flag in --checkpoint --trace --metrics; do
  bad "does not exist" "$flag" "$tmp/no-such-dir/out" --steps 1
  bad "is a directory" "$flag" "$tmp" --steps 1
done
bad "does not exist" --save-hf "$tmp/no-such-dir/out" --steps 1
bad "is not a directory" --save-hf "$tmp/train.log" --steps 1
grep -q "steps" "$tmp/bad.out" && fail "the output-path errors came after the start-up summary"

# 2a. --quiet: the start-up summary and the result, no evaluation or
# checkpoint lines.
if "$bin" "${small[@]}" --steps 6 --eval-every 2 --save-every 3 --checkpoint "$tmp/q.ckpt" >"$tmp/q.log" 2>&1; then
  grep -qE "^(eval at step|checkpoint of step|step [0-9])" "$tmp/q.log" && { fail "--quiet printed progress lines:"; cat "$tmp/q.log"; }
  grep -q "^done: 6 steps.*eval loss" "$tmp/q.log" || { fail "--quiet: no result line"; cat "$tmp/q.log"; }
else
  fail "--quiet run exited non-zero"; cat "$tmp/q.log"
fi

# 2c. docs/train.md's sample output is what the default run prints: the
# same start-up lines (the steps line aside: this run stops after step 2),
# and progress, evaluation and summary lines of the same form.
docs=$(cd "$(dirname "$0")/../.." && pwd)/docs/train.md
if "$bin" --devices cpu:2 --stop-after 2 --log-every 1 >"$tmp/sample.log" 2>&1; then
  python3 - "$docs" "$tmp/sample.log" <<'PY' || fail "docs/train.md's sample output differs from the command's (above)"
import re, sys
page, run = open(sys.argv[1]).read(), open(sys.argv[2]).read().splitlines()
sample = re.search(r"```\n(roundpipe-train: .*?)```", page, re.S).group(1).splitlines()
header = [l for l in sample if not re.match(r"(step |eval |done:|\.\.\.|  peak memory|  final plan)", l)]
ours = run[:len(header)]
steps = "  steps    1 to 250 of 250; eval every 100 and at the end"
assert ours[-1] == steps.replace("1 to 250", "1 to 2"), ours[-1]
ours[-1] = steps
for a, b in zip(header, ours):
    assert a == b, f"the page says\n{a}\nthe command prints\n{b}"
mem = r"( cpu:\d+ \d+(\.\d+)?[KMGB])+"
forms = [r"step \d+/\d+  loss \d\.\d{4}  [\d.]+k? tok/s  ETA \w+  peak" + mem,
         r"eval at step \d+: loss \d\.\d{4}",
         r"done: \d+ steps in \w+ \([\d.]+k? tokens/s\); loss \d\.\d{4} at step 1 -> \d\.\d{4} "
         r"\(mean of last \d+: \d\.\d{4}\); eval loss \d\.\d{4}",
         r"  peak memory" + mem.replace(" cpu", "  cpu"), r"  final plan fwd \[.*\] bwd \[.*\]", r"\.\.\."]
for name, lines in (("the page", sample[len(header):]), ("the command", run[len(header):])):
    for line in lines:
        assert any(re.fullmatch(f, line) for f in forms), f"{name}: a line of no known form: {line!r}"
print("docs/train.md's sample output has the command's start-up lines and line forms")
PY
else
  fail "the default run of two steps exited non-zero"; cat "$tmp/sample.log"
fi

# 3. Hugging Face weights and token files: a safetensors file with the tiny
# Llama's tensors (plus one the model does not use) and uint16 token files.
python3 - "$tmp" <<'PY'
import array, json, struct, sys
d, i, v, kv = 128, 384, 256, 64
shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
          "lm_head.weight": (v, d), "model.rotary_emb.inv_freq": (16,)}
for l in range(4):
    p = f"model.layers.{l}."
    shapes.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                   p + "mlp.gate_proj.weight": (i, d), p + "mlp.up_proj.weight": (i, d),
                   p + "mlp.down_proj.weight": (d, i), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)})
header, blobs, off = {}, [], 0
for name, shape in sorted(shapes.items()):
    n = 1
    for s in shape:
        n *= s
    vals = [1.0] * n if "norm" in name else [((k * 7919) % 1001 - 500) / 25000 for k in range(n)]
    b = array.array("f", vals).tobytes()
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + len(b)]}
    off += len(b)
    blobs.append(b)
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1] + "/w.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
text = ("the quick brown fox jumps over the lazy dog. " * 200).encode()
array.array("H", list(text)).tofile(open(sys.argv[1] + "/train.bin", "wb"))
array.array("H", list(text[:2000])).tofile(open(sys.argv[1] + "/val.bin", "wb"))
PY
if "$bin" "${small[@]}" --steps 10 --weights "$tmp/w.safetensors" --data "$tmp/train.bin" \
    --eval-data "$tmp/val.bin" >"$tmp/w.log" 2>&1; then
  grep -q "39 tensors from .*w.safetensors (1 unused)" "$tmp/w.log" || { fail "weights not reported as loaded"; cat "$tmp/w.log"; }
  grep -q "eval: .* from .*val.bin" "$tmp/w.log" || { fail "--eval-data not used"; cat "$tmp/w.log"; }
else
  fail "training from --weights/--data exited non-zero"; cat "$tmp/w.log"
fi
bad "q_norm" --preset qwen3 --weights "$tmp/w.safetensors" --steps 1
# --hf-model DIR: a checkpoint directory as transformers writes it.
mkdir -p "$tmp/hf"
cp "$tmp/w.safetensors" "$tmp/hf/model.safetensors"
cat >"$tmp/hf/config.json" <<'JSON'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
 "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": false}
JSON
if "$bin" "${small[@]}" --steps 6 --hf-model "$tmp/hf" --data "$tmp/train.bin" >"$tmp/hf.log" 2>&1; then
  grep -q "39 tensors from .*hf" "$tmp/hf.log" || { fail "--hf-model weights not reported as loaded"; cat "$tmp/hf.log"; }
else
  fail "training from --hf-model exited non-zero"; cat "$tmp/hf.log"
fi
bad "excludes" --hf-model "$tmp/hf" --preset qwen3
bad "no config.json" --hf-model "$tmp" --steps 1

# 3b. --save-hf: transformers loads the trained model (sharded past
# --save-hf-shard-mb) with the run's weights, and PEFT the LoRA adapter: their
# evaluation loss on --eval-data equals the run's.
py=${ROUNDPIPE_TEST_PYTHON:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
hf_check() {  # hf_check DIR LOG MODE: MODE is full, lora or sharded
  "$py" - "$1" "$tmp/val.bin" "$2" "$3" "$tmp/hf" <<'PY'
import array, json, os, re, sys
import torch, transformers, peft
out, val, log, mode, source = sys.argv[1:6]
expected = float(re.search(r"eval loss ([0-9.]+)", open(log).read()).group(1))
tokens = array.array("H")
tokens.frombytes(open(val, "rb").read())
rows = torch.tensor([tokens[w * 32:w * 32 + 33].tolist() for w in range(8)])
files = sorted(os.listdir(out))
def loss_of(model):
    with torch.no_grad():
        logits = model(input_ids=rows[:, :32]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
models = {"from_pretrained": model}
if mode == "sharded":
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1 and "model.safetensors" not in files, files
else:
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files, files
if mode == "lora":
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files), files
    assert any("lora_" in name for name, _ in model.named_parameters()), "from_pretrained did not load the adapter"
    models["AutoPeftModelForCausalLM"] = peft.AutoPeftModelForCausalLM.from_pretrained(out)
    models["PeftModel over --hf-model"] = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(source), out)
else:
    assert "adapter_config.json" not in files, files
if mode != "full":  # trained from --hf-model: the loss is not the untrained model's
    untrained = loss_of(transformers.AutoModelForCausalLM.from_pretrained(source))
    assert abs(untrained - expected) > 1e-3, f"the untrained model's loss {untrained:.6f} is the run's"
for how, m in models.items():
    got = loss_of(m)
    assert abs(got - expected) < 1e-4, f"{how}: eval loss {got:.6f}, the run printed {expected:.4f}"
print(f"--save-hf {mode}: {len(models)} loader(s) give the run's eval loss {expected:.4f}")
PY
}
if "$py" -c "import transformers, peft" 2>/dev/null; then
  save=("${small[@]}" --steps 6 --data "$tmp/train.bin" --eval-data "$tmp/val.bin" --eval-batches 1)
  "$bin" "${save[@]}" --hf-model "$tmp/hf" --save-hf "$tmp/out" --save-hf-shard-mb 1 >"$tmp/s1.log" 2>&1 &&
    grep -q "Hugging Face model written to $tmp/out" "$tmp/s1.log" &&
    hf_check "$tmp/out" "$tmp/s1.log" sharded || { fail "--save-hf, sharded"; cat "$tmp/s1.log"; }
  # Written again into the same directory, unsharded: the shards go.
  "$bin" "${save[@]}" --preset qwen3 --save-hf "$tmp/out" >"$tmp/s2.log" 2>&1 &&
    hf_check "$tmp/out" "$tmp/s2.log" full || { fail "--save-hf of the qwen3 preset"; cat "$tmp/s2.log"; }
  "$bin" "${save[@]}" --hf-model "$tmp/hf" --lora-rank 4 --lr 3e-2 --save-hf "$tmp/lora" >"$tmp/s3.log" 2>&1 &&
    hf_check "$tmp/lora" "$tmp/s3.log" lora || { fail "--save-hf with LoRA"; cat "$tmp/s3.log"; }
else
  echo "skipped the --save-hf loading checks: $py cannot import transformers and peft"
fi

# 4. Checkpoint and resume: steps 11..20 after resuming at 10 equal the
# uninterrupted run's, bit for bit.
run=("${small[@]}" --steps 20 --save-every 10)
"$bin" "${run[@]}" --checkpoint "$tmp/a.ckpt" --metrics "$tmp/a.jsonl" >"$tmp/a.log" 2>&1 || { fail "run a"; cat "$tmp/a.log"; }
"$bin" "${run[@]}" --stop-after 10 --checkpoint "$tmp/b.ckpt" --metrics "$tmp/b.jsonl" >"$tmp/b.log" 2>&1 || { fail "run b"; cat "$tmp/b.log"; }
"$bin" "${run[@]}" --resume "$tmp/b.ckpt" --checkpoint "$tmp/c.ckpt" --metrics "$tmp/c.jsonl" >"$tmp/c.log" 2>&1 || { fail "run c"; cat "$tmp/c.log"; }
losses "$tmp/a.jsonl" >"$tmp/a.txt"
(losses "$tmp/b.jsonl"; losses "$tmp/c.jsonl") >"$tmp/bc.txt"
if [ "$(wc -l <"$tmp/a.txt")" -ne 20 ] || ! cmp -s "$tmp/a.txt" "$tmp/bc.txt"; then
  fail "resumed losses differ from the uninterrupted run's:"; diff "$tmp/a.txt" "$tmp/bc.txt"
else
  echo "resume at step 10: steps 11..20 equal the uninterrupted run's losses"
fi
grep -q "resumed from .*b.ckpt at step 10" "$tmp/c.log" || { fail "no resume note"; cat "$tmp/c.log"; }
# The same on one device (same microbatch count): the checkpoint is device-agnostic.
"$bin" "${run[@]}" --devices cpu:1 --microbatches 3 --resume "$tmp/b.ckpt" --checkpoint "$tmp/d.ckpt" --metrics "$tmp/d.jsonl" >"$tmp/d.log" 2>&1 || { fail "run d"; cat "$tmp/d.log"; }
(losses "$tmp/b.jsonl"; losses "$tmp/d.jsonl") >"$tmp/bd.txt"
if ! cmp -s "$tmp/a.txt" "$tmp/bd.txt"; then
  fail "losses resumed on cpu:1 differ from the uninterrupted cpu:2 run's:"; diff "$tmp/a.txt" "$tmp/bd.txt"
else
  echo "resume on cpu:1: steps 11..20 equal the cpu:2 run's losses"
fi

# 5. Ctrl-C: the run stops at a step boundary, writes its checkpoint and
# exits 130; the checkpoint resumes.
"$bin" "${small[@]}" --steps 100000 --metrics "$tmp/int.jsonl" --checkpoint "$tmp/int.ckpt" >"$tmp/int.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  [ "$(cat "$tmp/int.jsonl" 2>/dev/null | grep -c '"train"')" -ge 3 ] && break
  sleep 0.1
done
kill -INT "$pid"
wait "$pid"
rc=$?
if [ "$rc" -ne 130 ]; then
  fail "SIGINT: exit status $rc, expected 130"; cat "$tmp/int.log"
elif ! grep -q "interrupted: stopping after step" "$tmp/int.log" || [ ! -s "$tmp/int.ckpt" ]; then
  fail "SIGINT: no interruption note or no checkpoint"; cat "$tmp/int.log"
else
  "$bin" "${small[@]}" --steps 100000 --stop-after "$(( $(grep -o 'stopping after step [0-9]*' "$tmp/int.log" | grep -o '[0-9]*$') + 2 ))" \
      --resume "$tmp/int.ckpt" >"$tmp/int2.log" 2>&1 || { fail "resume after SIGINT"; cat "$tmp/int2.log"; }
  echo "SIGINT: exit 130 with a checkpoint that resumes"
fi

# 6-7. --optimizer-state compact: the loss falls as in 1, the start-up log
# names the state, and a resumed run repeats the uninterrupted one exactly
# (8-bit moments and their block scales round-trip through the checkpoint).
#   compact_checks NAME EXPECTED-STATE-LINE FLAGS...
compact_checks() {
  local name=$1 state=$2; shift 2
  local args=("${small[@]}" --optimizer-state compact "$@")
  if ! "$bin" "${args[@]}" --steps 50 --metrics "$tmp/$name.jsonl" >"$tmp/$name.log" 2>&1; then
    return 1
  fi
  grep -q "$state" "$tmp/$name.log" || { fail "$name: no '$state' in the start-up log"; cat "$tmp/$name.log"; }
  python3 - "$tmp/$name.jsonl" <<'PY' || fail "$name: loss did not fall (see above)"
import json, math, sys
train = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "train"]
first, last5 = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
print(f"compact: loss {first:.4f} -> mean of last 5 {last5:.4f}")
assert math.isfinite(last5) and last5 < 0.85 * first, f"{last5} is not 15% below {first}"
assert all(math.isfinite(r["grad_norm"]) for r in train), "a gradient norm is not finite"
PY
  local run=("${args[@]}" --steps 20 --save-every 10)
  "$bin" "${run[@]}" --checkpoint "$tmp/$name-a.ckpt" --metrics "$tmp/$name-a.jsonl" >"$tmp/$name-a.log" 2>&1 || { fail "$name: run a"; cat "$tmp/$name-a.log"; }
  "$bin" "${run[@]}" --stop-after 10 --checkpoint "$tmp/$name-b.ckpt" --metrics "$tmp/$name-b.jsonl" >"$tmp/$name-b.log" 2>&1 || { fail "$name: run b"; cat "$tmp/$name-b.log"; }
  "$bin" "${run[@]}" --resume "$tmp/$name-b.ckpt" --checkpoint "$tmp/$name-c.ckpt" --metrics "$tmp/$name-c.jsonl" >"$tmp/$name-c.log" 2>&1 || { fail "$name: run c"; cat "$tmp/$name-c.log"; }
  losses "$tmp/$name-a.jsonl" >"$tmp/$name-a.txt"
  (losses "$tmp/$name-b.jsonl"; losses "$tmp/$name-c.jsonl") >"$tmp/$name-bc.txt"
  if [ "$(wc -l <"$tmp/$name-a.txt")" -ne 20 ] || ! cmp -s "$tmp/$name-a.txt" "$tmp/$name-bc.txt"; then
    fail "$name: resumed losses differ from the uninterrupted run's:"; diff "$tmp/$name-a.txt" "$tmp/$name-bc.txt"
  else
    echo "$name: resume at step 10 repeats steps 11..20 exactly"
  fi
}
# 6. fp32 model: fp32 optimizer copies, 8-bit moments.
compact_checks compact-fp32 "state    compact: fp32 optimizer copies, blockwise 8-bit AdamW moments" \
  --dtype fp32 || { fail "compact-fp32: training run exited non-zero"; cat "$tmp/compact-fp32.log"; }
# 7. bf16 model: bf16 optimizer copies (gradients and clipping in bf16 too,
# AdamW's updates stochastically rounded).
compact_checks compact-bf16 "state    compact: bf16 optimizer copies, blockwise 8-bit AdamW moments" \
  --dtype bf16 || { fail "compact-bf16: training run exited non-zero"; cat "$tmp/compact-bf16.log"; }

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all roundpipe-train CLI checks passed"
