"""The test suite's own shape: no module of tests/ imports a test module. A helper or fixture that
two test files share lives in tests/conftest.py (fixtures) or in a helper module that is not a
test module (tests/smallrun.py, tests/attncases.py, tests/planted.py, tests/datagen.py, ...), so
that a test file can be run, renamed or removed alone, and importing one never runs another's
module-level code or collects its tests twice."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def imported_test_modules(path):
  """[(line, module)] for each import in the file (at any depth, `import x`, `from x import y`,
  `import x as y`) whose top-level module is a test module of the same folder."""
  tree = ast.parse(path.read_text(), str(path))
  local_tests = {p.stem for p in path.parent.glob("test_*.py")}
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module]
    else:
      continue
    found += [(node.lineno, name) for name in names if name.split(".")[0] in local_tests]
  return found


def test_no_module_of_tests_imports_a_test_module():
  offenders = [f"{path.name}:{line} imports {name}" for path in sorted(TESTS.glob("*.py"))
               for line, name in imported_test_modules(path)]
  assert not offenders, ("move what is shared into tests/conftest.py (a fixture) or a helper "
                         "module that is not named test_*: " + "; ".join(offenders))


def test_the_check_sees_each_form_of_import(tmp_path):
  (tmp_path / "test_a.py").write_text("def helper():\n  pass\n")
  (tmp_path / "helper.py").write_text("X = 1\n")
  (tmp_path / "test_b.py").write_text(
      "import os\nimport helper\nfrom helper import X\n"
      "from test_a import helper\nimport test_a as a\n"
      "def test_x():\n  import test_a.sub\n")
  assert imported_test_modules(tmp_path / "test_b.py") == [
      (4, "test_a"), (5, "test_a"), (7, "test_a.sub")]
  assert imported_test_modules(tmp_path / "helper.py") == []
