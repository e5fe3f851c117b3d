"""The data-quality half of `maxlm prepare`: what is removed before tokenizing, and why.

Every document has a kind (`kinds.py` says where it comes from: `--kind SOURCE=KIND`, a
record's `kind`, a path or `lang` field, the file's suffix, a content check, else `web`),
and the kind decides its steps:

  kind    language  lines  quality  repetition  code  exact_dup  near_dup
  web        x        x       x         x                 x          x
  prose      x                x         x                 x          x
  code                                              x     x          x
  chat       x                                            x          x
  (preference pairs and RL prompts: language, dedup; pairs also `over_long` at tokenizing)

The steps, in order; the first that removes a document names its step and rule, which the
funnel counts (documents, bytes, tokens, per source) and `--rejected FILE.jsonl` lists:
  1. language     the text must be in one of the accepted languages (`lang.py`), with
                  probability >= `lang_min_score`. The probability is kept in the doc index
                  (`lang_score`).
  2. lines        C4 line cleaning, a paragraph at a time (`lines.py`: the lines that wrap one
                  paragraph are judged together, so hard-wrapped text is not cut into
                  fragments); boilerplate goes first, so a footer shared by a site's pages
                  cannot get whole pages dropped by step 4; a document with too little left
                  is removed here.
  3. quality      Gopher's document rules (on the cleaned text of `web`).
  4. repetition   Gopher's repetition rules.
  5. code         code documents get code rules instead of 1-4.
  6. exact_dup    the same normalized text as an earlier kept document.
  7. near_dup     a MinHash/LSH near-duplicate of an earlier kept document (`minhash.py`):
                  a shared band (16 x 8 by default) and an estimated Jaccard >= 0.7.
  8. over_long    (preference pairs, at tokenizing) answers that do not fit --max-pair-len.
Steps 1-5 and the signatures run per document in prepare's worker processes; steps 6-7 are
decided in one streaming pass in input order, so the first document of every cluster survives
and the result is the same for any number of workers. Dedup runs across all sources. The
validation split is drawn afterwards from what was kept, so no validation document is a
near-duplicate of a training document. Documents rejected before these steps (`empty`,
`bad_unicode`, ...) are listed by `--rejected` too, under step `input`.
"""

import dataclasses
import difflib
import math

from maxlm.data import pairs
from maxlm.data.quality import kinds as kinds_lib, lang, lines, minhash, prose, rules
from maxlm.typed_yaml import ConfigError, apply_override, build, read_yaml

MAX_PERM = 4096  # MinHash functions: memory and time grow with them, 128 is the usual
STEPS = ("language", "lines", "quality", "repetition", "code", "exact_dup", "near_dup",
         "over_long")


@dataclasses.dataclass(frozen=True)
class QualityConfig:
  """What `maxlm prepare` filters; a YAML file (`--quality FILE`) and `--filter KEY=VALUE`."""
  lang: tuple[str, ...] = ("en",)  # accepted language codes; ("any",) skips language ID
  lang_by_source: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  kinds: dict[str, str] = dataclasses.field(default_factory=dict)  # source -> web|prose|code|chat
  lang_min_score: float = 0.5  # in [0, 1]
  filters: bool = True  # steps 2-5
  dedup: bool = True  # steps 6-7
  shingle_words: int = 5  # >= 1
  num_perm: int = 128  # in [1, 4096]: MinHash functions (each costs 8 bytes a kept document)
  bands: int = 16  # >= 1; bands x rows <= num_perm
  rows: int = 8  # >= 1
  near_threshold: float = 0.7  # in [0, 1]: estimated Jaccard a band collision must reach
  thresholds: rules.Thresholds = rules.Thresholds()

  def check(self):
    for key, named in (("kinds", self.kinds), ("lang_by_source", self.lang_by_source)):
      if any(not source.strip() for source in named):
        raise ConfigError(f"{key}: a source name is empty; name a source, e.g. {key}.docs")
    for source, kind in self.kinds.items():
      kinds_lib.check(kind, f"kinds.{source}")
    known = None
    for key, codes in [("lang", self.lang)] + [(f"lang_by_source.{s}", c)
                                               for s, c in self.lang_by_source.items()]:
      if not codes:
        raise ConfigError(f"{key}: expected language codes (e.g. [en]) or [any], got []")
      if "any" in codes:
        continue
      known = known or lang.known()
      unknown = [c for c in codes if c not in known]
      if unknown:
        raise ConfigError(f"{key}: unknown language code {unknown[0]!r}; use ISO 639-1 codes "
                          f"in lower case, e.g. en, de, fr, zh (any skips language ID)")
    for name in ("lang_min_score", "near_threshold"):
      if not 0 <= getattr(self, name) <= 1:
        raise ConfigError(f"{name}: expected a number in [0, 1], got {getattr(self, name)}")
    for name in ("shingle_words", "num_perm", "bands", "rows"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
    if self.num_perm > MAX_PERM:
      raise ConfigError(f"num_perm: expected an integer in [1, {MAX_PERM}], got {self.num_perm}")
    if self.bands * self.rows > self.num_perm:
      raise ConfigError(f"bands x rows = {self.bands * self.rows} must be <= num_perm "
                        f"({self.num_perm})")
    for field in dataclasses.fields(self.thresholds):
      value = getattr(self.thresholds, field.name)
      low, high, low_excluded = rules.threshold_range(field.name)
      if (not value >= low or low_excluded and value == low or high is not None and value > high
          or isinstance(value, float) and math.isinf(value)):
        raise ConfigError(f"thresholds.{field.name}: expected a finite number "
                          f"{rules.range_text(low, high, low_excluded)}, got {value}")

  def langs_for(self, source):
    return self.lang_by_source.get(source, self.lang)

  def threshold_J(self):
    """The Jaccard similarity at which a pair becomes a candidate with probability 1/2."""
    return (1 - 0.5 ** (1 / self.bands)) ** (1 / self.rows)


OFF = QualityConfig(lang=("any",), filters=False, dedup=False)


def load(path=None, overrides=()):
  """A QualityConfig from an optional YAML file and `key=value` overrides (a bare threshold
  name such as `gopher_min_words=20` is found under `thresholds`)."""
  raw = read_yaml(path) if path else {}
  names = {f.name for f in dataclasses.fields(rules.Thresholds)}
  top = {f.name for f in dataclasses.fields(QualityConfig)}
  for item in overrides:
    key = item.partition("=")[0]
    if key.split(".")[0] not in top | names:
      near = difflib.get_close_matches(key, sorted(top | names), n=1)
      hint = f"did you mean {near[0]!r}? " if near else ""
      raise ConfigError(f"--filter {item!r}: unknown key {key!r}; {hint}see docs/data.md")
    apply_override(raw, f"thresholds.{item}" if key in names else item)
  config = build(QualityConfig, raw)
  config.check()
  return config


class Inspector:
  """Steps 1-5 and the dedup keys of one document (picklable; run in worker processes)."""

  def __init__(self, config):
    self.config = config
    self.perms = minhash.permutations(config.num_perm) if config.dedup else None
    self.bander = minhash.Bander(config.bands, config.rows) if config.dedup else None

  def kind_of(self, doc):
    """(kind, where it came from): --kind/`kinds:` first, then the document's own, refined
    by the content check for a JSON Lines text record that gave no hint."""
    forced = self.config.kinds.get(doc["source"])
    if forced and doc["kind"] not in ("pair", "prompt"):
      if forced == "chat" and doc["kind"] != "chat" or doc["kind"] == "chat" != forced:
        return doc["kind"], doc.get("kind_from", "record")  # chat is a record's shape
      return forced, "flag"
    kind_from = doc.get("kind_from", "record")
    if kind_from == "default" and doc["kind"] == "web" and kinds_lib.looks_like_code(doc["text"]):
      return "code", "content"
    return doc["kind"], kind_from

  def __call__(self, doc):
    """The document (text cleaned, kind resolved) with `verdict`: {step, rule, kind,
    kind_from, lang, lang_score, exact, sig, bands, nbytes_in, nchars_in, and nbytes_out,
    nchars_out, line_bytes ({rule: bytes}) once line cleaning ran}; step None means it passed
    steps 1-5."""
    kind, kind_from = self.kind_of(doc)
    doc = {**doc, "kind": kind}
    doc.pop("kind_from", None)
    texts = ([m["content"] for m in doc["messages"]] if kind == "chat" else
             pairs.texts(doc) if kind == "pair" else
             [pairs.prompt_text(doc["prompt"])] if kind == "prompt" else [doc["text"]])
    whole = "\n".join(texts)
    verdict = {"step": None, "rule": None, "kind": kind, "kind_from": kind_from, "lang": None,
               "lang_score": float("nan"), "exact": 0, "sig": None, "bands": None,
               "nbytes_in": len(whole.encode()), "nchars_in": len(whole)}
    doc["verdict"] = verdict
    accepted = self.config.langs_for(doc["source"])
    judged, literal = prose.split(whole) if kind == "prose" else (whole, "")
    if self.config.filters and literal.strip():
      rule = prose.literal_rule(literal, self.config.thresholds)
      if rule:
        verdict.update(step="quality", rule=rule)
        return doc
    if kind == "prose" and rules.word_count(judged) < self.config.thresholds.gopher_min_words:
      return self._dedup_keys(doc, whole)  # too short to judge (prose.py says why)
    if kind != "code" and "any" not in accepted:
      verdict["lang"], verdict["lang_score"] = lang.identify(judged)
      if verdict["lang"] not in accepted:
        verdict.update(step="language", rule=f"lang_{verdict['lang']}")
        return doc
      if verdict["lang_score"] < self.config.lang_min_score:
        verdict.update(step="language", rule="lang_min_score")
        return doc
    if self.config.filters and kind in ("web", "prose", "code"):
      rule, step = self._filters(doc, verdict, judged)
      if rule:
        verdict.update(step=step, rule=rule)
        return doc
      whole = doc["text"]
    return self._dedup_keys(doc, whole)

  def _dedup_keys(self, doc, whole):
    verdict = doc["verdict"]
    if self.config.dedup:
      normalized = minhash.normalize(whole, doc["kind"])
      verdict["exact"] = minhash.exact_key(normalized)
      sig = minhash.signature(minhash.shingles(normalized, self.config.shingle_words),
                              self.perms)
      verdict["sig"], verdict["bands"] = sig, self.bander.keys(sig)
    return doc

  def _filters(self, doc, verdict, judged):
    """(rule, step) of the first of steps 2-5 that removes the document, or (None, ...);
    `judged` is the text the prose rules see (a prose document's prose, prose.py)."""
    t = self.config.thresholds
    if doc["kind"] == "code":
      return rules.code_rules(doc["text"], t), "code"
    text = judged
    if doc["kind"] == "web":
      cleaned, rule, dropped = lines.clean(text, t)
      if rule:
        return rule, "lines"
      doc["text"] = text = cleaned
      verdict.update(nbytes_out=len(cleaned.encode()), nchars_out=len(cleaned),
                     line_bytes=dropped)
    rule = rules.gopher_quality(text, t)
    if rule:
      return rule, "quality"
    if doc["kind"] == "prose":
      t = prose.repetition_thresholds(t)
    return rules.gopher_repetition(text, t), "repetition"
