#!/usr/bin/env bash
# The DPO recipe of docs/pairs.md on other pairs (demo_pairs --seed, --bytes-per-source: other
# documents, as another machine's text gives), each scored by the docs' check and by the
# per-step minimum it replaced. Run from a folder holding configs/, tools/ and runs/demo/data
# (the demo's data dir), e.g. the repository after `maxlm demo`:
#   bash tools/dpo_recipe_variants.sh "0 200000" "2 200000" "3 250000"
set -euo pipefail
export TQDM_DISABLE=1  # prepare's progress bars
mkdir -p runs/doc/variants
cat > runs/doc/variants/pre.yaml <<'YAML'
run_dir: runs/doc/variants/pre
data: {dir: runs/demo/data}
model: {size: tiny, dtype: float32, remat: none, d_model: 64, n_layers: 2, n_heads: 4,
        n_kv_heads: 2, head_dim: 16, d_ff: 128, loss_chunk: 64}
stages: [{seq_len: 128, batch: 8, steps: 40, attention: blockwise, block_q: 32, block_k: 32}]
train: {lr: 0.01, warmup_steps: 2, eval_every: 0}
YAML
maxlm train runs/doc/variants/pre.yaml > /dev/null
for variant in "$@"; do
  read -r seed bytes <<< "$variant"
  out="runs/doc/variants/s$seed-b$bytes"
  python tools/demo_pairs.py --out "$out.jsonl" --n 160 --seed "$seed" --bytes-per-source "$bytes" \
      > /dev/null
  maxlm prepare "$out.jsonl" --out "$out" --tokenizer runs/demo/data/tokenizer.model \
      --max-pair-len 128 --val-fraction 0 --filters off --dedup off --lang any > /dev/null
  maxlm train runs/doc/variants/pre.yaml run_dir="$out-dpo" data.dir="$out" \
      init.from=runs/doc/variants/pre train.objective=dpo train.dpo.beta=0.1 train.lr=0.003 \
      stages.0.steps=16 > /dev/null
  python - "$out-dpo/metrics.jsonl" "$seed" "$bytes" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[:4], rows[-4:]
right = sum(r["reward_accuracy"] * r["pairs"] for r in last) / sum(r["pairs"] for r in last)
margin = lambda rs: sum(r["reward_margin"] for r in rs) / len(rs)
new = right >= 0.75 and margin(last) > max(margin(first), 0)
old = min(r["reward_accuracy"] for r in last) >= 0.9
print(f"seed {sys.argv[2]} bytes {sys.argv[3]}: pairs/step {last[0]['pairs']:.0f}, last 4 "
      f"steps {[round(r['reward_accuracy'], 3) for r in last]}, pooled {right:.3f}, margin "
      f"first 4 {margin(first):.3f} last 4 {margin(last):.3f}; docs check "
      f"{'passes' if new else 'FAILS'}, per-step min >= 0.9 {'passes' if old else 'FAILS'}")
PY
done
