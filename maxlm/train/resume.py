"""What a checkpoint's metadata holds, and how a run comes back from it.

Resuming, in order:
  1. Take the newest checkpoint whose metadata reads and matches its checksum (one that does
     not is named and skipped).
  2. Its parameter shapes must be this config's model (else: one line, and nothing written).
  3. Its data dir fingerprint must be this data dir's, unless `data.allow_changed: true` says
     the change is intended (then it is logged, and recorded in the first metrics row); its
     planner snapshot must be of this maxlm's data plan version (plan.check_resume).
  4. Restore the train state into the stage's shardings and check every array against its
     checksum. A corrupt or unrestorable checkpoint sends us back to step 1 with the ones
     before it: the run continues bitwise as if that checkpoint had never been written.
     If none restores, stop with one line: never start over on top of checkpoints that
     may be good (unreadable ones: a transient read error, another version). Only when every
     checkpoint is provably corrupt (its checksums fail) does the run start from step 0, as
     if none had been written, and says so.
  5. Restore the Grain iterator and cross-check it against the step; if they disagree,
     rebuild it from the step alone (batch k of stage s is a pure function of k) and say so.
"""

import hashlib
import json

import jax

from maxlm import MaxlmError, config as config_lib
from maxlm.ckpt import checkpoint, integrity
from maxlm.data import loader, plan, skip
from maxlm.model import build, moe_state
from maxlm.train import stage as stage_lib, step as step_lib


def data_fingerprint(data):
  """The data dir's content fingerprint (from its manifest), or a digest of the manifest for
  data dirs prepared before fingerprints existed."""
  manifest = data.manifest
  if manifest.get("fingerprint"):
    return manifest["fingerprint"]
  text = json.dumps(manifest, sort_keys=True).encode()
  return "manifest:" + hashlib.sha256(text).hexdigest()[:32]


def check_same_model(config, vocab, meta):
  """A checkpoint restores only into the parameter shapes it was saved with."""
  saved_vocab = meta.get("vocab", vocab)
  shapes = lambda c, v: [(path, shape) for path, shape, _ in build.param_axes(c, v)]
  saved = config_lib.from_dict(meta["config"])
  if moe_state.enabled(saved.model) != moe_state.enabled(config.model):  # the state's keys
    has = "hold" if moe_state.enabled(saved.model) else "have no"
    raise MaxlmError(f"run_dir {config.run_dir}'s checkpoints {has} MoE balancing bias "
                     f"(model.moe.balance={saved.model.moe.balance!r} there, "
                     f"{config.model.moe.balance!r} here): keep the balance it was trained with, "
                     "or pass a new run_dir=")
  if shapes(saved, saved_vocab) == shapes(config, vocab):
    return
  there = {**meta["config"]["model"], "vocab": saved_vocab}
  here = {**config_lib.to_dict(config)["model"], "vocab": vocab}
  diff = [f"{k} {there.get(k)} there, {v} here" for k, v in here.items() if there.get(k) != v]
  raise MaxlmError(f"run_dir {config.run_dir} holds checkpoints of another model "
                   f"({'; '.join(diff)}): pass a new run_dir=, or the model settings it "
                   "was trained with")


def check_same_data(config, data, meta, step_no, log, reader=False):
  """None if the checkpoint was trained on this data dir; else the old fingerprint when the
  config allows the change (or a reader only evaluates), or a one-line error."""
  saved, now = meta.get("data_fingerprint"), data_fingerprint(data)
  if saved is None or saved == now:
    return None
  if reader:
    log(f"note: checkpoint {step_no} was trained on other data than {config.data.dir} holds "
        "now; evaluating on the data as it is now")
    return saved
  if not config.data.allow_changed:
    raise MaxlmError(f"checkpoint {step_no} was trained on other data than {config.data.dir} "
                     f"holds now (fingerprint {saved[:16]} there, {now[:16]} here): for a new "
                     f"run on this data pass a new run_dir= (this one is {config.run_dir}); "
                     "to go on with this run, resume on the data it was trained on, or set "
                     "data.allow_changed=true if the change is intended")
  log(f"data changed since checkpoint {step_no} ({saved[:16]} -> {now[:16]}); continuing "
      "because data.allow_changed is set")
  return saved


def resume(ckpts, config, data, vocab, log, reader=False):
  """(state, meta, step, old data fingerprint or None) from the newest checkpoint that
  verifies, or None when run_dir has no checkpoints. reader: for eval and generate, which
  never start over and accept changed data with a note."""
  found, last = ckpts.latest_readable(), None
  while found is not None:
    step_no, meta = found
    check_same_model(config, vocab, meta)
    changed = check_same_data(config, data, meta, step_no, log, reader)
    if not reader:
      skip.check_resume(config, meta["config"]["data"].get("skip_steps", ()), step_no)
      plan.check_resume(meta.get("planner"), step_no)
    try:
      state = restore_state(ckpts, step_no, meta, config, vocab)
      if meta.get("planner") and meta["planner"].get("version") == plan.VERSION:
        data.planner.seed_snapshot(plan.Snapshot(**meta["planner"]))
      return state, meta, step_no, changed
    except integrity.CorruptCheckpoint as e:
      ckpts.corrupt.add(step_no)
      last = str(e)
      log(f"{e}; falling back to the checkpoint before it")
    except Exception as e:  # noqa: BLE001 (unrestorable: fall back)
      last = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
      log(f"checkpoint {step_no} is unreadable ({type(e).__name__}); trying the one before")
    found = ckpts.readable_before(step_no)
  steps = ckpts.steps()
  if reader and steps:
    raise MaxlmError(f"no checkpoint in {ckpts.dir} restores and verifies (last: "
                     f"{last or 'unreadable metadata'})")
  if steps and set(steps) <= ckpts.corrupt:  # provably damaged, every one: as if never written
    log(f"every checkpoint in {ckpts.dir} is corrupt ({', '.join(map(str, steps))}); starting "
        "from step 0 as if none had been written (they are replaced as the run saves again)")
    return None
  if steps:  # never start over silently on top of checkpoints that may be good
    raise MaxlmError(f"no checkpoint in {ckpts.dir} restores and verifies (last: "
                     f"{last or 'unreadable metadata'}); pass a new run_dir=, or delete that "
                     "folder to start over")
  return None


def restore_state(ckpts, step_no, meta, config, vocab):
  """The verified train state of checkpoint step_no, in its stage's shardings."""
  s = meta["stage"]
  parts = stage_lib.parts(config, s, vocab)
  abstract = checkpoint.abstract(jax.eval_shape(
      lambda: step_lib.init_state_abstract(parts.model, parts.opt, config.seed,
                                           config.stages[s].seq_len)), parts.shardings)
  return ckpts.restore(step_no, abstract, meta)


def iterator(ckpts, resumed, data, s, k0, it_start, log):
  """The stage's Grain iterator at step k0: the saved state restored and cross-checked when
  there is one, else started at k0. `resumed`: (step, meta) of the checkpoint, or None."""
  host, hosts = jax.process_index(), jax.process_count()
  if resumed is not None and it_start is not None and k0 > 0:
    step_no, meta = resumed
    try:
      it = ckpts.restore_iterator(step_no, loader.iterator(data, s, host, hosts,
                                                           start_step=it_start))
      problem = integrity.check_iterator(meta, it.get_state(), k0 - it_start)
      if problem is None:
        return it, it_start
      log(f"the Grain iterator state in checkpoint {step_no} disagrees with its step: "
          f"{problem}; rebuilding the iterator at step {k0} (batches depend on the step "
          "alone)")
    except Exception as e:  # noqa: BLE001 (another worker or host count: the step suffices)
      log(f"Grain iterator state not restored ({type(e).__name__}); starting at step {k0}")
  return loader.iterator(data, s, host, hosts, start_step=k0), k0


def save(ckpts, data, state, s, next_k, global_step, consumed, config, it, it_start,
         spikes=None, init_from=None):
  """Checkpoint `global_step`: the state and the position of the step after it (and the
  spike detector's window, maxlm/train/spikes.py; where init.from took the parameters)."""
  stage = config.stages[s]
  if next_k >= stage.num_steps and s + 1 < len(config.stages):
    s, next_k = s + 1, 0  # a stage boundary: resume at the next stage's first step
    it = None
  rows = next_k * stage.batch if it is not None else 0
  snap = data.planner.snapshot(s, rows // config.data.block_rows)
  meta = {"stage": s, "stage_step": next_k, "global_step": global_step, "consumed": consumed,
          "iterator_start": it_start if it is not None else None,
          "planner": checkpoint.snapshot_to_json(snap), "config": config_lib.to_dict(config),
          "vocab": config.model.vocab_size or int(data.manifest["vocab_size"]),
          "data_fingerprint": data_fingerprint(data), "finite": True, "spikes": spikes}
  if init_from is not None:
    meta["init_from"] = init_from
  ckpts.save(global_step, state, meta, it)
