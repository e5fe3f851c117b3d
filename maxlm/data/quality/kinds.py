"""What a document is (`web`, `prose`, `code`, `chat`), and so which quality steps it gets.

A document's kind comes from the first of these that says something:
  1. flag      `--kind SOURCE=KIND` (repeatable), or a `kinds:` map in `--quality FILE.yaml`
  2. record    a JSON Lines record's own `kind` field
  3. path      a record's `path`, `filename`, `max_stars_repo_path` or `id` ending in a code
               suffix (`.py`, `.c`, ... as sections.CODE_SUFFIXES), or a `lang`/`language`
               field naming a programming language (`python`, `C++`, ...)
  4. suffix    the file's suffix: `.txt .md .markdown .rst .text` (and README, LICENSE,
               METADATA, --as-text files) are `prose`, code suffixes `code`
  5. content   a JSON Lines text record with no hint that is obviously source code
               (`looks_like_code`) is `code`; manifest.json counts these per source
               (`funnel.sources.NAME.kinds_from.content`) with example ids
  6. default   any other JSON Lines text record is `web` (the crawl case); chat `messages`
               are `chat`
The steps each kind gets (the package docstring has the table): `web` language, lines,
quality, repetition; `prose` language, quality, repetition (no line is deleted); `code` the
code rules only (never language ID, never line cleaning); `chat` language. Dedup for all.
"""

import ast
import os
import re

from maxlm import MaxlmError
from maxlm.data.sections import CODE_SUFFIXES

KINDS = ("web", "prose", "code", "chat")
PATH_FIELDS = ("path", "filename", "max_stars_repo_path", "id")
LANG_FIELDS = ("lang", "language")
PROGRAMMING = frozenset("""python py c c++ cpp c# csharp java javascript js typescript ts go
    golang rust rs ruby rb php perl shell bash sh zsh powershell lua scala kotlin swift
    objective-c haskell r julia sql html css scss makefile cmake dockerfile yaml toml json
    fortran assembly dart elixir erlang clojure ocaml f# visual-basic vb matlab groovy
    cuda verilog vhdl tex latex jupyter-notebook""".split())

_STRONG_PY = re.compile(r"^[ \t]*(?:def |class |import |from [\w.]+ import |@\w)", re.M)
_CODE_LINE = re.compile(
    r"^[ \t]*(?:(?:def|class|import|return|elif|except|raise|yield|await|async|package|func|fn|"
    r"let|const|var|public|private|protected|static|void|using|namespace|function|struct|"
    r"impl|enum|typedef|template|module|require|include|pass|break|continue|assert|del|"
    r"self|this|end|fi|done|esac|echo)\b"
    r"|(?:if|for|while|with|switch|case)\b.*[:{)][ \t]*$"
    r"|[\w.]+\(.*\)[ \t]*;?[ \t]*$|[)\]}]+[,;]?[ \t]*$|@\w"
    r"|#[ \t]*(?:include|define|if|ifdef|ifndef|endif|pragma)\b|//|/\*|\*/|[{}]"
    r"|[\w.\[\]\"']+[ \t]*(?:[-+*/%|&^]|<<|>>)?=[ \t]*\S"
    r"|.*(?:[;{}]|\)\s*:|\b(?:else|try|finally)\s*:)[ \t]*$)", re.M)
_LONGEST = 200  # characters: a longer line is not counted as a code line


def check(kind, where):
  if kind not in KINDS:
    raise MaxlmError(f"{where}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
  return kind


def parse_flags(items):
  """{source: kind} from `--kind SOURCE=KIND` items."""
  out = {}
  for item in items or ():
    source, sep, kind = item.rpartition("=")
    if not sep or not source:
      raise MaxlmError(f"--kind {item!r}: expected SOURCE=KIND, e.g. docs=prose")
    out[source] = check(kind.strip(), f"--kind {item!r}")
  return out


def of_record(record):
  """(kind, from) of a JSON Lines text record's hints (steps 2 and 3), or (None, None)."""
  kind = record.get("kind")
  if isinstance(kind, str) and kind in KINDS and kind != "chat":
    return kind, "record"
  for field in PATH_FIELDS:
    value = record.get(field)
    if isinstance(value, str) and os.path.splitext(value)[1].lower() in CODE_SUFFIXES:
      return "code", "path"
  for field in LANG_FIELDS:
    value = record.get(field)
    if isinstance(value, str) and value.strip().lower() in PROGRAMMING:
      return "code", "path"
  return None, None


def looks_like_code(text):
  """Whether the text is obviously source code (step 5): at least half its non-blank lines
  (and at least 5), outside markdown code fences, look like code (a statement keyword, an
  assignment, a call alone on its line, braces or a semicolon at the end, C preprocessor,
  // and /* comments), or it is Python that parses with two or more definitions, imports or
  assignments (for modules that are mostly docstrings and comments)."""
  nonblank = code = 0
  fenced = False
  for line in text[:100_000].split("\n"):
    if line.lstrip().startswith(("```", "~~~")):
      fenced = not fenced
    elif line.strip() and not fenced:
      nonblank += 1
      code += len(line) <= _LONGEST and bool(_CODE_LINE.match(line))  # a long line is prose
  if code >= 5 and code >= 0.5 * nonblank:
    return True
  return len(_STRONG_PY.findall(text, 0, 20_000)) >= 2 and _parses_as_python(text)


def _parses_as_python(text):
  try:
    module = ast.parse(text)
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return False
  real = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom,
          ast.Assign, ast.AnnAssign)
  return sum(isinstance(node, real) for node in module.body) >= 2
