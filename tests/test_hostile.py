"""The CLI under hostile inputs, run as a user runs it (`maxlm ...` in a subprocess on a tiny
trained run): every user-caused condition is one line and exit code 2, never an internal
error, and nothing is dropped or written elsewhere without a word. Each behaviour is seen at
least once from a real process; its further cases go through cli.main in this process (the
same parser, dispatch and error lines, without a fresh interpreter and JAX import each)."""

import json
import subprocess
import sys

import pytest
import yaml

from maxlm import cli, config as config_lib

MODEL = {"size": "tiny", "dtype": "float32", "remat": "none", "d_model": 32, "n_layers": 2,
         "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 64, "loss_chunk": 32}


def maxlm(*args):
  return subprocess.run([sys.executable, "-m", "maxlm.cli",
                         *(a if isinstance(a, bytes) else str(a) for a in args)],
                        capture_output=True, text=True, errors="replace")


def one_line_error(proc, *words):
  assert proc.returncode == 2, (proc.returncode, proc.stderr)
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "internal error" not in proc.stderr, proc.stderr
  for word in words:
    assert word in lines[0], lines[0]
  return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_data):
  """A run trained 4 steps at L = 32 (so it holds 32 positions), vocabulary 1024."""
  from maxlm.train import loop
  tmp = tmp_path_factory.mktemp("hostile")
  raw = {"seed": 0, "run_dir": str(tmp / "run"),
         "data": {"dir": str(demo_data), "mix": {"prose": 0.6, "code": 0.4}, "overlap": 4,
                  "shuffle_rows": 8, "block_rows": 64},
         "stages": [{"seq_len": 32, "batch": 8, "steps": 4}], "model": MODEL,
         "train": {"lr": 0.01, "warmup_steps": 1, "checkpoint_every": 2, "eval_every": 0}}
  (tmp / "cfg.yaml").write_text(yaml.safe_dump(raw))
  loop.train(config_lib.load(str(tmp / "cfg.yaml")), log=lambda *_: None)
  return tmp


def test_generate_refuses_settings_it_cannot_honour(run, here):
  """Checked before the run is opened: each is one line naming the option (the first from a
  process, the rest in this one)."""
  cases = ((["--temperature", "nan"], ("--temperature", "nan")),
           (["--temperature", "inf"], ("--temperature", "inf")),
           (["--temperature", "-0.5"], ("--temperature", "-0.5")),
           (["--seed", str(2**64)], ("--seed must be in [0, 2**64)",)),
           (["--seed", "-1"], ("--seed",)),
           (["--prompt", b"caf\xe9 au lait"], ("--prompt is not valid UTF-8",)),
           (["--prompt", "\udcff"], ("--prompt is not valid UTF-8",)))
  for i, (args, words) in enumerate(cases):
    if "--prompt" not in args:
      args = ["--prompt", "hi", *args]
    one_line_error((maxlm if i == 0 else here)("generate", run / "run", *args), *words)


def test_generate_refuses_what_the_model_cannot_hold(run, here):
  one_line_error(maxlm("generate", run / "run", "--prompt", "word " * 5000),
                 "more than the 32 positions this model holds: shorten it")
  one_line_error(here("generate", run / "run", "--prompt", "hi", "--max-tokens", "100000"),
                 "pass --max-tokens", "or less")
  one_line_error(here("generate", run / "run", "--prompt", "hi", "--top-k", "1025"),
                 "--top-k must be in [0, 1024]")
  ok = maxlm("generate", run / "run", "--prompt", "hi", "--top-k", "1024", "--max-tokens", "3",
             "--seed", str(2**64 - 1))
  assert ok.returncode == 0 and ok.stdout.startswith("hi"), ok.stderr


def test_generate_counts_every_prompt_line_it_does_not_use(run, here):
  lines = ['{"prompt": "1+1=", "gold": "2"}', "not json", '{"prompt": "\\udcff", "gold": "1"}',
           '{"prompt": "no gold"}', json.dumps({"prompt": "word " * 300, "gold": "1"}),
           '["a list"]']
  path = run / "prompts.jsonl"
  path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
  proc = maxlm("generate", run / "run", "--prompts", path, "--max-tokens", "4", "--json")
  assert proc.returncode == 0, proc.stderr
  assert ("lines not used: malformed_json 3, missing_field 1, invalid_unicode 1, too_long 1"
          in proc.stderr), proc.stderr
  result = json.loads(proc.stdout)
  assert len(result["prompts"]) == 1 and result["dropped"]["too_long"] == 1
  path.write_text(lines[4] + "\n")
  one_line_error(here("generate", run / "run", "--prompts", path),
                 "no usable prompt fits the model's 32 positions")


def test_outputs_are_the_file_named(run, tmp_path, here):
  """A suffix the writer would change or refuse is one line; nothing is written."""
  cfg = run / "cfg.yaml"
  for i, args in enumerate((["show-batch", cfg, "--out", tmp_path / "row.jpgg"],
                            ["show-batch", cfg, "--out", tmp_path / "row"],
                            ["batches", cfg, "--out", tmp_path / "b"])):
    one_line_error((maxlm if i == 0 else here)(*args), "give a file name ending in")
  one_line_error(here("funnel", run / "nope", "--png", tmp_path / "f"),
                 "--png", "ending in .png")
  assert list(tmp_path.iterdir()) == []


def test_os_errors_are_one_line_naming_the_path(run, tmp_path):
  (tmp_path / "afile").write_text("x")
  line = one_line_error(maxlm("batches", run / "cfg.yaml", "--out", tmp_path / "afile" / "b.npz"))
  assert "afile" in line and "errno" in line
  assert (tmp_path / "afile").read_text() == "x"


def test_os_error_line_reads_wrapped_errors():
  from safetensors import SafetensorError
  e = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
  assert cli.os_error_line(e).startswith("No space left on device (errno 28): SafetensorError")
  assert cli.os_error_line(OSError(30, "Read-only file system", "/x")) == (
      "Read-only file system (errno 30): /x; the file system is read-only: write elsewhere")
  assert cli.os_error_line(ValueError("a bug")) is None


def test_training_on_a_shard_changed_after_prepare_is_one_line(run, demo_data, tmp_path, here):
  """Same size, one bit: the manifest's sizes agree, the block digest does not (read in this
  process, and by forked workers in a process of its own)."""
  import shutil
  copy = tmp_path / "data"
  shutil.copytree(demo_data, copy)
  shard = copy / "tokens-00000.bin"
  data = bytearray(shard.read_bytes())
  data[len(data) // 2] ^= 1
  shard.write_bytes(bytes(data))
  for workers in (0, 2):
    proc = (here if workers == 0 else maxlm)("train", run / "cfg.yaml", f"data.dir={copy}",
                                             f"run_dir={tmp_path / 'run'}",
                                             f"data.workers={workers}")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "internal error" not in proc.stderr, proc.stderr
    assert "tokens-00000.bin block 0" in line and "does not match its XXH3-64" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (tmp_path / "run" / "checkpoints").iterdir())


def test_overrides_are_accepted_after_options(run, here):
  before = maxlm("ledger", run / "cfg.yaml", "stages.0.steps=2", "--json")
  after = here("ledger", run / "cfg.yaml", "--json", "stages.0.steps=2")
  assert before.returncode == after.returncode == 0, after.stderr
  assert json.loads(after.stdout) == json.loads(before.stdout)
  assert json.loads(after.stdout)["stages"][0]["rows"] == 16
  bad = maxlm("ledger", run / "cfg.yaml", "--json", "stages.0.steps=2", "--bogus")
  assert bad.returncode == 2 and bad.stderr.startswith(
      "maxlm ledger: error: unrecognized arguments: --bogus")  # the subcommand's, one line
  assert bad.stderr.count("\n") == 1
  bad = here("eval", run / "run", "--json", "x=1")  # no overrides there: still refused
  assert bad.returncode == 2 and "unrecognized arguments: x=1" in bad.stderr


def test_file_outputs_never_land_in_a_data_dir_or_checkpoints(run, demo_data, tmp_path, here):
  data = tmp_path / "data"
  import shutil
  shutil.copytree(demo_data, data)
  before = sorted((p.name, p.stat().st_size) for p in data.iterdir())
  cfg, ckpts = run / "cfg.yaml", run / "run" / "checkpoints"
  for i, (args, words) in enumerate((
      (["plot", run / "run", "--out", data / "tokenizer.model"], ("ending in .png",)),
      (["plot", run / "run", "--out", data / "x.png"], ("lies inside the data dir",)),
      (["plot", run / "run", "--out", f"{ckpts}/../checkpoints/2/x.png"],
       ("lies inside the checkpoints of the run dir",)),
      (["batches", cfg, f"data.dir={data}", "--out", data / "index.npz"],
       ("lies inside the data dir",)),
      (["show-batch", cfg, "--out", data / "row.png"], ("lies inside the data dir",)))):
    one_line_error((maxlm if i == 0 else here)(*args), *words)
  assert sorted((p.name, p.stat().st_size) for p in data.iterdir()) == before
  ok = here("plot", run / "run")  # the run dir's top level stays its own
  assert ok.returncode == 0 and (run / "run" / "curves.png").exists(), ok.stderr


def test_a_file_output_is_whole_or_absent(tmp_path):
  from maxlm import MaxlmError, outputs
  target = tmp_path / "b.npz"
  target.write_bytes(b"old")
  with pytest.raises(MaxlmError, match=r"cannot write .*b.npz: No space left on device "
                                       r"\(errno 28\)"):
    with outputs.writing(str(target)) as tmp:
      with open(tmp, "wb") as f:
        f.write(b"half")
      raise OSError(28, "No space left on device")
  assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["b.npz"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_data):
  """A few JSON Lines documents, a tokenizer, a quality file, a run dir; none may be written."""
  tmp = tmp_path_factory.mktemp("prepare_hostile")
  text = "The quick brown fox jumps over the lazy dog; 0123456789 times. "
  (tmp / "in.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": f"{text}{i}. " * 4})
                                        + "\n" for i in range(12)))
  (tmp / "t.model").write_bytes((demo_data / "tokenizer.model").read_bytes())
  (tmp / "q.yaml").write_text("lang: [any]\nfilters: false\ndedup: false\n")
  (tmp / "run").mkdir()
  (tmp / "run" / "config.yaml").write_text("seed: 0\n")
  (tmp / "run" / "metrics.jsonl").write_text("{}\n")
  return tmp


def _prepare(corpus, *flags, via=maxlm):
  return via("prepare", corpus / "in.jsonl", "--out", corpus / "out", "--tokenizer",
               corpus / "t.model", "--quality", corpus / "q.yaml", *flags)


def test_prepare_outputs_never_land_on_what_it_reads_or_on_data(corpus, demo_data, here):
  before = {p: p.read_bytes() for p in (corpus / "t.model", corpus / "q.yaml",
                                        demo_data / "tokenizer.model",
                                        corpus / "run" / "metrics.jsonl")}
  for target, words in ((corpus / "t.model", "is --tokenizer"), (corpus / "q.yaml", "is --quality"),
                        (demo_data / "tokenizer.model", "lies inside the data dir"),
                        (corpus / "run" / "metrics.jsonl", "lies inside the run dir")):
    for flag in ("--rejected", "--funnel-png"):
      first = target == corpus / "t.model" and flag == "--rejected"
      one_line_error(_prepare(corpus, flag, target, via=maxlm if first else here), flag, words)
  assert all(p.read_bytes() == data for p, data in before.items())
  assert not (corpus / "out").exists()


def test_prepare_values_out_of_range_are_one_line(corpus, here):
  cases = ((["--vocab-size", "99999999999"], "--vocab-size must be in [300, "),
           (["--vocab-size", "2000000"], "--vocab-size must be in [300, "),
           (["--lang", "=en"], "the source name is empty"),
           (["--kind", " =code"], "a source name is empty"),
           (["--filter", "gopher_max_bullet_lines=2"], "in [0, 1]"),
           (["--filter", "code_max_mean_line_length=0"], "> 0"))
  for i, (flags, words) in enumerate(cases):
    one_line_error(_prepare(corpus, *flags, via=maxlm if i == 0 else here), *words)
  assert not (corpus / "out").exists()


def test_prepare_names_a_lang_or_kind_source_that_does_not_exist(corpus):
  proc = _prepare(corpus, "--lang", "nosuch=de", "--kind", "in=prose")
  assert proc.returncode == 0, proc.stderr
  assert "warning: --lang nosuch=de: no source is named 'nosuch' (the sources: in)" in proc.stdout
  assert "--kind in=prose" not in proc.stdout
  proc = _prepare(corpus, "--lang", "nosuch=de", "--strict", "--overwrite")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(  # after the filter pass's progress
      "maxlm prepare: error: --strict: --lang nosuch=de: no source is named 'nosuch'")


def test_a_closed_pipe_ends_the_output_quietly(corpus):
  text = "The quick brown fox jumps over the lazy dog. " * 20000
  (corpus / "big.jsonl").write_text(json.dumps({"id": "big", "text": text}) + "\n")
  assert maxlm("prepare", corpus / "big.jsonl", "--out", corpus / "big", "--tokenizer",
               corpus / "t.model", "--quality", corpus / "q.yaml").returncode == 0
  show = subprocess.Popen([sys.executable, "-m", "maxlm.cli", "show-doc", corpus / "big", "big"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  assert show.stdout.read(10) == b"The quick "
  show.stdout.close()  # as `| head -c 10` does
  assert show.stderr.read() == b"" and show.wait() == 141  # as `cat`: 128 + SIGPIPE


def test_unknown_rules_keys_are_refused_with_a_hint():
  with pytest.raises(config_lib.ConfigError, match=r"unknown key 'rules.mpl'; did you mean "
                     r"'rules.mlp'"):
    config_lib.load("demo", ["rules.mpl=[tensor]"])
  assert config_lib.load("demo", ["rules.mlp=[tensor]"]).rules["mlp"] == ("tensor",)


def _listing(folder):
  return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


def test_a_run_dir_is_never_a_data_dir_or_inside_one(run, demo_data, tmp_path, here):
  """Refused before anything is written, the data dir's files as they were; a data dir inside
  the run dir (the demo's layout) is no reason to refuse."""
  import shutil
  data = tmp_path / "data"
  shutil.copytree(demo_data, data)
  before = _listing(data)
  cfg = run / "cfg.yaml"
  one_line_error(maxlm("train", cfg, f"data.dir={data}", f"run_dir={data}"),
                 f"run_dir {data} is the data dir {data}")
  one_line_error(here("train", cfg, f"data.dir={data}", f"run_dir={data}/runs/a"),
                 "lies inside the data dir", "run_dir=A_FOLDER_OUTSIDE_IT")
  assert _listing(data) == before
  holder = tmp_path / "holder"
  shutil.copytree(demo_data, holder / "data")
  ok = here("train", cfg, f"data.dir={holder / 'data'}", f"run_dir={holder}", "stages.0.steps=1")
  assert ok.returncode == 0 and (holder / "metrics.jsonl").exists(), ok.stderr


def test_outputs_never_land_inside_an_export(run, tmp_path, here):
  """A nested export, or any file output, would make the export hold a file it does not list;
  a run dir or data dir as --out was refused already."""
  from maxlm.interop import export
  exported = tmp_path / "hf"
  export.export(str(run / "run"), str(exported), log=lambda *_: None)
  before = _listing(exported)
  one_line_error(maxlm("export", run / "run", "--out", exported / "nested"),
                 "lies inside the export", str(exported))
  one_line_error(here("plot", run / "run", "--out", exported / "curves.png"),
                 "lies inside the export")
  one_line_error(here("export", run / "run", "--out", run / "run"), "is the run dir")
  one_line_error(here("export", run / "run", "--out", tmp_path / "hf" / ".." / "hf" / "x" / "y"),
                 "lies inside the export")
  assert _listing(exported) == before


def test_a_blank_source_name_is_refused(corpus, tmp_path, here):
  """A folder '   ', a file '   .txt' or '   .jsonl' (whose records take its stem) would name a
  source '   ': one line, no --out; a record's own blank "source" is counted as bad_source."""
  text = "The quick brown fox jumps over the lazy dog; 0123456789 times. " * 4
  (tmp_path / "   ").mkdir()
  (tmp_path / "   " / "a.txt").write_text(text)
  (tmp_path / "   .txt").write_text(text)
  (tmp_path / "deep").mkdir()
  (tmp_path / "deep" / "   .jsonl").write_text(json.dumps({"text": text}) + "\n")
  flags = ["--tokenizer", corpus / "t.model", "--quality", corpus / "q.yaml"]
  out = tmp_path / "out"
  one_line_error(maxlm("prepare", tmp_path / "   ", "--out", out, *flags),
                 "source name '   ' is blank")
  one_line_error(here("prepare", tmp_path / "   .txt", "--out", out, *flags), "'   ' is blank")
  deep = here("prepare", tmp_path / "deep", "--out", out, *flags)  # found by the walk: after
  assert deep.returncode == 2 and "Traceback" not in deep.stderr  # the filter pass's progress
  assert deep.stderr.strip().splitlines()[-1].endswith(
      "deep/   .jsonl: its source name '   ' is blank; rename it (a source is named by its "
      "file's stem, its input folder's name or a record's \"source\")"), deep.stderr
  one_line_error(here("prepare", corpus / "in.jsonl", "--out", out, "--as-text", "  ", *flags),
                 "--as-text '  ' is blank")
  assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
      "   ", "   .txt", "deep"]
  (tmp_path / "r.jsonl").write_text("".join(json.dumps({"text": f"{text}{i}", "source": s})
                                            + "\n" for i, s in enumerate([" \t", "web", "web"])))
  ok = here("prepare", tmp_path / "r.jsonl", "--out", out, *flags)
  assert ok.returncode == 0, ok.stderr
  manifest = json.loads((out / "manifest.json").read_text())
  assert list(manifest["sources"]) == ["web"] and manifest["rejected"]["bad_source"] == 1


def last_line_error(proc, *words):
  """As one_line_error, after the progress lines a command printed before the error."""
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f"maxlm {proc.args[0]}: error: ") and all(w in last for w in words), last
  return last


def _full_disk_at(monkeypatch, victim):
  """TensorStore's writes fail as on a full disk (its own words) for the file named `victim`."""
  from maxlm import io
  real_open = io._open

  class Full:
    def __init__(self, store):
      self.store = store

    def write(self, name, data):
      if name == victim:
        raise ValueError(f'OUT_OF_RANGE: Failed writing: "{name}.__lock": Failed to write 10 '
                         "bytes to file 6: No space left on device [os_error_code='28']")
      return self.store.write(name, data)

    def __getattr__(self, attr):
      return getattr(self.store, attr)
  monkeypatch.setattr(io, "_open", lambda folder: Full(real_open(folder)))


@pytest.mark.parametrize("victim", ["tokens-00000.bin", "manifest.json"])
def test_a_full_disk_under_a_data_dir_is_one_line_and_leaves_the_old_one(corpus, tmp_path, here,
                                                                          monkeypatch, victim):
  """The first shard, or the manifest (the worst moment: every other file written): one line
  naming the disk being full; the data dir already at --out is as it was, no partial folder."""
  out = tmp_path / "out"
  assert _prepare(corpus, "--out", out, via=here).returncode == 0
  before = _listing(out) + [("manifest", (out / "manifest.json").read_bytes())]
  _full_disk_at(monkeypatch, victim)
  line = last_line_error(_prepare(corpus, "--out", out, "--overwrite", via=here),
                         f"cannot write --out {out}: {victim}: No space left on device "
                         "(errno 28)", "the old data dir is as it was", "free space there")
  assert _listing(out) + [("manifest", (out / "manifest.json").read_bytes())] == before, line
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
  monkeypatch.undo()
  assert here("check-data", out).returncode == 0


def test_a_full_disk_under_an_object_store_data_dir_leaves_no_manifest(corpus, tmp_path, here,
                                                                       monkeypatch):
  """No rename there: the old manifest went before the first new file, the new one never came,
  so the next command refuses the dir instead of reading a mix of old and new files."""
  from maxlm import io
  out = "memory://hostile-full/data"
  assert _prepare(corpus, "--out", out, via=here).returncode == 0
  _full_disk_at(monkeypatch, "manifest.json")
  last_line_error(_prepare(corpus, "--out", out, "--overwrite", via=here),
                  "manifest.json: No space left on device (errno 28)", "holds no manifest.json")
  monkeypatch.undo()
  assert not io.exists(io.join(out, "manifest.json"))
  one_line_error(here("check-data", out))


def test_sigterm_stops_a_command_stuck_in_native_code(run, tmp_path):
  """Eval paused in native code (MAXLM_PAUSE_NATIVE, as a long XLA call holds the main thread,
  where no Python handler runs and Ctrl-C waits too): SIGTERM still ends it, within the pause,
  with the interrupted command's line and exit code."""
  import os
  import signal
  import time
  from limits import HANG_S
  paused = tmp_path / "paused"
  proc = subprocess.Popen([sys.executable, "-m", "maxlm.cli", "eval", str(run / "run")],
                          env={**os.environ, "MAXLM_PAUSE_NATIVE": str(paused)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  give_up = time.monotonic() + HANG_S
  while not paused.exists() and proc.poll() is None and time.monotonic() < give_up:
    time.sleep(0.05)
  assert paused.exists(), proc.communicate()
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=HANG_S)
  assert proc.returncode == 130 and err.splitlines() == ["maxlm eval: interrupted"], err
  assert not (tmp_path / "paused.over").exists()  # it ended in the pause, not after it
