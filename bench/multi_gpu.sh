#!/usr/bin/env bash
# The runs of several GPUs of one host, in one call (docs/parallel.md, "Measuring on several
# GPUs"). Usage: bench/multi_gpu.sh BUILD [N...]  (BUILD: a CUDA build with MPI, NCCL and the
# benchmarks, e.g. build; N: process counts, one GPU each, default 2 4 8 up to the GPU count).
# Writes OUT (default multi_gpu_out, or $HLM_MULTI_OUT) and prints summary.txt at the end:
#  1. the checks across processes on N GPUs: hlm_dist_check --nccl, --kda-cp f32 cuda and
#     --moe-ep f32 cuda (each against one process in the same job);
#  2. training (the trainer as `hybridlm train --device cuda` runs it, hlm_dist_check --train) on
#     N GPUs data parallel, and with the experts split over the N (expert parallel), 10 steps in
#     FP32, against one GPU: the worst relative difference of every loss term (target 1e-6), and a
#     second run of each compared bit for bit;
#  3. the bus bandwidth of the collectives at the sizes of a step (bench_dist comm);
#  4. KDA context parallel, chunkwise and headwise, at T = 131072 over N GPUs against one GPU
#     (bench_dist kda-cp with configs/glm5_3_flash.json's KDA layer);
#  5. weak scaling of the whole-model step: configs/bench_glm_2b.json trained on random tokens,
#     8192 tokens per GPU, tokens/s per GPU at N against one GPU.
# HLM_MULTI_SMALL=1 shrinks every shape (the script checked on the CUDA emulation's NCCL stand-in:
# BUILD an emulation build with the benchmarks, N = 2). Exit status: 1 when a check failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$(pwd)
build=$(cd "${1:?usage: bench/multi_gpu.sh BUILD [N...]}" && pwd)
shift
out=${HLM_MULTI_OUT:-multi_gpu_out}
small=${HLM_MULTI_SMALL:-0}
mkdir -p "$out"
out=$(cd "$out" && pwd)
check=$build/tests/hlm_dist_check
bench=$build/bench/bench_dist
for b in "$check" "$bench"; do
  [ -x "$b" ] || { echo "multi_gpu.sh: $b is not built" >&2; exit 2; }
done
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ $# -gt 0 ]; then
  counts=("$@")
else
  counts=()
  for n in 2 4 8; do [ "$n" -le "${gpus:-0}" ] && counts+=("$n"); done
fi
[ ${#counts[@]} -gt 0 ] || { echo "multi_gpu.sh: no process count (GPUs seen: ${gpus:-0})" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# NVLink multicast stays off (NCCL's NVLS).
export NCCL_NVLS_ENABLE=0
threads=$(($(nproc) / ${counts[-1]}))
[ "$threads" -ge 1 ] || threads=1
mpi() { local n=$1; shift; OMP_NUM_THREADS=$threads mpirun --oversubscribe --bind-to none -np "$n" "$@"; }
summary=$out/summary.txt
: >"$summary"
failed=0
note() { echo "$*" | tee -a "$summary"; }
run() {  # run NAME CMD...: its output in NAME.txt; a nonzero status is a failure
  local name=$1; shift
  if "$@" >"$out/$name.txt" 2>&1; then return 0; fi
  note "FAILED: $name (status $?; $out/$name.txt)"
  tail -5 "$out/$name.txt"
  failed=1
  return 1
}
note "multi_gpu.sh: $(date -u +%F) $(git -C "$repo" rev-parse --short HEAD 2>/dev/null) on" \
  "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"

# ---- the configs ----------------------------------------------------------------------------
# Training: the GPU test's model (KDA, DSA with KPool, MoE of 8 experts, mHC, MTP), FP32.
cat >"$out/model.json" <<'EOF'
{"model_type": "glm5_next_text", "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 3,
 "layer_pattern": "KDK", "first_k_dense_replace": 1, "intermediate_size": 48,
 "initializer_range": 0.2, "linear_num_heads": 2, "linear_head_dim": 32,
 "linear_conv_kernel_dim": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
 "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 0,
 "v_head_dim": 8, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 6, "index_kpool": 2,
 "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
 "moe_intermediate_size": 16, "mhc": true, "hc_mult": 4, "num_nextn_predict_layers": 1,
 "gemm_precision": "native", "dsa_indexer_loss_coeff": 0.1, "router_aux_loss_coef": 0.01}
EOF
steps=10 tokens=512
[ "$small" = 1 ] && steps=3 tokens=96
cat >"$out/train.json" <<EOF
{"model": "model.json", "steps": $steps, "tokens_per_step": $tokens, "lr": 0.01,
 "warmup_steps": 2, "eval_interval": 0, "eval_batches": 1, "log_interval": 1,
 "checkpoint_interval": $steps, "dsa_dense_warmup_steps": 2, "dtype": "f32",
 "mqar": {"min_pairs": 2, "max_pairs": 4}}
EOF
# Metrics of run A against run B: the worst |a - b| / |b| of every loss term; "bits": the
# checkpoints' tensors byte for byte.
compare() {
  python3 - "$@" <<'EOF'
import json, struct, sys
a, b, what = sys.argv[1], sys.argv[2], sys.argv[3]
if what == "bits":
    def tensors(p):
        raw = open(p, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8:8 + n])
        return {k: raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
                for k, v in head.items() if k != "__metadata__"}
    same = all(tensors(f"{a}/{f}") == tensors(f"{b}/{f}")
               for f in ("model.safetensors", "trainer_state.safetensors"))
    print("same bits" if same else "DIFFERENT bits")
    sys.exit(0 if same else 1)
ma = [json.loads(l) for l in open(f"{a}/metrics.jsonl")]
mb = [json.loads(l) for l in open(f"{b}/metrics.jsonl")]
worst, at = 0.0, ""
for x, y in zip(ma, mb):
    for k in ("loss", "objective", "mtp_loss", "aux_loss", "indexer_loss"):
        r = abs(x[k] - y[k]) / max(abs(y[k]), 1e-30)
        if r > worst:
            worst, at = r, f"step {x['step']} {k}"
print(f"{len(ma)} steps, worst relative difference {worst:.2e} ({at})")
sys.exit(0 if len(ma) == len(mb) and worst <= float(what) else 1)
EOF
}
train() {  # train N OUT EP
  (cd "$out" && OMP_NUM_THREADS=$threads mpirun --oversubscribe --bind-to none -np "$1" \
    "$check" --train train.json "$2" cuda "$3")
}
run train_1 train 1 one 1 || true

for n in "${counts[@]}"; do
  note "== $n GPUs =="
  # 1. the checks
  for c in "--nccl" "--kda-cp f32 cuda" "--moe-ep f32 cuda"; do
    name=check_${n}_$(echo "$c" | tr -dc 'a-z')
    # shellcheck disable=SC2086
    run "$name" mpi "$n" "$check" $c && note "$c: $(grep -c 'passed' "$out/$name.txt") ranks passed"
  done
  # 2. training against one GPU, and again for the bits
  for ep in 1 "$n"; do
    tag=dp${n}_ep${ep}
    for r in a b; do run "train_${tag}_$r" train "$n" "${tag}_$r" "$ep" || continue 2; done
    r=$(compare "$out/${tag}_a" "$out/one" 1e-6) || failed=1
    note "train $n GPUs, expert parallel $ep: $r"
    r=$(compare "$out/${tag}_a" "$out/${tag}_b" bits) || failed=1
    note "  run again: $r"
  done
  # 3. bus bandwidth: the 2B bench model's gradients (BF16 GEMMs, FP32 grads: ~8 GiB over the
  #    step's buckets), an expert all-to-all of 8192 tokens x 8 x 4096 f32 (1 GiB) and a KDA CP
  #    state (8 MiB)
  sizes="8 64 512 1024"
  [ "$small" = 1 ] && sizes="0.25 1"
  run "comm_$n" mpi "$n" "$bench" comm cuda $sizes && grep '^comm' "$out/comm_$n.txt" | tee -a "$summary"
  # 4. KDA context parallel at T = 131072 (one GPU: measured once)
  T=131072 kcfg=$repo/configs/glm5_3_flash.json
  if [ "$small" = 1 ]; then
    T=512
    kcfg=$out/kda_small.json
    printf '%s\n' '{"model_type": "glm5_next_text", "vocab_size": 64, "hidden_size": 64,' \
      '"num_hidden_layers": 1, "layer_pattern": "K", "intermediate_size": 64,' \
      '"linear_num_heads": 4, "linear_head_dim": 32, "n_routed_experts": 0,' \
      '"num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8,' \
      '"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 0, "v_head_dim": 4,' \
      '"num_nextn_predict_layers": 0}' >"$kcfg"
  fi
  [ -f "$out/kda_cp_1.txt" ] || run kda_cp_1 mpi 1 "$bench" kda-cp "$kcfg" cuda "$T" chunkwise
  grep -h '^kda-cp' "$out/kda_cp_1.txt" 2>/dev/null | tee -a "$summary"
  for mode in chunkwise headwise; do
    run "kda_cp_${n}_$mode" mpi "$n" "$bench" kda-cp "$kcfg" cuda "$T" "$mode" &&
      grep -h '^kda-cp' "$out/kda_cp_${n}_$mode.txt" | tee -a "$summary"
  done
done

# 5. weak scaling of the whole-model step (8192 tokens per GPU; 4096 per sequence)
per=8192 seq=4096 sstep=6 mcfg=$repo/configs/bench_glm_2b.json vocab=$(python3 -c \
  "import json;print(json.load(open('$repo/configs/bench_glm_2b.json'))['vocab_size'])")
if [ "$small" = 1 ]; then per=128 seq=32 sstep=2 mcfg=$out/model.json vocab=40; fi
python3 -c "
import random, struct
random.seed(0)
open('$out/tokens.bin', 'wb').write(struct.pack('<%dI' % (1 << 20), *[random.randrange($vocab) for _ in range(1 << 20)]))"
for n in 1 "${counts[@]}"; do
  cat >"$out/scale_$n.json" <<EOF
{"model": "$mcfg", "steps": $sstep, "tokens_per_step": $((per * n)), "seq_len": $seq,
 "data": "tokens.bin", "lr": 0.001, "warmup_steps": 1, "eval_interval": 0, "log_interval": 1,
 "checkpoint_interval": 0, "dtype": "f32", "mtp": false}
EOF
  if run "scale_$n" bash -c "cd '$out' && OMP_NUM_THREADS=$threads mpirun --oversubscribe \
      --bind-to none -np $n '$check' --train scale_$n.json scale_$n cuda 1"; then
    # tokens/s of the steps after the first (metrics.jsonl), per GPU
    tps=$(python3 -c "
import json
m = [json.loads(l) for l in open('$out/scale_$n/metrics.jsonl')][1:]
print(f'{sum(r[\"tokens_per_s\"] for r in m) / max(len(m), 1) / $n:.0f}')")
    note "scaling: $n GPU(s), $((per * n)) tokens per step: $tps tokens/s per GPU"
  fi
done
note "multi_gpu.sh: $([ $failed = 0 ] && echo 'every check passed' || echo 'some checks FAILED')"
exit $failed
