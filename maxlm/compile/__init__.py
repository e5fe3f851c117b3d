"""`maxlm compile`: a config's stages compiled by the compilers its target runs, on a machine
that has none of its chips — check a pod run before paying for it.

`target.py` names the devices (a TPU slice from libtpu's topologies; a GPU node from the CUDA
plugin and the GPU's description, which `gpu_spec.py` writes); `stage.py` builds each stage's
real train step for them (the implementations that target runs, from maxlm/model/impl.py's one
rule) and compiles it; `report.py` reads the compiled step: bytes a device, collectives, FLOPs,
the TPU cost model's time; `command.py` is the command and its verdict.
"""
