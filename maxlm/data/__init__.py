"""The data side: documents -> token store -> plan of rows -> packed, masked batches."""
