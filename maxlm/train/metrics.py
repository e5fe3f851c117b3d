"""Per-step metrics: one JSON line each in run_dir/metrics.jsonl and TensorBoard event files.

The event writer is ours (~40 lines) rather than a TensorFlow or tensorboard dependency: an
event file is TFRecord framing (length, masked CRC-32C) around a tiny Event protobuf holding
scalar summaries, which TensorBoard reads.
"""

import contextlib
import json
import os
import shutil
import socket
import struct
import time

from maxlm import MaxlmError, io

_CRC_TABLE = []
for _i in range(256):
  _c = _i
  for _ in range(8):
    _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
  _CRC_TABLE.append(_c)


def crc32c(data):
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data):
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n):
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(tag, payload):
  return _varint(tag) + _varint(len(payload)) + payload


def event_bytes(step, wall_time, scalars=None, file_version=None):
  """A serialized tensorflow.Event with scalar summary values."""
  msg = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
  if file_version:
    msg += _field(0x1A, file_version.encode())
  if scalars:
    values = b"".join(_field(0x0A, _field(0x0A, tag.encode()) + b"\x15" + struct.pack("<f", v))
                      for tag, v in scalars.items())
    msg += _field(0x2A, values)
  return msg


def record(data):
  header = struct.pack("<Q", len(data))
  return header + struct.pack("<I", _masked_crc(header)) + data + struct.pack(
      "<I", _masked_crc(data))


class Writer:
  """Appends metrics to metrics.jsonl and a TensorBoard event file in run_dir."""

  def __init__(self, run_dir):
    self.run_dir = run_dir
    with write_errors(run_dir):
      os.makedirs(run_dir, exist_ok=True)
      self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
      name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
      self.events = open(os.path.join(run_dir, name), "ab")
      self.events.write(record(event_bytes(0, time.time(), file_version="brain.Event:2")))

  def write(self, step, values):
    """Appends one row; a failed write (disk full, quota) is a one-line MaxlmError."""
    with write_errors(self.run_dir):
      self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
      self.jsonl.flush()
      scalars = {k: float(v) for k, v in values.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
      self.events.write(record(event_bytes(step, time.time(), scalars)))
      self.events.flush()

  def close(self):
    for f in (getattr(self, "jsonl", None), getattr(self, "events", None)):
      try:
        if f is not None:
          f.close()
      except OSError:  # its failed write was already reported
        pass


@contextlib.contextmanager
def write_errors(run_dir):
  """Turns an OSError while writing run_dir's small files into one line saying what, where
  and how much space is left."""
  try:
    yield
  except OSError as e:
    try:
      free = f"; {shutil.disk_usage(run_dir).free / 2**20:.1f} MiB free there"
    except OSError:
      free = ""
    raise MaxlmError(f"cannot write to run_dir {run_dir}: {e.strerror or e}{free}. Training "
                     "stopped; earlier checkpoints are intact") from None


def read_jsonl(run_dir):
  """The rows of run_dir/metrics.jsonl (local or gs://); [] before the first step."""
  path = io.join(run_dir, "metrics.jsonl")
  if not io.exists(path):
    return []
  lines = [line for line in io.read_bytes(path).decode().splitlines() if line.strip()]
  rows = []
  for n, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if n < len(lines) - 1:  # only the last line can be cut short, by a kill mid-write
        raise MaxlmError(f"{path} line {n + 1} is not JSON") from None
  return rows


def read_events(path):
  """[(step, {tag: value})] from an event file (used by tests and `maxlm plot`)."""
  out, data = [], open(path, "rb").read()
  at = 0
  while at < len(data):
    (n,) = struct.unpack_from("<Q", data, at)
    payload = data[at + 12:at + 12 + n]
    assert struct.unpack_from("<I", data, at + 12 + n)[0] == _masked_crc(payload)
    out.append(_parse_event(payload))
    at += 16 + n
  return out


def _parse_event(msg):
  step, scalars, at = 0, {}, 0
  while at < len(msg):
    tag, at = _read_varint(msg, at)
    field, wire = tag >> 3, tag & 7
    if wire == 1:
      at += 8
    elif wire == 0:
      value, at = _read_varint(msg, at)
      step = value if field == 2 else step
    elif wire == 2:
      n, at = _read_varint(msg, at)
      if field == 5:
        scalars.update(_parse_summary(msg[at:at + n]))
      at += n
  return step, scalars


def _parse_summary(msg):
  out, at = {}, 0
  while at < len(msg):
    _, at = _read_varint(msg, at)
    n, at = _read_varint(msg, at)
    value, inner = msg[at:at + n], 0
    tag_len_at = 1
    tag_len, inner = _read_varint(value, tag_len_at)
    tag = value[inner:inner + tag_len].decode()
    out[tag] = struct.unpack_from("<f", value, inner + tag_len + 1)[0]
    at += n
  return out


def _read_varint(data, at):
  shift = result = 0
  while True:
    byte = data[at]
    at += 1
    result |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return result, at
