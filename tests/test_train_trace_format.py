"""`maxlm trace`'s table shows every document id whole (ids often differ only at their end)."""

from maxlm.train import trace


def test_document_ids_are_shown_whole():
  stem = "usr/share/doc/python3-some-long-package-name/examples/"
  docs = [{"loss": 2.5 - i, "loss_tokens": 10, "row": i, "source": "prose", "start": 0,
           "end": 40, "context": 0, "fim": False, "doc_id": f"{stem}part-{i}.txt"}
          for i in range(2)]
  t = {"step": 3, "stage": 0, "stage_step": 3, "plan_step": 3, "from_checkpoint": 0,
       "replayed_loss": 2.0, "logged": True, "loss": 2.0, "exact": True, "loss_tokens": 20,
       "documents": docs, "documents_loss": 2.0,
       "rows": [{"row": i, "loss": 2.0, "loss_tokens": 10} for i in range(2)]}
  lines = trace.format_trace(t, top=5).splitlines()
  assert lines[3].endswith(f" {stem}part-0.txt") and lines[4].endswith(f" {stem}part-1.txt")
  assert lines[2].split()[-1] == "doc"
