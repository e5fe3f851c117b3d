"""The commands that read a run dir: `maxlm eval`, `trace`, `generate`, `export` and `plot`
and their arguments. Tested as a user runs them (tests/test_train_trace.py: eval and trace;
tests/test_interop.py: export and generate; tests/test_train_dpo.py and tests/test_hostile.py:
generate and plot): each handler only joins argparse to the library, so a direct test would
repeat those."""

import json
import sys

from maxlm import MaxlmError, io


def add_parsers(sub):
  """These commands' arguments (`maxlm.cli` builds the parser)."""
  _add_eval_and_trace(sub)
  _add_generate_export_and_plot(sub)


def _add_eval_and_trace(sub):
  p = sub.add_parser("eval", help="held-out loss and bits per byte, per source")
  p.add_argument("run_dir", help="a run's folder (its config.yaml and latest checkpoint)")
  p.add_argument("--split", choices=("val", "train"), default="val",
                 help="held-out documents, or training ones for comparison")
  p.add_argument("--tokens", type=int, default=None,
                 help="held-out tokens per source, whole documents (default: the run's "
                      "train.eval_tokens)")
  p.add_argument("--stage", type=int, default=None,
                 help="score at this stage's L, RoPE and attention (default: the checkpoint's; "
                      "one saved at a stage's end belongs to the next stage)")
  p.add_argument("--json", action="store_true",
                 help="print {step, stage, seq_len, split, eval_tokens, small_tokens, sources: "
                      "{name: {documents, tokens, bytes, nll, loss, bpb, small}}, all: {...}, "
                      "positions: {name: {bucket: {tokens, loss}}}} as JSON, not a table "
                      "(bpb = nll / ln 2 / bytes; buckets: maxlm/eval/positions.py)")
  from maxlm.eval import long_eval
  long_eval.add_arguments(p)

  p = sub.add_parser("trace", help="a step's loss per document, replayed exactly from a "
                     "checkpoint; or the loss spikes training flagged")
  p.add_argument("run_dir", help="a run's folder (its config.yaml, checkpoints, metrics.jsonl)")
  what = p.add_mutually_exclusive_group(required=True)
  what.add_argument("--step", type=int, metavar="K",
                    help="global step K as metrics.jsonl numbers it (0-based, across stages)")
  what.add_argument("--spikes", action="store_true",
                    help="list the steps flagged as loss spikes (train.spike_window, "
                         "train.spike_sigmas)")
  p.add_argument("--top", type=int, default=20, help="document pieces shown, worst first")
  p.add_argument("--json", action="store_true",
                 help="print {step, loss, documents: [{source, doc_id, start, end, "
                      "loss_tokens, loss, ...}], rows, ...} (or {spikes: [...]}) as JSON")


def _add_generate_export_and_plot(sub):
  p = sub.add_parser("generate", help="sample from a run's latest checkpoint (KV cache)")
  p.add_argument("run_dir", help="a run's folder (its config.yaml and latest checkpoint)")
  p.add_argument("--prompt", help="the text to continue")
  p.add_argument("--prompts", metavar="FILE.jsonl",
                 help='{"prompt", "gold"} lines (e.g. DATA_DIR/prompts.jsonl): sample answers '
                      "and score them against gold (docs/pairs.md)")
  p.add_argument("--verify", choices=("exact", "numeric"), default="exact",
                 help="with --prompts: how the extracted answer is compared with gold")
  p.add_argument("--samples", type=int, default=1, help="with --prompts: answers per prompt "
                 "(reports pass@1 and pass@N)")
  p.add_argument("--json", action="store_true", help="with --prompts: print the result as JSON")
  p.add_argument("--max-tokens", type=int, default=64, help="tokens to sample at most")
  p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
  p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (0: all)")
  p.add_argument("--top-p", type=float, default=1.0,
                 help="then among the likeliest whose probability mass reaches p (1: all)")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")

  p = sub.add_parser("export", help="a checkpoint as a Hugging Face folder (Llama, Ministral, Qwen2-MoE or GLM-4-MoE) "
                     "(transformers loads it without maxlm; docs/interop.md)")
  p.add_argument("run_dir", help="a run's folder (its config.yaml and checkpoints)")
  p.add_argument("--out", required=True, help="the folder to write (local)")
  p.add_argument("--step", type=int, default=None,
                 help="the checkpoint to export (default: the newest intact one)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="the weights' dtype in the safetensors files")
  p.add_argument("--shard-size", type=float, default=2.0, metavar="GIB",
                 help="largest safetensors file, in GiB; above it the weights are sharded "
                      "with model.safetensors.index.json")
  p.add_argument("--no-tokenizer", action="store_true",
                 help="export the weights and configs alone (no tokenizer files)")
  p.add_argument("--overwrite", action="store_true",
                 help="replace an existing --out folder (once the export is complete)")

  p = sub.add_parser("plot", help="PNG of a run's curves: loss (smoothed), val loss and bits "
                     "per byte per source, lr, norms, max logit, MFU")
  p.add_argument("run_dir", help="a run's folder (its metrics.jsonl)")
  p.add_argument("--out", help="the PNG to write (default: RUN_DIR/curves.png)")


def cmd_eval(args):
  import jax
  from maxlm.data import store
  from maxlm.eval import bpb
  from maxlm.train import open_run
  from maxlm.parallel import mesh as mesh_lib
  from maxlm.train import step as step_lib
  from maxlm.eval import long_eval  # loss by position; retrieval grids with --passkey
  if args.passkey:
    long_eval.task_names(args.passkey_tasks)  # a typo before any work
  config, data, s, mesh, model, params, step, collections = open_run.open_run(args.run_dir,
                                                                              stage=args.stage)
  from maxlm import signals
  signals.pause_native()  # MAXLM_PAUSE_NATIVE: tests only
  stage = config.stages[s]
  nll_fn = jax.jit(step_lib.make_eval_step(model, config.rules, model.cfg))

  def nll(batch):
    with mesh:
      return jax.device_get(nll_fn(params, mesh_lib.place_batch(batch, mesh, config.rules),
                                   collections.get("moe_bias")))

  split = store.VAL if args.split == "val" else store.TRAIN
  if args.tokens is not None and args.tokens < 1:
    raise MaxlmError(f"--tokens must be >= 1, got {args.tokens}")
  budget = args.tokens or config.train.eval_tokens
  table = bpb.evaluate_table(nll, data, stage.seq_len, stage.batch, budget, split)
  if not table:
    raise MaxlmError(f"the data has no {args.split} documents to evaluate")
  _mark_trained(config, table, data.index.sources)
  passkey = long_eval.Passkey(lengths=args.passkey_lengths, samples=args.passkey_samples,
                              seed=args.passkey_seed, png=args.passkey_png,
                              tasks=args.passkey_tasks)
  extra = long_eval.evaluate(nll, data, config, s, mesh, model, params, budget, split,
                             run_dir=args.run_dir, passkey=passkey if args.passkey else None,
                             moe_bias=collections.get("moe_bias"))
  if args.json:
    print(json.dumps(bpb.jsonable({
        "step": step, "stage": s, "seq_len": stage.seq_len, "split": args.split,
        "eval_tokens": budget, "small_tokens": bpb.SMALL_TOKENS, **table, **extra})))
    return
  print(f"checkpoint {step}, stage {s} (L={stage.seq_len}), {args.split} split: per source, "
        f"whole documents within {budget:,} tokens, the same text at every stage "
        "(docs/troubleshooting.md)")
  print("\n".join(_table_lines(table)))
  print("\n".join(long_eval.format_text(extra)))


def _mark_trained(config, table, sources):
  """Marks each scored source's `trained` (whether any stage's mix names it: maxlm/data/
  plan.py), and lists in `not_trained` every source of the data no stage trains on, scored
  or not (one without held-out text has no row, but is named all the same)."""
  from maxlm.data import plan
  left_out = plan.untrained(config, sources)
  for name, entry in table["sources"].items():
    entry["trained"] = name not in left_out
  table["not_trained"] = left_out


def _table_lines(table):
  from maxlm.eval import bpb
  lines = [f"{'source':<13}{'documents':>10}{'tokens':>10}{'bytes':>11}{'nll (nats)':>13}"
           f"{'loss/token':>12}{'bits/byte':>11}"]
  for name, e in [*table["sources"].items(), ("all", table["all"])]:
    source = name != "all"
    mark = ("*" if source and e["small"] else "") + ("!" if source and not e["trained"] else "")
    lines.append(f"{name + mark:<13}{e['documents']:>10,}{e['tokens']:>10,}{e['bytes']:>11,}"
                 f"{e['nll']:>13,.1f}{e['loss']:>12.4f}{e['bpb']:>11.4f}")
  if bpb.small_sources(table):
    lines.append("* " + bpb.small_note(bpb.small_sources(table)))
  if table["not_trained"]:
    lines.append(f"! not trained on: no stage's mix names {', '.join(table['not_trained'])}")
  lines.append("bits/byte = nll / ln 2 / bytes; loss/token = nll / tokens")
  return lines


def cmd_trace(args):
  from maxlm.eval import bpb
  from maxlm.train import trace
  if args.spikes:
    found = trace.spike_list(args.run_dir)
    print(json.dumps({"spikes": found}) if args.json else trace.format_spikes(found))
    return
  if args.top < 0:
    raise MaxlmError(f"--top must be >= 0, got {args.top}")
  result = trace.trace(args.run_dir, args.step, log=lambda m: print(m, file=sys.stderr))
  print(json.dumps(bpb.jsonable(result)) if args.json else trace.format_trace(result, args.top))


def cmd_generate(args):
  from maxlm import io
  from maxlm.data import tokenizer
  from maxlm.eval import generate
  from maxlm.train import open_run
  if (args.prompt is None) == (args.prompts is None):
    raise MaxlmError("give --prompt TEXT or --prompts FILE.jsonl (one of them)")
  if args.samples < 1:
    raise MaxlmError(f"--samples must be >= 1, got {args.samples}")
  generate.check_settings(args.temperature, args.top_k, args.seed, args.max_tokens)
  if not 0 < args.top_p <= 1:
    raise MaxlmError(f"--top-p must be in (0, 1] (1: all tokens), got {args.top_p}")
  if args.prompt is not None:
    _utf8(args.prompt)
  else:
    from maxlm.eval import verify
    prompts, dropped = verify.read_prompts(args.prompts)
  config, data, s, mesh, model, params, _, collections = open_run.open_run(args.run_dir)
  generate.check_settings(args.temperature, args.top_k, args.seed, args.max_tokens,
                          model.cfg.vocab_size)
  positions, longest = generate.context(config, s)
  sp = tokenizer.load(io.read_bytes(io.join(config.data.dir, "tokenizer.model")))
  if args.prompts:
    prompts = _fitting(args, data, sp, prompts, dropped, positions)
    result = verify.evaluate(_sampler(args, data, sp, mesh, config, model, params, prompts,
                                      collections),
                             prompts, args.verify, args.samples)
    print(json.dumps({**result, "dropped": dropped}) if args.json else
          verify.format_result(result))
    return
  ids = [data.special.bos] + sp.encode(args.prompt)
  problem = generate.length_problem(len(ids), args.max_tokens, positions)
  if problem:
    raise MaxlmError(f"--prompt: {problem} (stages.{longest}.seq_len)")
  from maxlm.eval import sample
  [[out]] = sample.sample_batch(model, params, [ids], collections=collections,
                                **_settings(args, data, mesh, config))
  print(args.prompt + sp.decode(out))


def _utf8(text):
  """A command-line text is valid Unicode: undecodable bytes reach Python as lone surrogates,
  which the tokenizer cannot take."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise MaxlmError(f"--prompt is not valid UTF-8 text (character {e.start}: "
                     f"{text[e.start:e.end].encode('utf-8', 'surrogateescape')!r}); pass UTF-8"
                     ) from None


def _fitting(args, data, sp, prompts, dropped, positions):
  """The prompts whose tokens and --max-tokens fit the model (the others counted in `dropped`
  as too_long); says on stderr how many lines of the file are not used, and why."""
  from maxlm.data import pairs
  from maxlm.eval import generate
  kept = []
  for p in prompts:
    n = 1 + len(pairs.prompt_ids(sp, p["prompt"], not isinstance(p["prompt"], str)))
    if generate.length_problem(n, args.max_tokens, positions) is None:
      kept.append(p)
    else:
      dropped["too_long"] = dropped.get("too_long", 0) + 1
  reasons = {k: v for k, v in dropped.items() if v}
  counts = ", ".join(f"{k} {v}" for k, v in reasons.items())
  if not kept:
    raise MaxlmError(f"--prompts {args.prompts}: no usable prompt fits the model's {positions} "
                     f"positions with --max-tokens {args.max_tokens} (not used: {counts})")
  if reasons:
    why = (f" (too_long: the prompt and --max-tokens {args.max_tokens} exceed the model's "
           f"{positions} positions)" if "too_long" in reasons else "")
    print(f"--prompts {args.prompts}: {sum(reasons.values())} lines not used: {counts}{why}",
          file=sys.stderr)
  return kept


def _settings(args, data, mesh, config, n_samples=1):
  """sample.sample_batch's keyword arguments from the command line."""
  return dict(n_samples=n_samples, max_new_tokens=args.max_tokens, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=data.special.eos,
              mesh=mesh, rules=config.rules)


ROWS_PER_CALL = 256  # prompts x samples sampled together by one call of the batched sampler


def _sampler(args, data, sp, mesh, config, model, params, prompts, collections):
  """sample(prompt, i): the i-th answer to a prompt, cut at EOS or <|end|>. Every answer is
  sampled up front by the batched sampler, prompts of similar length together; a prompt's
  samples depend only on --seed and its place in the file (sample.py's keys)."""
  from maxlm.data import pairs, tokenizer
  from maxlm.eval import sample as sample_lib
  end = sp.piece_to_id(tokenizer.CHAT_END)
  ids = [[data.special.bos] + pairs.prompt_ids(sp, p["prompt"], not isinstance(p["prompt"], str))
         for p in prompts]
  order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
  per_call = max(1, ROWS_PER_CALL // args.samples)
  texts = {}
  for at in range(0, len(order), per_call):
    chunk = order[at:at + per_call]
    outs = sample_lib.sample_batch(model, params, [ids[i] for i in chunk], prompt_indices=chunk,
                                   collections=collections,
                                   **_settings(args, data, mesh, config, args.samples))
    for i, rows in zip(chunk, outs):
      rows = [out[:out.index(end)] if end in out else out for out in rows]
      texts.setdefault(_prompt_key(prompts[i]["prompt"]),  # a repeated prompt: first samples
                       [sp.decode([t for t in out if t != data.special.eos]) for out in rows])
  return lambda prompt, i: texts[_prompt_key(prompt)][i]


def _prompt_key(prompt):
  return json.dumps(prompt, sort_keys=True)


def cmd_export(args):
  from maxlm.interop import export
  if not args.shard_size > 0:
    raise MaxlmError(f"--shard-size must be > 0 GiB, got {args.shard_size}")
  if args.step is not None and args.step < 0:
    raise MaxlmError(f"--step must be >= 0, got {args.step}")
  done = export.export(args.run_dir, args.out, args.step, args.dtype,
                       int(args.shard_size * 2**30), not args.no_tokenizer, args.overwrite)
  print(f"wrote {done['out']}: checkpoint {done['step']} (stage {done['stage']}), "
        f"{done['tensors']} tensors, {done['bytes'] / 2**20:,.1f} MiB in "
        f"{len(done['files'])} safetensors file(s), {done['seconds']:.1f} s")


def cmd_plot(args):
  from maxlm.outputs import check_out_file
  from maxlm.train import plot
  out = args.out or io.join(args.run_dir, "curves.png")
  check_out_file("--out", out, ".png")
  plot.save(args.run_dir, out)
  print(f"wrote {out}")
