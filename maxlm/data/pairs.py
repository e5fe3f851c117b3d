"""Preference pairs and RL prompts: records -> stored documents -> the two segments of a pair.

A preference record is `{"prompt", "chosen", "rejected"}` (each a string or chat `messages`;
optional `id`, `source`). It is stored as ONE document, `prompt + chosen + rejected` back to
back, with `pair[doc] = (P, C)` in the index (P prompt tokens, C chosen tokens; (0, 0) for
every other document). The prompt is tokenized once, and both segments are cut from those same
tokens, so chosen and rejected share their prompt by construction. In a row the pair is two
adjacent segments, never split:

  [BOS] prompt chosen [EOS]      role 1 (chosen), segment id k
  [BOS] prompt rejected [EOS]    role 2 (rejected), segment id k + 1

with loss on the answer targets and their EOS only. The pair occupies 2P + C + R + 2 positions.

Chat pairs: the prompt is rendered like a chat document (each turn `<|role|>\\n content
<|end|>`) followed by `<|assistant|>\\n`, which is prompt; an answer is its text (or, given as
messages, its assistant turns' text) followed by `<|end|>`.

Over-long pairs (prepare's `max_pair_len` positions): the prompt is truncated from its LEFT
(its end, next to the answer, is kept), counted in the manifest's `truncated_pairs`; a pair
whose answers do not fit with at least one prompt token each is rejected as `over_long_pair`.
Other rejects: `missing_field` (no prompt/chosen/rejected, or a value of the wrong type, or an
empty prompt), `empty_answer`, `identical_answers`.

An RL prompt record is `{"prompt", "gold"}` (gold a string or a number): it is not a training
document; prepare writes the valid ones to the data dir's `prompts.jsonl` for `maxlm generate
--prompts` (rejects: `missing_field`, `empty_answer` for an empty gold).
"""

import numpy as np

from maxlm.data import tokenizer

NONE, CHOSEN, REJECTED = 0, 1, 2  # the `roles` field of a batch
REASONS = ("missing_field", "empty_answer", "identical_answers", "over_long_pair")
MAX_PAIR_LEN = 1024


def is_pair(record):
  """A record with `chosen` or `rejected` is a pair (and checked as one), whatever else it has."""
  return isinstance(record, dict) and ("chosen" in record or "rejected" in record)


def is_prompt(record):
  """A record with `gold` and neither `text` nor `messages` (a document may carry a gold)."""
  return (isinstance(record, dict) and "gold" in record and not is_pair(record)
          and "text" not in record and "messages" not in record)


def _valid(value):
  if isinstance(value, str):
    return True
  return (isinstance(value, list) and bool(value) and all(
      isinstance(m, dict) and m.get("role") in tokenizer.ROLES
      and isinstance(m.get("content"), str) for m in value))


def answer_text(value):
  """An answer's text: the string, or the assistant turns' content (else every turn's)."""
  if isinstance(value, str):
    return value
  turns = [m["content"] for m in value if m["role"] == "assistant"] or [
      m["content"] for m in value]
  return "\n".join(turns)


def prompt_text(value):
  if isinstance(value, str):
    return value
  return "\n".join(m["content"] for m in value)


def parse_pair(record):
  """(fields, None) or (None, reason) for a preference record (a dict)."""
  if not all(k in record and _valid(record[k]) for k in ("prompt", "chosen", "rejected")):
    return None, "missing_field"
  if not prompt_text(record["prompt"]).strip():
    return None, "missing_field"
  chosen, rejected = answer_text(record["chosen"]), answer_text(record["rejected"])
  if not chosen.strip() or not rejected.strip():
    return None, "empty_answer"
  if chosen == rejected:
    return None, "identical_answers"
  chat = any(not isinstance(record[k], str) for k in ("prompt", "chosen", "rejected"))
  return {"kind": "pair", "prompt": record["prompt"], "chosen": chosen, "rejected": rejected,
          "chat": chat}, None


def parse_prompt(record):
  """(fields, None) or (None, reason) for an RL prompt record `{"prompt", "gold"}`."""
  prompt, gold = record.get("prompt"), record.get("gold")
  if not _valid(prompt) or not prompt_text(prompt).strip() or isinstance(gold, bool) or not (
      isinstance(gold, (str, int, float))):
    return None, "missing_field"
  if not str(gold).strip():
    return None, "empty_answer"
  return {"kind": "prompt", "prompt": prompt, "gold": str(gold)}, None


def texts(doc):
  """The strings of a pair document (for the tokenizer trainer and the quality steps)."""
  return [prompt_text(doc["prompt"]), doc["chosen"], doc["rejected"]]


def encode(sp, doc, max_len=MAX_PAIR_LEN):
  """(tokens, (P, C), truncated) of a pair document, or (None, reason, False)."""
  prompt = prompt_ids(sp, doc["prompt"], doc["chat"])
  end = [sp.piece_to_id(tokenizer.CHAT_END)] if doc["chat"] else []
  chosen, rejected = sp.encode(doc["chosen"]) + end, sp.encode(doc["rejected"]) + end
  keep = (max_len - len(chosen) - len(rejected) - 2) // 2
  if keep < 1:
    return None, "over_long_pair", False
  truncated = keep < len(prompt)
  prompt = prompt[len(prompt) - min(keep, len(prompt)):]
  tokens = np.array(prompt + chosen + rejected, np.int32)
  return tokens, (len(prompt), len(chosen)), truncated


def prompt_ids(sp, prompt, chat):
  """A prompt's tokens (no BOS): the text, or (chat) its turns and the assistant header."""
  if not chat:
    return sp.encode(prompt)
  messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
  ids = []
  for m in messages:
    ids += [sp.piece_to_id(f"<|{m['role']}|>")] + sp.encode("\n") + sp.encode(
        m["content"]) + [sp.piece_to_id(tokenizer.CHAT_END)]
  return ids + [sp.piece_to_id("<|assistant|>")] + sp.encode("\n")


def positions(n, p):
  """Row positions of a pair document of n tokens with a p-token prompt."""
  return n + p + 2


def segments(tokens, p, c, special):
  """[(segment, weight, role)] of a pair: weight[i] says whether target segment[i] counts."""
  prompt, answers = tokens[:p], (tokens[p:p + c], tokens[p + c:])
  out = []
  for role, answer in zip((CHOSEN, REJECTED), answers):
    seg = np.concatenate([[special.bos], prompt, answer, [special.eos]]).astype(np.int32)
    weight = np.zeros(len(seg), np.int32)
    weight[1 + p:] = 1
    out.append((seg, weight, role))
  return out
