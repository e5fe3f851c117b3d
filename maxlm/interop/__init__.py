"""Interop with the Hugging Face ecosystem: a run exported as a transformers folder (`maxlm
export`: Llama, or for MoE and local/global models the class families.py picks), and a run
started from the weights of another run or of such a folder (`init.from`).

  families.py   which transformers class a model is (Llama, Ministral, Qwen2-MoE, GLM-4-MoE)
                and why, its config.json, its MoE tensors, and the checks of a folder of it
  layout.py     which maxlm parameter is which HF tensor, and the reshapes both ways
  planned.py    the same for models whose layers differ (maxlm/model/layers.py's groups)
  hf_config.py  config.json / generation_config.json from a maxlm config, the settings a Llama
                config cannot express, and the checks of an HF folder against a maxlm model
  run_reader.py one parameter (or one layer of it) at a time from a run's Orbax checkpoint
  tokenizer.py  the tokenizer files AutoTokenizer reads (same ids as maxlm, BOS included)
  export.py     the folder: streamed per tensor into size-limited safetensors shards
  load.py       `init.from`: the source opened and checked, parameters read into the model
"""
