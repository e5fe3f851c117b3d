#!/usr/bin/env bash
# The RL recipe of docs/rl.md end to end: a synthetic verifiable task (reverse three letters,
# answer in <answer>...</answer>, tools/rl_task.py), a short pretraining on the demo corpus, SFT
# on the task, then GRPO; held-out pass@1 (tools/rl_eval.py, 8 samples per prompt at
# temperature 1) before and after GRPO. The last line printed is JSON with pass_at_1_before and
# pass_at_1_after.
#
#   tools/rl_demo.sh OUT_DIR [DEMO_DATA_DIR]
#
# DEMO_DATA_DIR: a prepared demo data dir (its tokenizer is reused); built in OUT_DIR if absent.
# SFT_STEPS / GRPO_STEPS in the environment change the schedule (defaults 500 and 48).
set -euo pipefail
out=${1:?usage: tools/rl_demo.sh OUT_DIR [DEMO_DATA_DIR]}
demo=${2:-$out/demo_data}
here=$(cd "$(dirname "$0")" && pwd)
sft_steps=${SFT_STEPS:-500}
grpo_steps=${GRPO_STEPS:-48}
mkdir -p "$out"
if [ ! -f "$demo/manifest.json" ]; then
  python -c "import sys; from maxlm.data import corpus, prepare; \
prepare.prepare(corpus.build(sys.argv[1] + '/raw', 300_000), sys.argv[2], vocab_size=1024, \
progress=False)" "$out" "$demo"
fi
model='{size: tiny, dtype: float32, remat: none, d_model: 64, n_layers: 2, n_heads: 4,
        n_kv_heads: 2, head_dim: 16, d_ff: 128, loss_chunk: 64}'
stage='seq_len: 128, attention: blockwise, block_q: 32, block_k: 32'
python "$here/rl_task.py" "$out/task"
maxlm prepare "$out/task/sft.jsonl" "$out/task/prompts.jsonl" --out "$out/data" \
    --tokenizer "$demo/tokenizer.model" --val-fraction 0 --filters off --dedup off --lang any \
    --overwrite > "$out/prepare.log"
cat > "$out/pre.yaml" <<YAML
run_dir: $out/pre
data: {dir: $demo}
model: $model
stages: [{$stage, batch: 8, steps: 30}]
train: {lr: 0.01, warmup_steps: 2, eval_every: 0}
YAML
cat > "$out/sft.yaml" <<YAML
run_dir: $out/sft
data: {dir: $out/data}
model: $model
stages: [{$stage, batch: 8, steps: $sft_steps}]
train: {lr: 0.01, warmup_steps: 2, eval_every: 0, min_lr_ratio: 1.0}
init: {from: $out/pre}
YAML
cat > "$out/grpo.yaml" <<YAML
run_dir: $out/grpo
data: {dir: $out/data}
model: $model
stages: [{$stage, batch: 32, steps: $grpo_steps}]
train: {lr: 0.001, warmup_steps: 0, eval_every: 16, objective: grpo,
        grpo: {group: 8, prompts: 16, max_new_tokens: 16, beta: 0.04,
               eval_prompts: $out/task/heldout.jsonl, eval_samples: 4}}
init: {from: $out/sft}
YAML
maxlm train "$out/pre.yaml" > "$out/pre.log"
maxlm train "$out/sft.yaml" > "$out/sft.log"
python "$here/rl_eval.py" "$out/sft" --prompts "$out/task/heldout.jsonl" > "$out/before.json"
maxlm train "$out/grpo.yaml" > "$out/grpo.log"
python "$here/rl_eval.py" "$out/grpo" --prompts "$out/task/heldout.jsonl" > "$out/after.json"
maxlm plot "$out/grpo" > /dev/null
python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
before, after = (json.load(open(f"{out}/{n}.json")) for n in ("before", "after"))
rows = [json.loads(line) for line in open(f"{out}/grpo/metrics.jsonl")]
rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
q = max(1, len(rewards) // 4)
print(json.dumps({"pass_at_1_before": before["pass_at_1"], "pass_at_1_after": after["pass_at_1"],
                  "heldout_prompts": before["prompts"], "samples": before["samples"],
                  "reward_first_quarter": sum(rewards[:q]) / q,
                  "reward_last_quarter": sum(rewards[-q:]) / q, "grpo_steps": len(rewards)}))
PY
