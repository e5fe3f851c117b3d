"""The memory-mapped doc index: what prepare writes, what every process maps (and does not copy),
old data dirs, remote ones through the local cache."""

import io as _io
import json
import pickle
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from maxlm import MaxlmError, io
from maxlm.data import datadir, index_files, loader, plan, prepare, store

import datagen

DOCS = datagen.make_docs([5 + (i * 37) % 300 for i in range(120)],
                         ["prose" if i % 3 else "code" for i in range(120)], 2,
                         {i: range(10, 5 + (i * 37) % 300, 40) for i in range(120)},
                         {7: [(0, 4)], 30: [(0, 9), (20, 25)]})
STAGES = [{"seq_len": 64, "batch": 4, "steps": 10}, {"seq_len": 128, "batch": 2, "steps": 6}]


def config(data_dir):
  return datagen.make_config(STAGES, {"dir": str(data_dir), "mix": {"prose": 2, "code": 1},
                                      "shuffle_rows": 4, "block_rows": 8, "overlap": 4,
                                      "fim": {"rate": 0.3}})


def batches(data_dir):
  data = loader.Data(config(data_dir))
  out = [loader.stage_dataset(data, s)[k] for s, k in [(0, 0), (0, 7), (1, 3)]]
  return out, json.loads(loader.provenance_json(data, 0, [0, 7]))


def same(a, b):
  return all(np.array_equal(x[f], y[f]) for x, y in zip(a, b) for f in x)


def in_memory(index):
  return store.DocIndex(**{f: np.array(getattr(index, f)) for f in
                           ("shard", "offset", "length", "source", "split", "nbytes",
                            "bound_ptr", "bound_pos", "bound_level", "nolos_ptr",
                            "nolos_start", "nolos_end", "lang_score")},
                        sources=list(index.sources))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return datagen.write_data_dir(tmp_path_factory.mktemp("idx") / "data", DOCS, val_fraction=0.1)


def test_the_index_is_mapped_and_plans_as_an_in_memory_one(data_dir):
  index = store.load_index(data_dir)
  for field in index_files.FIELDS:
    assert isinstance(getattr(index, field), np.memmap), field
  mem = in_memory(index)
  assert np.array_equal(index.is_chat, np.diff(index.nolos_ptr) > 0)
  assert index.is_chat[7] and index.is_chat[30] and index.is_chat.sum() == 2
  for s in range(2):
    docs = index.pool(s)
    assert np.array_equal(docs, np.flatnonzero((index.source == s) & (index.split == 0)))
    assert index.pool_tokens[s] == index.length[docs].sum()
  assert [mem.bounds(d)[0].tolist() for d in range(5)] == [index.bounds(d)[0].tolist()
                                                           for d in range(5)]
  cfg = config(data_dir)
  mapped, memory = plan.Planner(index, cfg), plan.Planner(mem, cfg)
  for s, b in [(0, 0), (0, 4), (1, 1)]:
    for f in ("doc", "start", "end", "ctx", "fim", "order"):
      assert np.array_equal(getattr(mapped.block(s, b), f), getattr(memory.block(s, b), f))


def test_doc_ids_are_a_mapped_string_table(data_dir):
  ids = store.load_doc_ids(data_dir)
  assert isinstance(ids, index_files.DocIds) and len(ids) == len(DOCS)
  assert ids == [f"{d[0]}-{i}" for i, d in enumerate(DOCS)]
  assert ids[-1] == f"{DOCS[-1][0]}-{len(DOCS) - 1}" and ids.index("code-3") == 3
  assert pickle.loads(pickle.dumps(ids))[5] == ids[5]
  with pytest.raises(IndexError):
    ids[len(DOCS)]


def test_odd_ids_survive_the_table(tmp_path):
  writer = prepare.DataDirWriter(str(tmp_path / "d"))
  odd = ["caf\u00e9", "", "a\nb", "\U0001f600" * 3, "x" * 1000]
  for i in odd:
    writer.add("s", i, np.arange(11, 20, dtype=np.int32))
  writer.finish(prepare.Report(), datagen.SPECIAL, 1000, val_fraction=0.0)
  assert list(store.load_doc_ids(str(tmp_path / "d"))) == odd


def test_pickles_as_its_name_and_workers_map_the_same_pages(data_dir, tmp_path):
  """What Grain sends a worker holds no index arrays; a worker reading the whole index grows
  by file-backed (shared) pages, not by private copies."""
  data = loader.Data(config(data_dir))
  ds = pickle.dumps(loader.stage_dataset(data, 0))
  assert len(ds) < len(pickle.dumps(in_memory(data.index)))  # the arrays are not in it
  # a big index: 2M documents; a worker sums two of its arrays (24 MB)
  n = 2_000_000
  big = store.DocIndex(shard=np.zeros(n, np.int32), offset=np.arange(n, dtype=np.int64),
                       length=np.ones(n, np.int32), source=np.zeros(n, np.int32),
                       split=np.zeros(n, np.uint8), nbytes=np.zeros(n, np.int64),
                       bound_ptr=np.zeros(n + 1, np.int64), bound_pos=np.zeros(0, np.int32),
                       bound_level=np.zeros(0, np.int8), nolos_ptr=np.zeros(n + 1, np.int64),
                       nolos_start=np.zeros(0, np.int32), nolos_end=np.zeros(0, np.int32),
                       sources=["s"], lang_score=np.zeros(n, np.float16))
  index_files.write(_Folder(tmp_path / "big"), big.arrays(), big.sources, ["x"] * n)
  del big
  blob = pickle.dumps(store.load_index(str(tmp_path / "big")))
  assert len(blob) < 1000
  (tmp_path / "index.pkl").write_bytes(blob)
  worker = textwrap.dedent("""
      import pickle, sys, numpy as np
      from maxlm.data import store  # imported before measuring
      def rss(key):
        return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key))
      before = rss('RssAnon:'), rss('RssFile:')
      index = pickle.loads(open(sys.argv[1], 'rb').read())
      total = int(index.length.sum()) + int(index.offset[::512].sum() > 0)
      total += int(np.asarray(index.offset).sum() > 0)
      print(isinstance(index.length, np.memmap), total, rss('RssAnon:') - before[0],
            rss('RssFile:') - before[1])
  """)
  procs = [subprocess.Popen([sys.executable, "-c", worker, str(tmp_path / "index.pkl")],
                            stdout=subprocess.PIPE, text=True) for _ in range(2)]
  for proc in procs:
    mapped, total, anon_kib, file_kib = proc.communicate()[0].split()
    assert mapped == "True" and int(total) == n + 2
    assert int(file_kib) > 20_000  # the 24 MB read came through the page cache ...
    assert int(anon_kib) < 4_000  # ... not into a private copy


class _Folder:
  """The Staging interface over a plain folder (for a big synthetic index)."""

  def __init__(self, path):
    self.path = path
    path.mkdir()

  def write(self, name, data):
    (self.path / name).write_bytes(data)


def test_an_old_data_dir_still_opens_and_plans_the_same(data_dir, tmp_path):
  index, ids = store.load_index(data_dir), list(store.load_doc_ids(data_dir))
  old = tmp_path / "old"
  staging = datadir.Staging(str(old))
  arrays = {f: np.array(getattr(index, f)) for f in
            ("shard", "offset", "length", "source", "split", "nbytes", "bound_ptr",
             "bound_pos", "bound_level", "nolos_ptr", "nolos_start", "nolos_end", "lang_score")}
  buf = _io.BytesIO()
  np.savez(buf, sources=np.array(index.sources, dtype=str), **arrays)
  staging.write("index.npz", buf.getvalue())
  staging.write("doc_ids.json", json.dumps(ids).encode())
  src = data_dir.rstrip("/")
  for name in json.loads(open(f"{src}/manifest.json").read())["files"]:
    if name.startswith("tokens-"):
      staging.write(name, open(f"{src}/{name}", "rb").read())
  manifest = {k: v for k, v in json.loads(open(f"{src}/manifest.json").read()).items()
              if k not in ("files", "fingerprint")}
  staging.commit(manifest)
  assert not isinstance(store.load_index(str(old)).length, np.memmap)
  assert store.load_doc_ids(str(old)) == ids
  got, want = batches(old), batches(data_dir)
  assert same(got[0], want[0]) and got[1] == want[1]


def test_a_remote_data_dir_is_mapped_from_the_local_cache(data_dir, tmp_path, monkeypatch):
  monkeypatch.setenv("MAXLM_CACHE", str(tmp_path / "cache"))
  remote = "memory://bucket/mapped"
  datagen.write_data_dir(remote, DOCS, val_fraction=0.1)
  index = store.load_index(remote)
  assert isinstance(index.length, np.memmap)
  assert str(tmp_path / "cache" / "index") in index.length.filename
  assert store.load_doc_ids(remote) == store.load_doc_ids(data_dir)
  assert pickle.loads(pickle.dumps(index)).length.filename == index.length.filename
  got, want = batches(remote), batches(data_dir)
  assert same(got[0], want[0]) and got[1] == want[1]
  folder = next((tmp_path / "cache" / "index").iterdir())
  (folder / "index-length.npy").unlink()  # (a new file: the old one stays mapped above)
  (folder / "index-length.npy").write_bytes(b"torn")  # a short file is fetched again
  assert np.array_equal(store.load_index(remote).length, index.length)
  manifest = store.load_manifest(remote)
  io.write_bytes(io.join(remote, "index-source.npy"),
                 bytes(manifest["files"]["index-source.npy"]["bytes"]))  # same size, other bytes
  for p in folder.glob("index-source.npy"):
    p.unlink()
  with pytest.raises(MaxlmError, match="index-source.npy does not match its sha256"):
    store.load_index(remote)


def test_an_index_of_another_format_is_refused(data_dir, tmp_path):
  copy = tmp_path / "copy"
  shutil.copytree(data_dir, copy)
  meta = json.loads((copy / "index.json").read_text())
  (copy / "index.json").write_text(json.dumps({**meta, "format": 99}))
  with pytest.raises(MaxlmError, match="format 99, this maxlm reads format 2; re-run maxlm "
                                       "prepare"):
    store.load_index(str(copy))
