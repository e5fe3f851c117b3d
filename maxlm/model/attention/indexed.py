"""Attention of the indexer stages (DeepSeek sparse attention): the keys a lightning indexer
selects (`index` = its iq, iw, ik), and the warm-up's statistics beside dense attention. The way
is maxlm/model/impl.py's `sparse_impl`: top-k tokens (`sparse`), top-k key blocks
(`sparse_blocks`), or blocks under context parallelism (`sparse_context`)."""

from maxlm.model.attention import sparse as sparse_lib, sparse_blocks, sparse_context


def sparse(way, q, k, v, segment_ids, index, cfg, *, mesh, batch_axes):
  """(out, peak, stats) of sparse attention; cfg is the stage's config.SparseConfig."""
  iq, iw, ik = index
  if way == "context":
    return sparse_context.sparse(q, k, v, iq, iw, ik, segment_ids, mesh=mesh,
                                 batch_axes=batch_axes, topk=cfg.topk, block=cfg.block,
                                 recall_blocks=cfg.recall_blocks)
  if way == "blocks":
    return sparse_blocks.sparse_blocks(q, k, v, iq, iw, ik, segment_ids, segment_ids,
                                       topk=cfg.topk, block=cfg.block,
                                       recall_blocks=cfg.recall_blocks)
  return sparse_lib.sparse(q, k, v, iq, iw, ik, segment_ids, segment_ids, topk=cfg.topk,
                           chunk=cfg.chunk)


def warmup(q, k, segment_ids, index, cfg, *, mesh, batch_axes):
  """The indexer warm-up's statistics (its KL to the dense attention, the recall)."""
  iq, iw, ik = index
  if mesh is not None and mesh.shape.get("context", 1) > 1:
    return sparse_context.warmup(q, k, iq, iw, ik, segment_ids, mesh=mesh,
                                 batch_axes=batch_axes, topk=cfg.topk, chunk=cfg.chunk)
  return sparse_lib.warmup(q, k, iq, iw, ik, segment_ids, segment_ids, topk=cfg.topk,
                           chunk=cfg.chunk)
