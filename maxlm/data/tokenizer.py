"""SentencePiece tokenizer: training with maxlm's special ids, loading, and exact round trips.

Ids 0..3 are pad, bos, eos, unk; then the FIM markers and the chat role and end markers as
control symbols (inserted by id only: text that spells "<|end|>" never becomes the marker), and
the newline as one token. Training keeps text verbatim (identity normalisation, no dummy prefix,
whitespace kept, byte fallback), so decode(encode(text)) == text for any UTF-8 text, and texts
encoded in consecutive blocks decode to their concatenation.
"""

import dataclasses
import io as _io
import re

import sentencepiece as spm

PAD, BOS, EOS, UNK = 0, 1, 2, 3
FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"
ROLES = ("system", "user", "assistant")
CHAT_END = "<|end|>"
CONTROL_SYMBOLS = (FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, *(f"<|{r}|>" for r in ROLES), CHAT_END)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  pad: int
  bos: int
  eos: int
  fim_prefix: int
  fim_middle: int
  fim_suffix: int
  chat_end: int
  roles: dict


def train(sentences, vocab_size, num_threads=2):
  """Trains a BPE model on an iterator of strings and returns its serialized proto."""
  model = _io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_writer=model, model_type="bpe",
      vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995,
      normalization_rule_name="identity", add_dummy_prefix=False,
      remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
      split_by_whitespace=True, max_sentence_length=16384, input_sentence_size=2_000_000,
      shuffle_input_sentence=True, pad_id=PAD, bos_id=BOS, eos_id=EOS, unk_id=UNK,
      control_symbols=list(CONTROL_SYMBOLS), user_defined_symbols=["\n"], num_threads=num_threads,
      train_extremely_large_corpus=False, minloglevel=2)
  return model.getvalue()


def training_failure(error, vocab_size):
  """One line for a SentencePiece training error, with the --vocab-size that would fit."""
  text = str(error).strip()
  most = re.search(r"Vocabulary size too high .*<= (\d+)", text)
  if most:
    return (f"tokenizer training failed: this corpus supports at most --vocab-size {most[1]} "
            f"(asked for {vocab_size}); pass --vocab-size {most[1]} or less, or more text")
  least = re.search(r"smaller than required_chars\. \d+ vs (\d+)", text)
  if least:
    return (f"tokenizer training failed: this corpus needs --vocab-size >= {least[1]} for its "
            f"distinct characters and the special pieces (asked for {vocab_size}); pass "
            f"--vocab-size {least[1]} or more")
  return f"tokenizer training failed: {text.splitlines()[-1] if text else type(error).__name__}"


def load(model_proto):
  return spm.SentencePieceProcessor(model_proto=model_proto)


def special_ids(sp):
  ids = {s: sp.piece_to_id(s) for s in CONTROL_SYMBOLS}
  for s, i in ids.items():
    if i == sp.unk_id():
      raise ValueError(f"tokenizer lacks the special piece {s!r}; train it with maxlm prepare")
  return SpecialIds(
      pad=sp.pad_id(), bos=sp.bos_id(), eos=sp.eos_id(), fim_prefix=ids[FIM_PREFIX],
      fim_middle=ids[FIM_MIDDLE], fim_suffix=ids[FIM_SUFFIX], chat_end=ids[CHAT_END],
      roles={r: ids[f"<|{r}|>"] for r in ROLES})


# The ids `train` assigns; data made without a tokenizer (tests, benchmarks) uses these.
DEFAULT_SPECIAL = SpecialIds(pad=PAD, bos=BOS, eos=EOS, fim_prefix=4, fim_middle=5, fim_suffix=6,
                             chat_end=10, roles={"system": 7, "user": 8, "assistant": 9})
