"""C4's line cleaning, judged a paragraph at a time: which lines of a `web` document are kept.

C4 (Raffel et al. 2020) drops every line without terminal punctuation, with fewer than
`c4_min_words_per_line` words, mentioning javascript, or with cookie/terms/privacy
boilerplate. Applied to single lines of hard-wrapped text (man pages, HTML that keeps its
source line breaks, wrapped .md/.txt) that drops every line but the last of each paragraph
and leaves fragments. So the rules judge paragraphs instead:

1. Wrap width: W = the 90th percentile of the lengths of the document's non-blank lines.
2. A line continues into the next one (the two wrap one paragraph) when it has no terminal
   punctuation, the next line is not blank, and the next line's first word would not have
   fitted on it: len(line) + 1 + len(next first word) > W. That is how text is wrapped, and
   a navigation or footer line (short, never near the wrap width) continues nothing.
3. Each paragraph is judged as one line would be: its last line's punctuation, the words of
   all its lines, any mention of javascript or a policy phrase. Every line of a paragraph
   is kept or dropped with it, each dropped line naming its rule (`explain`).
4. Document rules on what survives: a word over `c4_max_word_length`, lorem ipsum (searched
   only in the kept text, so a page that quotes it in a dropped line is not removed; this
   is also where datatrove's C4 filter looks), and fewer than `c4_min_sentences` sentences.
On text whose lines are its paragraphs (the crawl case) every paragraph is one line and the
decisions are C4's (the tests hold them to datatrove's C4 filter), but for a line as long
as the wrap width without terminal punctuation: it is judged with the line after it.

Kept lines keep their indentation and the blank lines between kept paragraphs stay, so the
paragraph boundaries the packer cuts at survive cleaning.
"""

import re

TERMINAL = (".", "!", "?", '"', "'")
POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
          "use cookies")
CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)")
LINE_RULES = ("c4_no_terminal", "c4_min_words", "c4_javascript", "c4_policy")


def wrap_width(lines):
  """The 90th percentile of the non-blank lines' lengths (0 for a blank text)."""
  lengths = sorted(len(line) for line in lines if line.strip())
  return lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))] if lengths else 0


def paragraphs(lines):
  """[(first, last)] line numbers of each paragraph of non-blank lines (step 2 above)."""
  width = wrap_width(lines)
  out, start = [], None
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    if start is None:
      start = i
    nxt = lines[i + 1] if i + 1 < len(lines) else ""
    words = nxt.split()
    wraps = (words and not line.rstrip().endswith(TERMINAL)
             and len(line.rstrip()) + 1 + len(words[0]) > width)
    if not wraps:
      out.append((start, i))
      start = None
  return out


def _judge(text, t):
  """The rule that drops a paragraph's text (its lines joined by spaces), or None."""
  if not text.endswith(TERMINAL):
    return "c4_no_terminal"
  if len(text.split()) < t.c4_min_words_per_line:
    return "c4_min_words"
  low = text.lower()
  if "javascript" in low:
    return "c4_javascript"
  if any(p in low for p in POLICY):
    return "c4_policy"
  return None


def explain(text, t):
  """([(line, rule or None)] for every line of the text (blank lines None), the document
  rule or None). A line's text is as kept: citations removed, trailing space trimmed."""
  lines = [line.rstrip() for line in CITATION.sub("", text).split("\n")]
  verdicts = [None] * len(lines)
  kept = []
  for first, last in paragraphs(lines):
    rule = _judge(" ".join(line.strip() for line in lines[first:last + 1]), t)
    for i in range(first, last + 1):
      verdicts[i] = rule
    if rule is None:
      kept.append((first, last))
  doc_rule, sentences = None, 0
  for first, last in kept:
    joined = " ".join(line.strip() for line in lines[first:last + 1])
    if any(len(w) > t.c4_max_word_length for w in joined.split()):
      doc_rule = "c4_max_word_length"
      break
    if "lorem ipsum" in joined.lower():
      doc_rule = "c4_lorem_ipsum"
      break
    sentences += len(SENTENCE_END.findall(joined))
  if doc_rule is None and sentences < t.c4_min_sentences:
    doc_rule = "c4_min_sentences"
  return list(zip(lines, verdicts)), doc_rule, kept


def clean(text, t):
  """(cleaned text, None, {rule: bytes of the lines it dropped}) or (None, rule, None)."""
  judged, doc_rule, kept = explain(text, t)
  if doc_rule:
    return None, doc_rule, None
  out, previous = [], None
  for first, last in kept:
    if previous is not None and any(not judged[i][0].strip()
                                    for i in range(previous + 1, first)):
      out.append("")  # the source had a blank line between these paragraphs
    out.extend(judged[i][0] for i in range(first, last + 1))
    previous = last
  dropped = {}
  for line, rule in judged:
    if rule is not None:
      dropped[rule] = dropped.get(rule, 0) + len(line.encode()) + 1
  return "\n".join(out), None, dropped
