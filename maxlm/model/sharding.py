"""The logical -> mesh axis rules (`config.rules`) in the form flax's logical partitioning takes.

Every parameter and key activation carries logical axis names (maxlm/model/transformer.py);
the rules map each name to mesh axes (maxlm/parallel/mesh.py builds the mesh)."""


def rules_list(rules):
  """flax's rule format: ((logical, mesh axes or None), ...)."""
  return tuple((name, tuple(axes) if axes else None) for name, axes in rules.items())
