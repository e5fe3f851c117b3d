"""Verifiable answers: `maxlm generate RUN_DIR --prompts FILE.jsonl --verify exact|numeric`.

Each line of FILE is `{"prompt", "gold"}` (optional `id`, `source`; a prompt is a string or chat
`messages`); `maxlm prepare` writes the valid ones of its inputs to DATA_DIR/prompts.jsonl, and
either file works here. A bad line is counted by reason (pairs.parse_prompt's, and
invalid_unicode for a lone surrogate escape), never fatal; `maxlm generate` prints the counts.

The answer-extraction rule, applied to the sampled text (cut at the first EOS or `<|end|>`):
  1. if it holds `<answer>...</answer>` blocks, the answer is the LAST block's content;
  2. else, with --verify numeric, the LAST number in the text (`-12`, `3.5`, `1,234`, `2e3`);
     with --verify exact, the text's first non-empty line.
Matching: exact compares after stripping and collapsing whitespace (case-sensitive); numeric
compares as numbers (commas dropped) within a relative 1e-6, and a non-number never matches.

Scores over prompts: pass@1 and pass@N with N = --samples, by the unbiased estimator
1 - C(n - c, k) / C(n, k) of n samples with c correct (Chen et al. 2021); pass@1 is then the
mean fraction correct. This is the verifiable-reward signal a later RL stage needs.
"""

import json
import math
import re

from maxlm import MaxlmError
from maxlm.data import pairs

MODES = ("exact", "numeric")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def read_prompts(path):
  """([{id, source, prompt, gold}], {reason: count}) from a JSON Lines file."""
  try:
    raw = open(path, "rb").read()
  except OSError as e:
    raise MaxlmError(f"--prompts {path}: cannot be read ({e.strerror})") from None
  out, bad = [], {"malformed_json": 0, "missing_field": 0, "empty_answer": 0,
                  "invalid_unicode": 0}
  for number, line in enumerate(raw.splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
      bad["malformed_json"] += 1
      continue
    if not isinstance(record, dict):
      bad["malformed_json"] += 1
      continue
    fields, reason = pairs.parse_prompt(record)
    if fields is None:
      bad[reason] = bad.get(reason, 0) + 1
      continue
    try:  # a "\udcff" escape decodes to a lone surrogate, which no tokenizer takes
      json.dumps(fields, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
      bad["invalid_unicode"] += 1
      continue
    out.append({"id": str(record.get("id", f"{number}")), "source": record.get("source", ""),
                "prompt": fields["prompt"], "gold": fields["gold"]})
  if not out:
    raise MaxlmError(f"--prompts {path}: no usable {{\"prompt\", \"gold\"}} lines "
                     f"(rejected: {bad})")
  return out, bad


def extract(text, mode):
  """The final answer in `text` by the rule above (None when there is none)."""
  blocks = _ANSWER.findall(text)
  if blocks:
    return blocks[-1].strip()
  if mode == "numeric":
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  return lines[0] if lines else None


def _number(text):
  try:
    return float(text.replace(",", ""))
  except (AttributeError, ValueError):
    return None


def correct(answer, gold, mode):
  if answer is None:
    return False
  if mode == "exact":
    return " ".join(answer.split()) == " ".join(str(gold).split())
  a, g = _number(answer), _number(str(gold))
  return a is not None and g is not None and math.isclose(a, g, rel_tol=1e-6, abs_tol=1e-12)


def pass_at(n, c, k):
  """The unbiased pass@k of n samples with c correct."""
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(sample, prompts, mode, samples):
  """sample(prompt, i) -> the i-th sampled text. Returns {pass@1, pass@N, prompts: [...]}."""
  if mode not in MODES:
    raise MaxlmError(f"--verify must be one of {', '.join(MODES)}, got {mode!r}")
  rows = []
  for p in prompts:
    texts = [sample(p["prompt"], i) for i in range(samples)]
    answers = [extract(t, mode) for t in texts]
    ok = [correct(a, p["gold"], mode) for a in answers]
    rows.append({"id": p["id"], "gold": p["gold"], "answers": answers, "correct": sum(ok),
                 "samples": texts})
  n = len(rows)
  return {"verify": mode, "samples": samples, "prompts": rows,
          "pass@1": sum(pass_at(samples, r["correct"], 1) for r in rows) / n,
          f"pass@{samples}": sum(pass_at(samples, r["correct"], samples) for r in rows) / n}


def format_result(result):
  lines = [f"{r['id']}: gold {r['gold']!r}, answers {r['answers']!r} "
           f"({r['correct']}/{result['samples']} correct)" for r in result["prompts"]]
  n = result["samples"]
  lines.append(f"pass@1 {result['pass@1']:.3f}" + (f"  pass@{n} {result[f'pass@{n}']:.3f}"
                                                   if n > 1 else "")
               + f"  over {len(result['prompts'])} prompts (--verify {result['verify']})")
  return "\n".join(lines)
