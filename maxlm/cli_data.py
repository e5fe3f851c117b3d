"""The data commands: `maxlm prepare`, `funnel`, `show-doc` and `check-data` on a data dir, and
`ledger`, `batches` and `show-batch` on the plan of a config (their arguments are declared with the
others in `maxlm.cli`).

Tested through the commands, as a user runs them (tests/test_cli.py, test_data_prepare_funnel.py,
test_data_dir.py, test_data_pairs.py, test_hostile.py): its own checks (`_check_outputs`,
`_check_step`) are refusals the commands' tests provoke (test_data_quality.py
test_hostile_flags_are_one_line_before_any_work, test_cli.py, test_hostile.py), and the rest
prints what maxlm.data computes, which the tests of maxlm/data/ check directly; a direct test
would call the same functions without the argument parsing a user goes through."""

import dataclasses
import json
import os
import sys

from maxlm import MaxlmError, config as config_lib, io, outputs
from maxlm.outputs import check_out_file, ensure_parent, special_file, writing


def add_prepare_parser(sub):
  """`maxlm prepare`'s options (its command is cmd_prepare below)."""
  p = sub.add_parser("prepare", help="documents -> tokenizer, token store, doc index, manifest")
  p.add_argument("inputs", nargs="+", help="JSONL, text, markdown or code files, or folders")
  p.add_argument("--out", required=True, help="data dir to write (local or gs://)")
  p.add_argument("--vocab-size", type=int, default=8192,
                 help="tokenizer vocabulary to train (ignored with --tokenizer)")
  p.add_argument("--tokenizer", help="an existing SentencePiece .model to use instead")
  p.add_argument("--as-text", action="append", default=[], metavar="GLOB",
                 help="also read files matching GLOB (name or end of path: 'LICENSE*', "
                      "'*.1', 'licenses/*', '*') as plain text, files prepare would skip; "
                      "repeatable (docs/data.md)")
  p.add_argument("--val-fraction", type=float, default=0.01,
                 help="share of each source's documents held out for validation, in [0, 1)")
  p.add_argument("--max-pair-len", type=int, default=1024,
                 help="row positions a preference pair may fill; a longer prompt is cut from "
                      "its left, a pair whose answers alone do not fit is rejected "
                      "(docs/pairs.md)")
  p.add_argument("--workers", type=int, default=None,
                 help="processes for the quality steps and tokenizing (default: all cores)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace an existing data dir at --out (once the new one is complete)")
  p.add_argument("--verbose", action="store_true",
                 help="list every rejected document and skipped file, not a few per reason")
  p.add_argument("--lang", action="append", metavar="CODES|SOURCE=CODES",
                 help="accepted languages of prose, e.g. en or en,de; any skips language ID; "
                      "SOURCE=CODES for one source (default: en)")
  p.add_argument("--filters", choices=("on", "off"), default=None,
                 help="line cleaning, Gopher quality and repetition, code rules (default: on, "
                      "or as --quality says)")
  p.add_argument("--dedup", choices=("on", "off"), default=None,
                 help="exact and MinHash near-duplicate removal across sources (default: on, "
                      "or as --quality says)")
  p.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE",
                 help="one threshold or setting, e.g. gopher_min_words=20 or bands=20")
  p.add_argument("--kind", action="append", default=[], metavar="SOURCE=KIND",
                 help="what a source is: web (line cleaning), prose (no line deleted), code "
                      "(code rules only) or chat; repeatable (default: from each record or "
                      "file, docs/data.md)")
  p.add_argument("--strict", action="store_true",
                 help="a source that loses over half its bytes, or whose kept documents keep "
                      "under 80%% of their characters on median, is an error, not a warning")
  p.add_argument("--quality", metavar="FILE.yaml", help="quality settings (see docs/data.md)")
  p.add_argument("--rejected", metavar="FILE.jsonl",
                 help="one line per rejected document (those rejected while reading too)")
  p.add_argument("--funnel-png", metavar="FILE.png", help="draw the funnel")
  p.add_argument("--engine", choices=("local", "datatrove"), default="local",
                 help="run the per-document quality work in a local process pool, or as "
                      "datatrove tasks (the [cluster] extra; see docs/data.md)")
  p.add_argument("--tasks", type=int, default=None, help="datatrove tasks (default: --workers)")
  p.add_argument("--inspect-dir", metavar="WORK",
                 help="datatrove tasks' records: used if complete (run on a cluster), else "
                      "written there")


def cmd_prepare(args):
  from maxlm.data import prepare
  if not 300 <= args.vocab_size <= config_lib.MAX_MODEL_DIM:
    raise MaxlmError(f"--vocab-size must be in [300, {config_lib.MAX_MODEL_DIM}] (bytes and "
                     f"specials at least; model.vocab_size's limit at most), got "
                     f"{args.vocab_size}")
  if not 0 <= args.val_fraction < 1:
    raise MaxlmError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
  if args.max_pair_len < 4:
    raise MaxlmError(f"--max-pair-len must be >= 4, got {args.max_pair_len}")
  if args.tasks is not None and args.tasks < 1 or args.workers is not None and args.workers < 1:
    raise MaxlmError("--tasks and --workers must be >= 1")
  quality = _quality_config(args)
  _check_outputs(args)
  options = prepare.Options(
      vocab_size=args.vocab_size, tokenizer_file=args.tokenizer, val_fraction=args.val_fraction,
      workers=args.workers, overwrite=args.overwrite, verbose=args.verbose, quality=quality,
      rejected=args.rejected, engine=args.engine, tasks=args.tasks, inspect_dir=args.inspect_dir,
      as_text=args.as_text, max_pair_len=args.max_pair_len, strict=args.strict)
  manifest = prepare.prepare(args.inputs, args.out, options)
  _print_manifest(manifest, args.out, args.verbose)
  _show_funnel(manifest, args.funnel_png, warnings=False)  # prepare printed them already


def _check_outputs(args):
  """--rejected and --funnel-png: files that land on nothing the user needs, checked before any
  work: not an input, --tokenizer or --quality, not inside an input folder or --out (which the
  new data dir replaces), nor inside any run dir or data dir (outputs.py); and writable (a
  probe file beside them, so nothing is left at the path itself if prepare fails)."""
  def inside(path, folder):
    return os.path.commonpath([path, folder]) == folder
  out = os.path.realpath(args.out) if io.is_local(args.out) else None
  for flag, folder in (("--out", out), ("--inspect-dir", args.inspect_dir)):
    found = outputs.enclosing(os.path.dirname(os.path.realpath(folder))) if folder else None
    if found:  # --out may be a data dir itself (--overwrite replaces it), never lie inside one
      raise MaxlmError(f"{flag} {folder} lies inside the {found[1]} {found[0]}: refusing to "
                       "write there; choose a folder outside any run dir or data dir")
  reads = [(f"{flag} {path}", path) for flag, path in (("--tokenizer", args.tokenizer),
                                      ("--quality", args.quality)) if path]
  for flag, path in (("--rejected", args.rejected), ("--funnel-png", args.funnel_png)):
    if not path:
      continue
    real = os.path.realpath(path)
    for given in args.inputs:
      source = os.path.realpath(given)
      if real == source or (os.path.isdir(source) and inside(real, source)):
        raise MaxlmError(f"{flag} {path} is (or is inside) the input {given}; write it "
                         "elsewhere")
    if out and inside(real, out):
      raise MaxlmError(f"{flag} {path} is inside --out {args.out}, which the new data dir "
                       "replaces; write it elsewhere")
    outputs.check_file_output(flag, path, reads)
    found = outputs.enclosing(os.path.dirname(real))
    if found:  # check_file_output leaves a run dir's top level to `maxlm plot`
      raise MaxlmError(f"{flag} {path} lies inside the {found[1]} {found[0]}: refusing to "
                       "write there; choose another place")
    if flag == "--funnel-png" and not path.lower().endswith(".png"):
      raise MaxlmError(f"--funnel-png {path}: give a .png file name")
    probe = f"{path}.probe-{os.getpid()}"
    try:
      if special_file(path):  # /dev/stdout, a fifo: written as it is (funnel.Rejected)
        continue
      ensure_parent(path)
      with open(probe, "w"):
        pass
      os.remove(probe)
    except OSError as e:
      raise MaxlmError(f"{flag} {path} cannot be written ({e.strerror})") from None


def _quality_config(args):
  from maxlm.data import quality
  from maxlm.data.quality import kinds
  overrides = [f"{name}={value == 'on'}" for name, value in (("filters", args.filters),
                                                             ("dedup", args.dedup)) if value]
  by_source = {}
  for item in args.lang or ():
    source, sep, codes = item.rpartition("=")
    codes = tuple(c.strip() for c in codes.split(",") if c.strip())
    if not codes:
      raise MaxlmError(f"--lang {item!r}: expected language codes, e.g. en or en,de or any")
    if sep and not source.strip():
      raise MaxlmError(f"--lang {item!r}: the source name is empty; give SOURCE=CODES, e.g. "
                       "docs=en, or CODES alone for every source")
    if sep:
      by_source[source] = codes
    else:
      overrides.append(f"lang=[{','.join(codes)}]")
  config = quality.load(args.quality, overrides + list(args.filter))
  if by_source:
    config = dataclasses.replace(config, lang_by_source={**config.lang_by_source, **by_source})
  flags = kinds.parse_flags(args.kind)
  if flags:
    config = dataclasses.replace(config, kinds={**config.kinds, **flags})
  config.check()  # --lang SOURCE=... and --kind as --quality's keys are
  return config


def _show_funnel(manifest, png=None, title="prepare funnel", warnings=True):
  from maxlm.data.quality import funnel
  if not manifest.get("funnel"):
    if png:
      raise MaxlmError("this data dir was prepared without the quality steps: no funnel")
    return
  print(funnel.table(manifest["funnel"], warnings))
  if png:
    with writing(png) as tmp:  # whole or absent; a full disk is one line naming it
      funnel.save_png(manifest["funnel"], tmp, title)
    print(f"wrote {png}")


def cmd_config(args):
  from maxlm.data import starter
  seq_lens = _int_list("--seq-len", args.seq_len)
  opts = starter.Options(size=args.size, seq_lens=seq_lens, tokens_per_step=args.tokens_per_step,
                         epochs=args.epochs, mix=args.mix, run_dir=args.run_dir)
  if args.out is None:
    print(starter.text(args.data_dir, opts), end="")
    return
  starter.write(args.data_dir, opts, args.out, args.overwrite)
  print(f"wrote {args.out}: `maxlm ledger {args.out}` shows what each stage trains on, "
        f"`maxlm train {args.out}` trains it")


def _int_list(flag, text):
  try:
    return tuple(int(x) for x in text.split(","))
  except ValueError:
    raise MaxlmError(f"{flag} {text!r}: expected integers separated by commas, e.g. 256,1024") \
        from None


def cmd_docs(args):
  from maxlm.data import doclist
  if args.kept and args.removed:
    raise MaxlmError("give --kept or --removed, not both (neither lists all)")
  which = ((doclist.KEPT,) if args.kept else (doclist.REMOVED,) if args.removed else
           (doclist.KEPT, doclist.REMOVED))
  found = doclist.rows(args.data_dir, args.source, args.grep, which)
  if args.json:
    for row in found:
      print(json.dumps(row, ensure_ascii=False))
  else:
    print("\n".join(doclist.format_rows(found)))
  if doclist.REMOVED in which and not doclist.has_removed(args.data_dir):
    print(f"({args.data_dir} was prepared before data dirs kept their removed documents: "
          "kept ones only)", file=sys.stderr)


def cmd_funnel(args):
  from maxlm.data import store
  check_out_file("--png", args.png, ".png")
  manifest = store.load_manifest(args.data_dir)
  if not manifest.get("funnel"):
    raise MaxlmError(f"{args.data_dir} was prepared by a maxlm without the quality steps: no "
                     "funnel")
  _show_funnel(manifest, args.png, f"funnel of {args.data_dir}")


def _print_manifest(manifest, out, verbose=False):
  for name, s in manifest["sources"].items():
    print(f"  {name:<12} {s['documents']:>8,} docs {s['tokens']:>12,} tokens "
          f"({s['heldout_documents']:,} docs held out)")
  rejected = {k: v for k, v in manifest["rejected"].items() if v}
  skipped = {k: v for k, v in manifest["skipped"].items() if v}
  funnel = manifest.get("funnel")
  removed = (f"; removed by the quality steps: {sum(r['documents'] for r in funnel['steps']):,} "
             "documents (the funnel below)" if funnel else "")
  print(f"  input rejected: {rejected or 'none'}{removed}; skipped: {skipped or 'none'}; "
        f"skipped files: {manifest['skipped_files'] or 'none'}")
  _print_skipped_files(manifest, verbose)
  pairs = sum(src.get("pairs", 0) for src in manifest["sources"].values())
  bad_pairs = {k: v for k, v in manifest.get("rejected_pairs", {}).items() if v}
  bad_prompts = {k: v for k, v in manifest.get("rejected_prompts", {}).items() if v}
  if pairs or bad_pairs or bad_prompts or "prompts.jsonl" in manifest.get("files", {}):
    print(f"  preference pairs: {pairs:,} ({manifest.get('truncated_pairs', 0):,} with the "
          f"prompt cut from the left), rejected: {bad_pairs or 'none'}; RL prompts rejected: "
          f"{bad_prompts or 'none'}")
  if manifest["renamed_ids"]:
    print(f"  renamed duplicate ids: {manifest['renamed_ids']} "
          f"(e.g. {manifest['renamed_id_examples'][0]})")
  if verbose:
    for kind, key in (("rejected", "rejected_examples"), ("skipped", "skipped_examples")):
      for reason, examples in manifest[key].items():
        for where in examples:
          print(f"  {kind} {reason}: {where}")
    for what in manifest["renamed_id_examples"]:
      print(f"  renamed: {what}")
  elif rejected or skipped:
    for reason in rejected:
      print(f"  rejected {reason}, e.g. {manifest['rejected_examples'][reason][0]}")
    print("  (examples in manifest.json; --verbose lists them all)")
  print(f"wrote {out} (fingerprint {manifest['fingerprint'][:12]})")


def _print_skipped_files(manifest, verbose, shown=3):
  """Files not read, by name: a few per suffix (all with --verbose), and how to read them."""
  examples = manifest.get("skipped_file_examples", {})
  for suffix, count in sorted(manifest["skipped_files"].items()):
    names = examples.get(suffix, [])
    names = names if verbose else names[:shown]
    more = f", ... ({count - len(names)} more)" if count > len(names) else ""
    print(f"  not read ({suffix}, {count}): {', '.join(names)}{more}")
  if manifest["skipped_files"]:
    print("  (these are not text, markdown, code or JSON Lines by name; --as-text GLOB reads "
          "matching files as text)")


def cmd_show_doc(args):
  from maxlm.data import documents, store
  from maxlm.data.quality import explain
  if not args.diff:
    explain.doc_number(args.data_dir, args.doc_id)
    print(explain.kept_text(args.data_dir, args.doc_id))
    return
  manifest = store.load_manifest(args.data_dir)
  config = explain.config_of(manifest)
  if config is None:
    raise MaxlmError(f"{args.data_dir} was prepared without the quality steps: nothing was "
                     "removed from any document")
  report = documents.Report(as_text=manifest.get("as_text", ()))
  docs = documents.unique_ids(documents.iter_documents(args.diff, report), report)
  kind, kind_from, judged, verdict = explain.explain(docs, args.doc_id, config)
  fate = (f"removed at {verdict['step']} by {verdict['rule']}" if verdict["step"] else
          "kept" if sum(r is not None for _, r in judged) == 0 else "kept, lines removed")
  print(f"{args.doc_id}: kind {kind} (from {kind_from}), {fate}")
  print(explain.format_diff(judged))


def cmd_check_data(args):
  from maxlm.data import datadir, store
  manifest = store.load_manifest(args.data_dir)
  bad = datadir.verify_contents(args.data_dir, manifest)
  if bad:
    raise MaxlmError(f"{args.data_dir}: {len(bad)} of {len(manifest['files'])} files differ "
                     f"from their SHA-256 in manifest.json ({', '.join(bad[:5])}); re-run "
                     f"maxlm prepare INPUT... --out {args.data_dir} --overwrite")
  print(f"{args.data_dir}: all {len(manifest['files'])} files match manifest.json "
        f"(fingerprint {manifest['fingerprint'][:12]})")


def _open_data(args):
  from maxlm.data import loader
  cfg = config_lib.load(args.config, args.overrides)
  return cfg, loader.Data(cfg)


def _check_step(cfg, stage, step, count=1):
  if not 0 <= stage < len(cfg.stages):
    raise MaxlmError(f"--stage {stage}: the schedule has stages 0..{len(cfg.stages) - 1}")
  steps = cfg.stages[stage].num_steps
  if step < 0 or count < 1 or step + count > steps:
    raise MaxlmError(f"--step {step} --count {count}: stage {stage} has steps 0..{steps - 1}")


def cmd_ledger(args):
  from maxlm.data import ledger
  cfg, data = _open_data(args)
  led = ledger.ledger(data.planner)
  for stage, entry in zip(cfg.stages, led["stages"]):
    entry["attention"] = attention_mode(stage, cfg.model.mqa)
  if args.json:
    print(json.dumps(led))
  else:
    names = {i: s.name or str(i) for i, s in enumerate(cfg.stages)}
    print(ledger.format_table(led, names))
    print("attention per stage (docs/schedule.md): " + "; ".join(
        f"{names[i]} {e['attention']}" for i, e in enumerate(led["stages"])))


def attention_mode(stage, mqa):
  """How a stage attends: dense, the indexer's warm-up, or sparse top-k (its selection); for
  DeepSeek-V4's attention (`mqa`), what its CSA layers attend."""
  sp = stage.sparse
  if mqa.enabled:
    entries = {"dense": "every entry", "indexer_warmup": "every entry, the indexer warming up "
               "(main model frozen)", "sparse": f"the indexer's top-{mqa.index_top_k} entries"}
    return f"V4 window + entries; CSA: {entries[sp.mode]}"
  if sp.mode == "dense":
    return "dense"
  indexer = f"indexer {sp.indexer_heads}x{sp.indexer_dim}"
  if sp.mode == "indexer_warmup":
    return f"dense, {indexer} warming up (main model frozen)"
  return f"sparse top-{sp.topk} ({sp.select} selection), {indexer}"


def cmd_batches(args):
  import numpy as np
  from maxlm.data import loader
  check_out_file("--out", args.out, ".npz")
  cfg, data = _open_data(args)
  _check_step(cfg, args.stage, args.step, args.count)
  ds = loader.stage_dataset(data, args.stage, args.host_index, args.hosts)
  steps = range(args.step, args.step + args.count)
  arrays = loader.stack([ds[k] for k in steps])
  prov = loader.provenance_json(data, args.stage, steps, args.host_index, args.hosts)
  with writing(args.out) as tmp, open(tmp, "wb") as f:
    np.savez(f, provenance=np.array(prov), **arrays)
  shape = arrays["inputs"].shape
  print(f"wrote {args.out}: {shape[0]} batches x {shape[1]} rows x {shape[2]} positions")


def cmd_show_batch(args):
  from maxlm.data import loader, show
  check_out_file("--out", args.out, ".png")
  cfg, data = _open_data(args)
  _check_step(cfg, args.stage, args.step)
  batch = loader.stage_dataset(data, args.stage)[args.step]
  row = show.busiest_row(batch) if args.row is None else args.row
  if not 0 <= row < len(batch["inputs"]):
    raise MaxlmError(f"--row {row}: the batch has rows 0..{len(batch['inputs']) - 1}")
  pieces = data.provenance(data.global_batch_pieces(args.stage, args.step))[row]
  with writing(args.out) as tmp:
    show.save_row_png(batch, row, tmp, f"stage {args.stage} step {args.step}", pieces)
  print(f"wrote {args.out}")
  if getattr(args, "text", False):
    _print_row_text(data, batch, row, pieces)


def _print_row_text(data, batch, row, pieces):
  """Each segment of the row as text, decoded by the data dir's tokenizer, under its name."""
  import numpy as np
  from maxlm.data import show, tokenizer
  sp = tokenizer.load(io.read_bytes(io.join(data.config.data.dir,
                                            data.manifest.get("tokenizer", "tokenizer.model"))))
  seg = np.asarray(batch["segment_ids"][row])
  named = [dict(p, role=r) for p in pieces
           for r in (("chosen", "rejected") if p.get("pair") else (None,))]
  for k in range(1, int(seg.max()) + 1):
    tokens = np.asarray(batch["inputs"][row])[seg == k].tolist()
    name = show.piece_label(named[k - 1]) if k <= len(named) else f"segment {k}"
    print(f"--- segment {k}: {name}, {len(tokens)} positions")
    print(sp.decode(tokens))
  pad = int((seg == 0).sum())
  print(f"--- padding: {pad} positions")
