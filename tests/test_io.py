import numpy as np

from maxlm import io
from maxlm.data import store

import datagen


def test_local_and_object_store_paths_share_the_code(tmp_path):
  docs = datagen.make_docs([5, 300, 17], seed=4)
  for root in (str(tmp_path / "local"), "memory://bucket/data"):
    datagen.write_data_dir(root, docs)
    tokens = store.TokenStore(root)
    assert io.is_local(root) == root.startswith("/")
    for d, (_, want, *_) in enumerate(docs):
      assert np.array_equal(tokens.read(d, 2, 5), want[2:5])
      assert np.array_equal(tokens.document(d), want)
    assert store.load_doc_ids(root) == ["src-0", "src-1", "src-2"]


def test_missing_file_is_a_clear_error(tmp_path):
  import pytest
  from maxlm import MaxlmError
  with pytest.raises(MaxlmError, match="file not found"):
    io.read_bytes(str(tmp_path / "nope.json"))
  with pytest.raises(MaxlmError, match="run `maxlm prepare"):
    store.load_index(str(tmp_path))
