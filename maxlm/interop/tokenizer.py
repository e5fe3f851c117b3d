"""The tokenizer files of an exported folder: `AutoTokenizer.from_pretrained(DIR)` then gives
the ids maxlm trains on, BOS included.

maxlm encodes a text as [BOS] + SentencePiece ids (no dummy prefix, identity normalisation,
whitespace kept; `maxlm.data.tokenizer`), and inserts its control pieces (FIM, chat roles) by
id only. transformers' `LlamaTokenizer` reads the same SentencePiece model (`tokenizer.model`)
with `add_bos_token` and without a prefix space; `split_special_tokens` keeps text that spells a
control piece as text, as maxlm does. tests/test_interop.py compares the ids on hostile text
(test_autotokenizer_ids_equal_maxlms) and checks the files an export writes
(test_export_writes_a_llama_folder); a direct test could only restate the keys written here, and
what matters is that transformers reads them as maxlm encodes.
"""

import json
import os

from maxlm.data import tokenizer as tok_lib


def write(out_dir, model_proto, special, max_length):
  sp = tok_lib.load(model_proto)
  with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
    f.write(model_proto)
  names = {"bos_token": sp.id_to_piece(special.bos), "eos_token": sp.id_to_piece(special.eos),
           "unk_token": sp.id_to_piece(sp.unk_id()), "pad_token": sp.id_to_piece(special.pad)}
  extra = [p for p in tok_lib.CONTROL_SYMBOLS if sp.piece_to_id(p) != sp.unk_id()]
  config = {"tokenizer_class": "LlamaTokenizer", **names, "add_bos_token": True,
            "add_eos_token": False, "add_prefix_space": False, "legacy": False,
            "clean_up_tokenization_spaces": False, "split_special_tokens": True,
            "model_max_length": int(max_length), "padding_side": "right",
            "sp_model_kwargs": {}, "additional_special_tokens": extra}
  _dump(os.path.join(out_dir, "tokenizer_config.json"), config)
  _dump(os.path.join(out_dir, "special_tokens_map.json"),
        {**names, "additional_special_tokens": extra})


def _dump(path, obj):
  with open(path, "w") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)
    f.write("\n")
