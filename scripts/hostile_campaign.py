#!/usr/bin/env python3
"""Hostile runs of the `turbo` command line: the binary used as a hostile user would use it.

Every case runs `turbo` as a subprocess with a wall-clock limit of 60 s and records its exit code
or the signal that ended it, whether stderr shows a panic or a Rust backtrace, its peak resident
memory (ru_maxrss from os.wait4, taken by a small launcher process, see LAUNCHER; VmHWM polled
from /proc for a run that is killed), its wall time, and whether a refusal is one line on stderr
that names what was wrong. A run past 3 GB resident is killed at once (counted as "> 2 GB"), so
that an unbounded read cannot fill the machine. Requests files also count their output lines
against their requests (a request that gets no line is lost). `turbo serve` is driven over HTTP
on 127.0.0.1 only, with a bounded number of requests, each with a time limit.

Classes of cases (docs/reliability.md, "Hostile runs of the command line"):
  sizes     numbers from flags at, just past and far past their limits, and junk values
  models    corrupt GGUF files (header, metadata, tensor directory, byte flips, truncations) and
            broken HF directories, each through `info` and `generate`
  text      prompt files and chat input: /dev/zero, 20 MB, invalid UTF-8, very long lines
  output    closed pipes (`| head -c N`), /dev/full, closed stdout and stderr
  sigint    Ctrl-C (SIGINT) at several moments of generate, generate --prompts-file, chat
  requests  requests files: malformed lines, a 100 MB line, many requests through a tiny KV cache
  serve     `turbo serve` under malformed, huge, concurrent requests and clients that leave
  tp        --tensor-parallel 3 on the default model under hostile use

Only the Python standard library is used. The model files are made here: a tiny random LLaMA
(hidden 96, 2 layers, 6 heads, 3 KV heads, FFN 192) as GGUF (F16, and Q8_0/Q4_1) and as an HF
directory, with the default model's own tokenizer (its GGUF metadata is read for it).

Usage (from the repository root):

    python3 scripts/hostile_campaign.py --turbo target/release/turbo
    python3 scripts/hostile_campaign.py --turbo T --classes sizes,text     # some classes
    python3 scripts/hostile_campaign.py --turbo T --only 'sizes/block-size' # cases by regex
    python3 scripts/hostile_campaign.py --list                              # names only

Options: --model (default: $TURBO_CACHE or ~/.cache/turbo, SmolLM2-135M-Instruct.Q4_1.gguf),
--work DIR (generated files and results, default /tmp/turbo-hostile; kept after the run so that a
case's reproduction command can be run by hand). Results: WORK/results/runs.jsonl (one object per
run), WORK/results/summary.md (the table, the failures with reproduction commands, every distinct
refusal line). Exit status 1 if any target was missed or any refusal was not one clear line.

Reproduction commands are shell commands with $TURBO, $MODEL and $WORK standing for the binary,
the default model and the work directory; the files they name are made again by running this
script with --only and the case's name.
"""

import argparse
import hashlib
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

TIME_LIMIT_S = 60  # a run past this is killed and counted as "> 60 s"
RSS_LIMIT = 2_000_000_000  # "> 2 GB": peak resident set over 2 * 10^9 bytes
# A run whose resident set passes this is killed at once: an unbounded read can fill the
# machine's 24 GB in seconds, and the kernel's OOM killer may then pick another process.
RSS_KILL_MB = 3000
U64_MAX = 2**64 - 1
STDERR_KEEP = 64 * 1024  # bytes of stderr kept for the analysis and the record
# Children print a backtrace with a panic or a failed allocation; no colours, whatever the caller's.
CHILD_ENV = dict(os.environ, RUST_BACKTRACE="1", NO_COLOR="1")

# The tiny model: small enough that a load and a few tokens take well under a second.
TINY = dict(hidden=96, layers=2, heads=6, kv_heads=3, ffn=192, context=512)

# ggml tensor types and GGUF metadata value types.
F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8
GT_U8, GT_I8, GT_U16, GT_I16, GT_U32, GT_I32, GT_F32, GT_BOOL = 0, 1, 2, 3, 4, 5, 6, 7
GT_STR, GT_ARR, GT_U64, GT_I64, GT_F64 = 8, 9, 10, 11, 12
SCALAR_FMT = {GT_U8: "<B", GT_I8: "<b", GT_U16: "<H", GT_I16: "<h", GT_U32: "<I", GT_I32: "<i",
              GT_F32: "<f", GT_BOOL: "<?", GT_U64: "<Q", GT_I64: "<q", GT_F64: "<d"}


# --------------------------------------------------------------------------------------------
# GGUF: a reader for the default model's metadata and a writer that can be told to lie.
# --------------------------------------------------------------------------------------------

class Raw(bytes):
    """Bytes written as they are in place of an encoded value (or of a whole metadata entry):
    the way to put a lying length or count into a file."""


def read_gguf_metadata(path):
    """The metadata entries of a GGUF file, [(key, value type, value)] with arrays as
    (element type, [items]) and strings as bytes, and the offset where the metadata ends."""
    with open(path, "rb") as f:
        data = f.read(32 << 20)  # the metadata of the default model is about 2 MB
    pos = 0

    def take(n):
        nonlocal pos
        b = data[pos:pos + n]
        pos += n
        return b

    def scalar(t):
        fmt = SCALAR_FMT[t]
        return struct.unpack(fmt, take(struct.calcsize(fmt)))[0]

    def string():
        (n,) = struct.unpack("<Q", take(8))
        return take(n)

    def value(t):
        if t == GT_STR:
            return string()
        if t == GT_ARR:
            (et,) = struct.unpack("<I", take(4))
            (n,) = struct.unpack("<Q", take(8))
            return (et, [value(et) for _ in range(n)])
        return scalar(t)

    assert take(4) == b"GGUF", f"{path}: not a GGUF file"
    _version, _n_tensors, n_kv = struct.unpack("<IQQ", take(20))
    out = []
    for _ in range(n_kv):
        key = string().decode()
        (t,) = struct.unpack("<I", take(4))
        out.append((key, t, value(t)))
    return out, pos


def enc_string(b):
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<Q", len(b)) + b


def enc_value(t, v):
    if isinstance(v, Raw):
        return bytes(v)
    if t == GT_STR:
        return enc_string(v)
    if t == GT_ARR:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(enc_value(et, x) for x in items)
    return struct.pack(SCALAR_FMT[t], v)


@dataclass
class Tensor:
    name: str
    dims: list  # GGUF order: dims[0] is the row length (columns)
    ttype: int
    data: bytes
    offset: int = None  # None: where the writer lays it; a number: what the file claims
    n_dims: int = None  # None: len(dims)


@dataclass
class GgufSpec:
    """Everything a GGUF file says; write_gguf lays it out, and each field can be set to a lie."""
    kvs: list
    tensors: list
    magic: bytes = b"GGUF"
    version: int = 3
    n_tensors: int = None  # None: the true count
    n_kv: int = None
    layout_alignment: int = 32  # where the writer really puts tensor data

    def copy(self):
        return GgufSpec(list(self.kvs), [Tensor(**vars(t)) for t in self.tensors], self.magic,
                        self.version, self.n_tensors, self.n_kv, self.layout_alignment)

    def set_kv(self, key, t, v):
        """Sets (or adds) a metadata entry."""
        for i, (k, _, _) in enumerate(self.kvs):
            if k == key:
                self.kvs[i] = (key, t, v)
                return
        self.kvs.append((key, t, v))

    def drop_kv(self, key):
        self.kvs = [e for e in self.kvs if e[0] != key]

    def tensor(self, name):
        return next(t for t in self.tensors if t.name == name)


def gguf_bytes(spec):
    a = spec.layout_alignment
    out = bytearray(spec.magic)
    out += struct.pack("<IQQ", spec.version,
                       len(spec.tensors) if spec.n_tensors is None else spec.n_tensors,
                       len(spec.kvs) if spec.n_kv is None else spec.n_kv)
    for key, t, v in spec.kvs:
        if key is None:  # a whole entry written raw
            out += v
            continue
        out += enc_string(key) + struct.pack("<I", t) + enc_value(t, v)
    offsets, pos = [], 0
    for t in spec.tensors:
        offsets.append(pos)
        pos += len(t.data)
        pos += -pos % a
    for t, off in zip(spec.tensors, offsets):
        out += enc_string(t.name)
        out += struct.pack("<I", len(t.dims) if t.n_dims is None else t.n_dims)
        out += b"".join(struct.pack("<Q", d) for d in t.dims)
        out += struct.pack("<IQ", t.ttype, off if t.offset is None else t.offset)
    out += b"\0" * (-len(out) % a)
    for t, off in zip(spec.tensors, offsets):
        out += t.data
        out += b"\0" * (-len(out) % a)
    return bytes(out)


def gguf_layout(spec):
    """(end of the metadata, end of the tensor directory) of the file write_gguf makes."""
    no_dir = GgufSpec(spec.kvs, [], spec.magic, spec.version, len(spec.tensors), spec.n_kv, 1)
    kv_end = len(gguf_bytes(no_dir))
    directory = sum(8 + len(t.name.encode()) + 4 + 8 * len(t.dims) + 12 for t in spec.tensors)
    return kv_end, kv_end + directory


def write_gguf(path, spec):
    with open(path, "wb") as f:
        f.write(gguf_bytes(spec))


def tiled(block, n):
    """n bytes of `block` repeated: random-looking weights, made fast."""
    reps = -(-n // len(block))
    return (block * reps)[:n]


def tensor_bytes(ttype, rows, cols, rng):
    """Random weights of a ggml type: small F16 values, or quantized blocks with sane scales."""
    n = rows * cols
    if ttype == F32:
        return struct.pack(f"<{n}f", *([1.0] * n))  # norms: ones
    if ttype == F16:
        block = struct.pack("<4096e", *(rng.gauss(0, 0.05) for _ in range(4096)))
        return tiled(block, 2 * n)
    if ttype == Q8_0:  # per 32 values: f16 scale, 32 int8
        block = b"".join(struct.pack("<e", 0.002) + bytes(rng.randrange(256) for _ in range(32))
                         for _ in range(64))
        return tiled(block, n // 32 * 34)
    if ttype == Q4_1:  # per 32 values: f16 scale, f16 minimum, 16 bytes of nibbles
        block = b"".join(struct.pack("<ee", 0.01, -0.08) + bytes(rng.randrange(256) for _ in range(16))
                         for _ in range(64))
        return tiled(block, n // 32 * 20)
    raise ValueError(ttype)


def tiny_gguf_spec(tokenizer_kvs, quantized=False):
    """The tiny random model as a GGUF spec, with the default model's tokenizer entries."""
    rng = random.Random(1)
    D, L, H, KV, F, C = (TINY[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "context"))
    hd = D // H
    vocab = len(next(v for k, _, v in tokenizer_kvs if k == "tokenizer.ggml.tokens")[1])
    kvs = [
        ("general.architecture", GT_STR, b"llama"),
        ("general.name", GT_STR, b"hostile-tiny"),
        ("llama.context_length", GT_U32, C),
        ("llama.embedding_length", GT_U32, D),
        ("llama.block_count", GT_U32, L),
        ("llama.feed_forward_length", GT_U32, F),
        ("llama.attention.head_count", GT_U32, H),
        ("llama.attention.head_count_kv", GT_U32, KV),
        ("llama.rope.freq_base", GT_F32, 10000.0),
        ("llama.attention.layer_norm_rms_epsilon", GT_F32, 1e-5),
        ("llama.vocab_size", GT_U32, vocab),
        ("llama.rope.dimension_count", GT_U32, hd),
    ] + list(tokenizer_kvs)
    mat = Q4_1 if quantized else F16
    emb = Q8_0 if quantized else F16

    def t(name, rows, cols, ttype):
        dims = [cols] if rows == 1 else [cols, rows]
        return Tensor(name, dims, ttype, tensor_bytes(ttype, rows, cols, rng))

    tensors = [t("token_embd.weight", vocab, D, emb), t("output_norm.weight", 1, D, F32)]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [
            t(p + "attn_norm.weight", 1, D, F32), t(p + "ffn_norm.weight", 1, D, F32),
            t(p + "attn_q.weight", H * hd, D, mat), t(p + "attn_k.weight", KV * hd, D, mat),
            t(p + "attn_v.weight", KV * hd, D, mat), t(p + "attn_output.weight", D, H * hd, mat),
            t(p + "ffn_gate.weight", F, D, mat), t(p + "ffn_up.weight", F, D, mat),
            t(p + "ffn_down.weight", D, F, mat),
        ]
    return GgufSpec(kvs, tensors)


# --------------------------------------------------------------------------------------------
# HF directories: config.json, model.safetensors, tokenizer.json and its configs.
# --------------------------------------------------------------------------------------------

def hf_tokenizer_json(tokenizer_kvs):
    """An HF tokenizer.json (byte-level BPE) equal to the GGUF vocabulary, as SmolLM2's is."""
    kv = {k: v for k, _, v in tokenizer_kvs}
    tokens = [b.decode("utf-8", "replace") for b in kv["tokenizer.ggml.tokens"][1]]
    types = kv["tokenizer.ggml.token_type"][1]
    merges = [b.decode("utf-8", "replace") for b in kv["tokenizer.ggml.merges"][1]]
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, (tok, ty) in enumerate(zip(tokens, types)) if ty == 3]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": None,
        "decoder": dict(byte_level, add_prefix_space=True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)}, "merges": merges},
    }


def hf_config(vocab):
    D, L, H, KV, F, C = (TINY[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "context"))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
            "num_attention_heads": H, "num_key_value_heads": KV, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": C, "tie_word_embeddings": True}


def hf_tensors(vocab):
    """[(name, dtype, shape, bytes)] of the tiny model in HF names (F16 matrices, F32 norms)."""
    rng = random.Random(2)
    D, L, H, KV, F = (TINY[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn"))
    hd = D // H

    def m(name, rows, cols):
        return (name, "F16", [rows, cols], tensor_bytes(F16, rows, cols, rng))

    def norm(name):
        return (name, "F32", [D], tensor_bytes(F32, 1, D, rng))

    out = [m("model.embed_tokens.weight", vocab, D), norm("model.norm.weight")]
    for i in range(L):
        p = f"model.layers.{i}."
        out += [norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight"),
                m(p + "self_attn.q_proj.weight", H * hd, D), m(p + "self_attn.k_proj.weight", KV * hd, D),
                m(p + "self_attn.v_proj.weight", KV * hd, D), m(p + "self_attn.o_proj.weight", D, H * hd),
                m(p + "mlp.gate_proj.weight", F, D), m(p + "mlp.up_proj.weight", F, D),
                m(p + "mlp.down_proj.weight", D, F)]
    return out


def safetensors_bytes(tensors, header_edit=None):
    """A safetensors file; header_edit(dict) may tamper with the header before it is written."""
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    if header_edit:
        header_edit(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(t[3] for t in tensors)


# --------------------------------------------------------------------------------------------
# Cases and the runner.
# --------------------------------------------------------------------------------------------

@dataclass
class Case:
    cls: str
    name: str
    argv: list  # arguments after the binary (str or bytes)
    expect: str = "either"  # ok | refuse | either | batch | session | sigint | pipe | full | noerr
    names: list = None  # words of which a refusal must name one (case-insensitive); None: no check
    stdin: object = None  # None, ("file", path), ("bytes", data) or "pipe" (driven by steps)
    stdout: object = "capture"  # capture | full | closed | ("head", n)
    stderr: str = "capture"  # capture | closed | full
    steps: list = field(default_factory=list)  # ("sleep", s) ("wait_out", b"x", s) ("write", b)
    # ("close_stdin",) ("sigint",)
    requests: int = None  # non-blank lines of a requests file: output lines expected
    prepare: object = None  # callable making the files the case needs
    sigint_ignored: bool = False  # start with SIGINT ignored (a background job's state)
    repro: str = None  # shell command, made from argv unless given


class Ctx:
    """Paths shared by the cases."""

    def __init__(self, turbo, model, work):
        self.turbo, self.model, self.work = turbo, model, work
        self.tiny = os.path.join(work, "tiny.gguf")
        self.tinyq = os.path.join(work, "tiny-q8q4.gguf")
        self.hf = os.path.join(work, "hf-base")
        self._tok = None
        self._base = None

    def p(self, *parts):
        return os.path.join(self.work, *parts)

    def tokenizer_kvs(self):
        if self._tok is None:
            entries, self.model_kv_end = read_gguf_metadata(self.model)
            self._tok = [e for e in entries if e[0].startswith("tokenizer.")]
        return self._tok

    def base_spec(self):
        if self._base is None:
            self._base = tiny_gguf_spec(self.tokenizer_kvs())
        return self._base

    def ensure_base(self):
        """Makes the tiny models and the HF directory once per work directory."""
        if not os.path.exists(self.tiny):
            write_gguf(self.tiny + ".tmp", self.base_spec())
            os.replace(self.tiny + ".tmp", self.tiny)
        if not os.path.exists(self.tinyq):
            write_gguf(self.tinyq + ".tmp", tiny_gguf_spec(self.tokenizer_kvs(), quantized=True))
            os.replace(self.tinyq + ".tmp", self.tinyq)
        if not os.path.exists(os.path.join(self.hf, "config.json")):
            make_hf_dir(self, self.hf)


def make_hf_dir(ctx, path, config_edit=None, files=None):
    """An HF directory of the tiny model. config_edit(dict) tampers with config.json; `files`
    maps a file name to bytes to write instead (None deletes it). Unchanged large files are hard
    links to the base directory's."""
    os.makedirs(path, exist_ok=True)
    tok = ctx.tokenizer_kvs()
    vocab = len(next(v for k, _, v in tok if k == "tokenizer.ggml.tokens")[1])
    template = next(v for k, _, v in tok if k == "tokenizer.chat_template").decode()
    base = ctx.hf
    for name in os.listdir(path):  # start from an empty directory
        old = os.path.join(path, name)
        shutil.rmtree(old) if os.path.isdir(old) else os.unlink(old)
    cfg = hf_config(vocab)
    if config_edit:
        config_edit(cfg)
    content = {
        # "@@TEXT@@" strings stand for JSON text json.dumps cannot write (1e999).
        "config.json": re.sub(r'"@@(.*?)@@"', r"\1", json.dumps(cfg)).encode(),
        "tokenizer_config.json": json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                             "add_bos_token": False, "chat_template": template}).encode(),
        "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2}).encode(),
    }
    for big in ("model.safetensors", "tokenizer.json"):
        if path != base and os.path.exists(os.path.join(base, big)):
            content[big] = ("link", os.path.join(base, big))
        elif big == "model.safetensors":
            content[big] = safetensors_bytes(hf_tensors(vocab))
        else:
            content[big] = json.dumps(hf_tokenizer_json(tok)).encode()
    for name, data in (files or {}).items():
        content[name] = data
    for name, data in content.items():
        target = os.path.join(path, name)
        if data is None:
            continue
        if isinstance(data, tuple) and data[0] == "link":
            os.link(data[1], target)
        elif isinstance(data, tuple) and data[0] == "dir":
            os.makedirs(target, exist_ok=True)
        else:
            with open(target, "wb") as f:
                f.write(data)


def repro_of(ctx, case):
    """A shell command that runs the case by hand."""
    def sub(a):
        s = a.decode("latin-1") if isinstance(a, bytes) else a
        if isinstance(a, bytes) and any(b >= 0x80 or b < 0x20 for b in a):
            return "$'" + "".join(f"\\x{b:02x}" if b >= 0x80 or b < 0x20 or b in b"'\\" else chr(b)
                                  for b in a) + "'"
        if len(s) > 200:
            return shlex.quote(s[:60]) + f"...({len(s)} chars)"
        q = shlex.quote(s)
        q = q.replace(ctx.model, "$MODEL").replace(ctx.work, "$WORK")
        if "$" in q and q.startswith("'"):
            q = '"' + q[1:-1] + '"'
        return q

    cmd = "$TURBO " + " ".join(sub(a) for a in case.argv)
    if case.sigint_ignored:
        cmd = "(trap '' INT; " + cmd + ")"
    stdin = case.stdin
    if isinstance(stdin, tuple) and stdin[0] == "file":
        cmd += " < " + sub(stdin[1])
    elif isinstance(stdin, tuple) and stdin[0] == "bytes":
        cmd = "printf %s " + sub(stdin[1][:200]) + (" ... " if len(stdin[1]) > 200 else " ") + "| " + cmd
    out = case.stdout
    if out == "full":
        cmd += " > /dev/full"
    elif out == "closed":
        cmd += " >&-"
    elif isinstance(out, tuple):
        cmd += f" | head -c {out[1]}"
    if case.stderr == "closed":
        cmd += " 2>&-"
    elif case.stderr == "full":
        cmd += " 2>/dev/full"
    if case.steps:
        cmd += "   # then: " + ", ".join(
            s[0] if s[0] in ("close_stdin", "sigint") else
            f"{s[0]} {s[1]!r}"[:60] for s in case.steps)
    return cmd


def read_head(path, n):
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


# A small launcher between this script and turbo. The peak resident memory of a child
# (ru_maxrss) includes the address space it had before exec: a child forked from this script
# would report this script's peak. The launcher is a fresh, small process; it forks turbo, waits
# for it and writes turbo's wait status and ru_maxrss to a file. It also sets up what a shell
# would: closed stdout (o) or stderr (e), SIGINT ignored (i), SIGPIPE at its default.
LAUNCHER = r"""
import signal
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for turbo, not for the launcher
import json, os, sys
result, flags, argv = sys.argv[1], sys.argv[2], sys.argv[4:]
pid = os.fork()
if pid == 0:
    try:
        if "o" in flags:
            os.close(1)
        if "e" in flags:
            os.close(2)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN if "i" in flags else signal.SIG_DFL)
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(result, "w") as f:
    json.dump({"status": status, "maxrss_kb": usage.ru_maxrss}, f)
"""


def child_pid(pid):
    """The first child of `pid` (turbo, under the launcher), or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
        return int(kids[0]) if kids else None
    except (OSError, ValueError):
        return None


def run_case(ctx, case, tmp):
    """Runs one case; returns its record (dict)."""
    flags = ("o" if case.stdout == "closed" else "") + ("e" if case.stderr == "closed" else "") \
        + ("i" if case.sigint_ignored else "") or "-"
    result_path = os.path.join(tmp, "result.json")
    argv = [sys.executable, "-c", LAUNCHER, result_path, flags, "--", ctx.turbo] + list(case.argv)

    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    files = []

    def opened(path, mode):
        f = open(path, mode)
        files.append(f)
        return f

    head_r = None
    if case.stdout == "capture":
        stdout = opened(out_path, "wb")
    elif case.stdout == "full":
        stdout = opened("/dev/full", "wb")
    elif case.stdout == "closed":
        stdout = subprocess.DEVNULL
    else:  # ("head", n): a pipe whose reader takes n bytes and goes away
        head_r, stdout = os.pipe()
    stderr = {"capture": lambda: opened(err_path, "wb"), "full": lambda: opened("/dev/full", "wb"),
              "closed": lambda: subprocess.DEVNULL}[case.stderr]()
    stdin = subprocess.DEVNULL
    if isinstance(case.stdin, tuple) and case.stdin[0] == "file":
        stdin = opened(case.stdin[1], "rb")
    elif case.stdin is not None:
        stdin = subprocess.PIPE

    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True,
                            env=CHILD_ENV)
    if head_r is not None:
        os.close(stdout)
    sent = []  # (signal name, seconds after start)
    notes = []
    done = threading.Event()

    def head_reader():
        got = b""
        try:
            while len(got) < case.stdout[1]:
                b = os.read(head_r, case.stdout[1] - len(got))
                if not b:
                    break
                got += b
        finally:
            os.close(head_r)

    def stdout_so_far():
        return read_head(out_path, 1 << 26) if case.stdout == "capture" else b""

    def driver():
        """Feeds stdin and sends signals as the steps say, timed from turbo's start."""
        deadline = time.monotonic() + 10
        while child_pid(proc.pid) is None and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.002)
        try:
            if isinstance(case.stdin, tuple) and case.stdin[0] == "bytes":
                proc.stdin.write(case.stdin[1])
                proc.stdin.close()
            for step in case.steps:
                if done.is_set():
                    return
                kind = step[0]
                if kind == "sleep":
                    done.wait(step[1])
                elif kind in ("wait_out", "wait_err"):
                    deadline = time.monotonic() + step[2]
                    count = step[3] if len(step) > 3 else 1
                    path = out_path if kind == "wait_out" else err_path
                    while not done.is_set():
                        if read_head(path, 1 << 24).count(step[1]) >= count:
                            break
                        if time.monotonic() > deadline:
                            notes.append(f"{kind} {step[1]!r} timed out")
                            break
                        time.sleep(0.05)
                elif kind == "write":
                    proc.stdin.write(step[1])
                    proc.stdin.flush()
                elif kind == "close_stdin":
                    proc.stdin.close()
                elif kind == "sigint":
                    if not done.is_set():
                        os.killpg(proc.pid, signal.SIGINT)
                        sent.append(("SIGINT", round(time.monotonic() - start, 3)))
        except (BrokenPipeError, ValueError, OSError) as e:
            notes.append(f"driver: {type(e).__name__}")

    threads = [threading.Thread(target=driver, daemon=True)]
    if head_r is not None:
        threads.append(threading.Thread(target=head_reader, daemon=True))
    for t in threads:
        t.start()

    timed_out = mem_killed = False
    polled_mb = 0.0  # turbo's VmHWM while it runs: the measure of a run that is killed
    turbo_pid = None
    while True:
        turbo_pid = turbo_pid or child_pid(proc.pid)
        if turbo_pid:
            polled_mb = max(polled_mb, hwm_mb(turbo_pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        over_time = time.monotonic() - start > TIME_LIMIT_S
        over_memory = polled_mb > RSS_KILL_MB
        if (over_time or over_memory) and not (timed_out or mem_killed):
            timed_out, mem_killed = over_time, over_memory and not over_time
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    wall = time.monotonic() - start
    proc.returncode = status  # reaped here: keep Popen from waiting again
    done.set()
    for t in threads:
        t.join(5)
    for f in files:
        f.close()
    if proc.stdin:
        try:
            proc.stdin.close()
        except OSError:
            pass

    peak_mb = polled_mb
    try:  # turbo's own status and peak memory, from the launcher
        with open(result_path) as f:
            launched = json.load(f)
        status = launched["status"]
        peak_mb = max(peak_mb, launched["maxrss_kb"] / 1024)
    except (OSError, ValueError):
        pass  # the launcher was killed with turbo (a run past the time limit)
    rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None
    err = read_head(err_path, STDERR_KEEP) if case.stderr == "capture" else b""
    err_size = os.path.getsize(err_path) if case.stderr == "capture" else 0
    out = stdout_so_far()
    rec = {
        "cls": case.cls, "name": case.name, "repro": case.repro or repro_of(ctx, case),
        "expect": case.expect, "rc": rc, "signal": sig, "wall_s": round(wall, 2),
        "maxrss_mb": round(peak_mb, 1), "timed_out": timed_out, "killed_for_memory": mem_killed,
        "signals_sent": sent, "stderr_bytes": err_size,
        "stderr": err.decode("utf-8", "replace"),
        "stdout_bytes": os.path.getsize(out_path) if case.stdout == "capture" else None,
        "stdout_head": out[:600].decode("utf-8", "replace"), "notes": notes,
        "stderr_captured": case.stderr == "capture",
    }
    if case.requests is not None:
        lines = [l for l in out.split(b"\n") if l.strip()]
        objs = []
        for l in lines:
            try:
                objs.append(json.loads(l))
            except ValueError:
                pass
        rec["requests"] = case.requests
        rec["output_lines"] = len(objs)
        rec["finish_reasons"] = sorted({o.get("finish_reason", "error" if "error" in o else "?")
                                        for o in objs if isinstance(o, dict)})
    return rec


# --------------------------------------------------------------------------------------------
# Judging a run against the targets.
# --------------------------------------------------------------------------------------------

def judge(rec, names):
    """Fills rec["failures"] (a panic, an abort, a signal death, > 2 GB, > 60 s, lost requests),
    rec["refusal_misses"] (a refusal that is not one line naming what was wrong, or an error
    with exit 0), rec["notes"] (expectations that are not targets) and rec["refusal"]."""
    f, q = [], []
    err = rec["stderr"]
    # chat's greeting line is its normal start, not part of a refusal.
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("Chat on ")]
    sent = {s for s, _ in rec["signals_sent"]}
    # A panic prints "panicked" and exits 101; a failed allocation aborts (SIGABRT) after
    # "memory allocation of N bytes failed". Either may print a backtrace (RUST_BACKTRACE=1).
    rec["backtrace"] = "stack backtrace" in err
    if "panicked" in err or rec["rc"] == 101:
        f.append("panic")
    if rec["signal"] == "SIGABRT" or "memory allocation of" in err:
        f.append("abort")
    elif rec["signal"] and not rec["timed_out"] and not rec.get("killed_for_memory"):
        intended = (rec["signal"] == "SIGINT" and "SIGINT" in sent) or \
                   (rec["signal"] == "SIGPIPE" and rec["expect"] == "pipe")
        if not intended:
            f.append(f"signal death ({rec['signal']})")
    if rec.get("killed_for_memory"):
        f.append(f"over 2 GB (killed by the harness at {rec['maxrss_mb']:.0f} MB after {rec['wall_s']} s)")
    elif rec["maxrss_mb"] * 1024 * 1024 > RSS_LIMIT:
        f.append(f"over 2 GB ({rec['maxrss_mb']:.0f} MB)")
    if rec["timed_out"]:
        f.append("over 60 s")
    if rec.get("requests") is not None and rec.get("output_lines") != rec["requests"]:
        # A whole-file refusal (no line at all, non-zero exit, one error line) is not a loss.
        whole_refusal = rec["output_lines"] == 0 and rec["rc"] not in (0, None, 130)
        if not whole_refusal:
            lost = rec["requests"] - rec["output_lines"]
            f.append(f"lost requests ({lost} of {rec['requests']})" if lost > 0
                     else f"extra output lines ({-lost})")
    expect = rec["expect"]
    refusal = None
    # A refusal: a command that ended with a non-zero code of its own (not cut by our signal).
    is_refusal = rec["rc"] not in (0, None, 130) and rec["signal"] is None and not rec["timed_out"] \
        and not rec.get("killed_for_memory")
    if expect in ("batch",) and rec["rc"] == 1 and rec.get("output_lines"):
        is_refusal = False  # some requests failed, each on its own line: not a refusal
    if expect == "session" and rec["rc"] == 0:
        is_refusal = False
    if is_refusal and rec.get("stderr_captured", True) and "panic" not in f:
        errors = [l for l in lines if l.startswith("error")]
        refusal = errors[-1] if errors else (lines[-1] if lines else "")
        rec["refusal"] = refusal
        if not lines:
            q.append("refusal with empty stderr")
        elif len(lines) != 1 and expect not in ("batch", "session"):
            q.append(f"refusal on {len(lines)} lines")
        if names and refusal and not any(n.lower() in err.lower() for n in names):
            q.append("refusal does not name " + " / ".join(names[:3]))
    if rec["rc"] == 0 and expect in ("ok", "refuse", "either") and \
            any(l.startswith("error") for l in lines):
        q.append("error printed with exit 0")
    if expect == "full" and rec["rc"] == 0:
        q.append("write to /dev/full ended with exit 0")
    rec["failures"] = f
    rec["refusal_misses"] = q
    # Expectations that are not targets: noted for a reader.
    n = []
    if refusal and len(refusal) > 300:
        n.append(f"refusal line of {len(refusal)} characters")
    if expect == "ok" and rec["rc"] != 0:
        n.append("expected to run, refused")
    if expect == "refuse" and rec["rc"] == 0:
        n.append("expected a refusal, ran")
    if expect == "pipe" and any("error" in l.lower() for l in lines):
        n.append("closed pipe printed an error")
    if expect == "sigint" and rec["rc"] not in (130, 0) and rec["signal"] != "SIGINT":
        n.append(f"Ctrl-C ended with exit {rec['rc']}")
    rec["notes"] = rec["notes"] + n


# --------------------------------------------------------------------------------------------
# Class 1: sizes from flags.
# --------------------------------------------------------------------------------------------

INT_JUNK = ["-1", "nan", "", "0x10", "2.5", "1e3", " 5", "18446744073709551616",
            "99999999999999999999999999999"]
FLOAT_JUNK = ["nan", "inf", "-inf", "", "-1", "1e400", "0x1p3"]


def flag_words(flag):
    """Ways a message may name a flag: --top-p, top p, top_p."""
    w = flag.strip("-")
    return [flag, w.replace("-", " "), w.replace("-", "_")]


def sizes_cases(ctx):
    T, M = ctx.tiny, ctx.model
    gen = ["generate", "--device", "cpu", "--model", T, "--prompt", "hi", "--max-tokens", "2"]
    reqs = ctx.p("sizes-requests.jsonl")

    def prep_reqs():
        with open(reqs, "w") as f:
            for i in range(4):
                f.write(json.dumps({"prompt": f"request {i}", "max_tokens": 2}) + "\n")

    batch = ["generate", "--device", "cpu", "--model", T, "--prompts-file", reqs]
    out = []

    def add(flag, base, ok, refuse, junk, names=None, either=(), tag="", **kw):
        key = flag.strip("-") + tag
        for v in ok:
            out.append(Case("sizes", f"sizes/{key}={v}", base + [flag, v], "ok", **kw))
        for v in either:
            out.append(Case("sizes", f"sizes/{key}={v}", base + [flag, v], "either",
                            names or flag_words(flag), **kw))
        for v in list(refuse) + list(junk):
            out.append(Case("sizes", f"sizes/{key}={v!s}", base + [flag, v], "refuse",
                            names or flag_words(flag), **kw))

    U = str(U64_MAX)
    add("--block-size", gen, ["1", "1024"], ["0", "1025", "4294967296", U], INT_JUNK,
        ["block size", "block-size"])
    add("--threads", gen, ["1", "2"], ["0", "3", "1024", U], ["-1", "nan", ""], ["threads"])
    add("--context", gen, ["3", "512"], ["0", "2147483648", U], ["-1", "nan", ""], ["context"],
        either=["1", "2", "513", "2147483647"])
    add("--kv-blocks", batch, ["1", "64"], ["0", "4294967295", "4294967296", U], INT_JUNK[:4],
        ["KV blocks", "kv-blocks", "KV"], prepare=prep_reqs)
    add("--kv-blocks", gen, [], [], [], ["KV blocks", "kv-blocks"], either=["1", "4294967295"],
        tag="(generate)")
    add("--kv-cache-gb", batch, ["0.001", "1"], ["0", "1e30", "1e308"], FLOAT_JUNK,
        ["kv-cache-gb", "KV", "GB", "bytes"], either=["1e-9", "5e-324", "20"], prepare=prep_reqs)
    add("--kv-cache-fraction", batch, ["0.5", "1"], ["0", "1.0000001", "2"], FLOAT_JUNK,
        ["fraction"], either=["1e-12", "1e-300"], prepare=prep_reqs)
    add("--kv-alloc-chunk", gen, [], [], INT_JUNK[:3], ["alloc-chunk", "chunk"],
        either=["0", "1", "4294967296", U])
    add("--max-batch", batch, ["1", "65536"], ["0", "65537", U], INT_JUNK[:3], ["batch"],
        prepare=prep_reqs)
    add("--max-batched-tokens", batch, ["1", "65536"], ["0", "65537", U], INT_JUNK[:3],
        ["tokens per step", "batched-tokens", "batched tokens"], prepare=prep_reqs)
    add("--max-tokens", gen[:-2], ["1", "4294967296", U], ["18446744073709551616"], ["-1", "nan"],
        either=["0"])
    add("--max-tokens", batch, [], [], [], either=["0", U], prepare=prep_reqs,
        tag="(prompts-file)")
    # Tensor parallelism on the tiny model (6 heads, 3 KV heads, FFN 192): 1, 3 and 6 split.
    add("--tensor-parallel", gen, ["1", "3", "6"], ["0", "2", "4", "9", "64", "65", U,
                                                   "18446744073709551616"], ["-1", "nan", ""],
        ["tensor-parallel", "ranks", "split"])
    add("--tp", batch, ["3"], ["2", "65"], [], ["tensor-parallel", "ranks", "split"],
        prepare=prep_reqs)
    # The default model (9 heads, 3 KV heads, FFN 1536): 1 and 3 split (9 does not divide the
    # FFN width). `info` and `generate`.
    for v in ["0", "1", "2", "3", "9", "64", "65", U, "18446744073709551616"]:
        ok = v in ("1", "3")
        for flag in ("--tensor-parallel", "--tp"):
            out.append(Case("sizes", f"sizes/default-info{flag}={v}",
                            ["info", "--device", "cpu", "--model", M, flag, v],
                            "ok" if ok else "refuse", ["tensor-parallel", "ranks", "split", "tp"]))
        if v in ("1", "2", "3", "9", "65"):
            out.append(Case("sizes", f"sizes/default-generate--tp={v}",
                            ["generate", "--device", "cpu", "--model", M, "--tp", v, "--prompt",
                             "hi", "--max-tokens", "4"],
                            "ok" if ok else "refuse", ["tensor-parallel", "ranks", "split", "tp"]))
    # KV eviction runs on split models (TP 3 generates what TP 1 does).
    out.append(Case("sizes", "sizes/tp3-with-eviction",
                    gen + ["--tp", "3", "--kv-policy", "window", "--kv-budget", "0.5"], "ok",
                    ["split", "evict", "tensor"]))
    out.append(Case("sizes", "sizes/tp-twice", gen + ["--tp", "3", "--tensor-parallel", "1"],
                    "refuse", ["tensor-parallel", "tp"]))
    # Sampling numbers.
    for flag, vals in [("--temperature", ["-1", "nan", "inf", "1e38", "0"]),
                       ("--top-p", ["nan", "2", "-1", "0"]),
                       ("--top-k", [U, "0", "4294967296"]),
                       ("--min-p", ["nan", "1.5", "1"]),
                       ("--repetition-penalty", ["0", "nan", "inf", "1e-45"]),
                       ("--frequency-penalty", ["3", "-3", "nan"]),
                       ("--presence-penalty", ["inf", "2"]),
                       ("--seed", [U, "18446744073709551616"])]:
        for v in vals:
            out.append(Case("sizes", f"sizes/{flag.strip('-')}={v}", gen + [flag, v], "either",
                            flag_words(flag)))
    # KV eviction numbers.
    ev = gen[:-1] + ["8"]
    for flag, vals, pol in [("--kv-budget", ["nan", "-1", "0", "1", "2", "inf", "1e-300"], "window"),
                            ("--kv-budget-tokens", ["0", "1", U], "h2o"),
                            ("--kv-recent", ["nan", "2", "-0.1", "1"], "keyformer"),
                            ("--kv-sinks", [U, "0"], "sink"),
                            ("--keyformer-tau", ["1:", ":", "nan:2", "inf:inf", "0:0", "-1:2",
                                                 "1:2:3", "2"], "keyformer")]:
        for v in vals:
            budget = [] if flag.startswith("--kv-budget") else ["--kv-budget", "0.5"]
            out.append(Case("sizes", f"sizes/{flag.strip('-')}={v}",
                            ev + ["--kv-policy", pol] + budget + [flag, v], "either",
                            flag_words(flag) + ["budget", "tau", "recent", "Keyformer"]))
    # bench (a small base: 16 prompt tokens, 4 generated, 1 repeat).
    bench = ["bench", "--device", "cpu", "--model", T]
    small = ["--prompt-tokens", "16", "--gen-tokens", "4", "--repeats", "1"]

    def b(name, args, expect="either", names=None):
        out.append(Case("sizes", f"sizes/bench/{name}", bench + args, expect, names))

    for v in ["0", "1001", U]:
        b(f"repeats={v}", ["--prompt-tokens", "16", "--gen-tokens", "4", "--repeats", v],
          "refuse", ["repeats"])
    b("repeats=1000", ["--prompt-tokens", "1", "--gen-tokens", "1", "--repeats", "1000"], "ok")
    for v in ["0", "1", "509", "512", "513", U]:
        b(f"prompt-tokens={v}", ["--prompt-tokens", v, "--gen-tokens", "2", "--repeats", "1"],
          "either", ["--prompt-tokens", "prompt", "context"])
    for v in ["0", "1", "600", U]:
        b(f"gen-tokens={v}", ["--prompt-tokens", "8", "--gen-tokens", v, "--repeats", "1"],
          "either", ["gen", "context", "tokens"])
    for v in ["0", "500", "512", U]:
        b(f"decode-context={v}", small + ["--decode-context", v], "either", ["context"])
    for v in ["0", "1", "3", "1000000000", U]:
        b(f"multi-round={v}", ["--multi-round", v, "--user-tokens", "8", "--gen-tokens", "2",
                               "--repeats", "1"], "either", ["round", "context"])
    for v in ["0", U]:
        b(f"user-tokens={v}", ["--multi-round", "2", "--user-tokens", v, "--gen-tokens", "2",
                               "--repeats", "1"], "either", ["user", "context", "round"])
    for v in ["0", "1", "4", "65537", U]:
        b(f"shared-prefix={v}", ["--shared-prefix", v, "--prefix-tokens", "8", "--user-tokens",
                                 "4", "--gen-tokens", "2"], "either", ["request", "context", "prefix"])
    for v in ["0", "600", U]:
        b(f"prefix-tokens={v}", ["--shared-prefix", "2", "--prefix-tokens", v, "--user-tokens", "4",
                                 "--gen-tokens", "2"], "either", ["prefix", "context"])
    b("shared-prefix-kv-blocks=1", ["--shared-prefix", "8", "--prefix-tokens", "40",
                                    "--user-tokens", "4", "--gen-tokens", "2", "--kv-blocks", "1"],
      "either", ["KV", "block"])
    b("multi-round-kv-blocks=1", ["--multi-round", "3", "--user-tokens", "30", "--gen-tokens", "4",
                                  "--repeats", "1", "--kv-blocks", "1"], "either", ["KV", "block"])
    # `bench serve` is a client: its numbers, against a loopback port where nothing listens.
    for args in (["--requests", "0"], ["--requests", "1"], ["--requests", "100000000"],
                 ["--requests", "4294967296"], ["--requests", U], ["--rate", "nan"],
                 ["--rate", "-1"], ["--rate", "0"], ["--max-concurrency", "0"],
                 ["--mean-in", "100000000", "--requests", "1"],
                 ["--mean-in", "1000000000000", "--requests", "1"],
                 ["--mean-in", U, "--requests", "1"], ["--mean-out", U, "--requests", "1"],
                 ["--timeout", "nan", "--requests", "1"], ["--timeout", "0", "--requests", "1"],
                 ["--url", "not a url", "--requests", "1"],
                 ["--url", "http://127.0.0.1:1/" + "a" * 5000, "--requests", "1"],
                 ["--prompts-file", "/dev/zero", "--requests", "1"]):
        bs = ["bench", "serve"] + ([] if "--url" in args else ["--url", "http://127.0.0.1:1"]) \
            + ([] if "--timeout" in args else ["--timeout", "5"])
        out.append(Case("sizes", "sizes/bench-serve/" + "=".join(args[:2])[:40], bs + args, "either",
                        ["request", "rate", "concurrency", "mean", "url", "connect", "timeout",
                         "prompts", "127.0.0.1"]))
    # `serve` flags: a refusal, or a server (on 127.0.0.1) that starts and stops on Ctrl-C.
    serve = ["serve", "--device", "cpu", "--model", T, "--host", "127.0.0.1"]
    for args in (["--port", "0"], ["--port", "65536"], ["--port", U], ["--port", "1"],
                 ["--max-pending", "0"], ["--max-pending", U], ["--max-body-bytes", "0"],
                 ["--max-body-bytes", U], ["--max-queue-wait", "nan"], ["--max-queue-wait", U],
                 ["--shutdown-timeout", U], ["--shutdown-timeout", "nan"], ["--max-batch", "0"],
                 ["--max-batched-tokens", "65537"], ["--kv-blocks", "0"],
                 ["--served-model-name", ""], ["--api-key", ""], ["--host", "not-an-address"]):
        base = serve if "--host" not in args else serve[:-2]
        port = [] if "--port" in args else ["--port", "0"]
        out.append(Case("sizes", "sizes/serve/" + "=".join(args)[:40], base + port + args, "either",
                        flag_words(args[0]) + ["port", "address", "tokens per step"],
                        steps=[("sleep", 3), ("sigint",)]))
    # eval-kv budgets and counts.
    text = ctx.p("eval-text.txt")

    def prep_text():
        words = "the quick brown fox jumps over the lazy dog and runs far away".split()
        rng = random.Random(3)
        with open(text, "w") as f:
            f.write(" ".join(rng.choice(words) for _ in range(3000)))

    ev_cmd = ["eval-kv", "--device", "cpu", "--model", T, "--text", text]
    ev_base = ev_cmd + ["--prompt-tokens", "64", "--eval-tokens", "8", "--policies", "window"]
    for v in ["0", "-0.5", "nan", "inf", "1", "1.5", "", ",", "0.5,,0.5", "1e-300", "0.5x",
              ",".join(["0.5"] * 50)]:
        out.append(Case("sizes", f"sizes/eval-kv/budgets={v[:20]}", ev_base + ["--budgets", v],
                        "either", ["budget"], prepare=prep_text))
    for flag, vals in [("--prompt-tokens", ["0", "1", "500", U]), ("--eval-tokens", ["0", U]),
                       ("--max-batch", ["0", "65537"]),
                       ("--policies", ["", "bogus", "full", ",".join(["window"] * 50)])]:
        rest = {"--prompt-tokens": ["--prompt-tokens", "64"], "--eval-tokens": ["--eval-tokens", "8"],
                "--policies": ["--policies", "window"]}
        args = ev_cmd + [x for k, kv in rest.items() if k != flag for x in kv]
        for v in vals:
            out.append(Case("sizes", f"sizes/eval-kv/{flag.strip('-')}={v[:20]}",
                            args + [flag, v], "either",
                            flag_words(flag) + ["batch", "context", "polic"], prepare=prep_text))
    return out


# --------------------------------------------------------------------------------------------
# Class 2: model files.
# --------------------------------------------------------------------------------------------

def model_cases(ctx):
    out = []
    gdir = ctx.p("gguf")
    hdir = ctx.p("hf")

    def both(name, path, prepare, names=None):
        """`info` and `generate` on the same model file."""
        for cmd in ("info", "generate"):
            args = [cmd, "--device", "cpu", "--model", path]
            if cmd == "generate":
                args += ["--prompt", "Hello", "--max-tokens", "3"]
            out.append(Case("models", f"models/{name}/{cmd}", args, "either",
                            names if names is not None else None, prepare=prepare))

    def gguf_case(name, edit, names=None):
        path = os.path.join(gdir, name + ".gguf")

        def prepare():
            os.makedirs(gdir, exist_ok=True)
            spec = ctx.base_spec().copy()
            result = edit(spec)
            data = result if isinstance(result, (bytes, bytearray)) else gguf_bytes(spec)
            with open(path, "wb") as f:
                f.write(data)

        both(name, path, prepare, names)

    # Header fields.
    def setattr_edit(attr, v):
        def e(s):
            setattr(s, attr, v)
        return e

    for magic in (b"GGUX", b"\0\0\0\0", b"FUGG"):
        gguf_case(f"magic-{magic.hex()}", setattr_edit("magic", magic), ["GGUF", "magic"])
    for v in (0, 1, 2, 4, 0xFFFFFFFF):
        gguf_case(f"version-{v}", setattr_edit("version", v), ["version"])
    for v in (0, 30, 2**32, 2**63, U64_MAX):
        gguf_case(f"tensor-count-{v}", setattr_edit("n_tensors", v))
    for v in (0, 10, 2**63, U64_MAX):
        gguf_case(f"kv-count-{v}", setattr_edit("n_kv", v))
    for n in (0, 1, 4, 24):
        gguf_case(f"prefix-{n}-bytes", lambda s, n=n: gguf_bytes(s)[:n])

    # Metadata dimensions at extreme values (and of the wrong type).
    dims = ["context_length", "embedding_length", "block_count", "feed_forward_length",
            "attention.head_count", "attention.head_count_kv", "attention.key_length",
            "attention.value_length", "rope.dimension_count", "vocab_size"]
    values = [(GT_U32, 0), (GT_U32, 1), (GT_U32, 2**31), (GT_U32, 2**32 - 1), (GT_U64, U64_MAX),
              (GT_I32, -1), (GT_STR, b"12")]
    for k in dims:
        for t, v in values:
            label = v.decode() if isinstance(v, bytes) else v
            gguf_case(f"{k}-{t}-{label}", lambda s, k=k, t=t, v=v: s.set_kv(f"llama.{k}", t, v),
                      [k, "llama.", "model"])
    # Floats.
    for k, vals in [("attention.layer_norm_rms_epsilon", [float("nan"), float("inf"), -1.0, 0.0, 3e38]),
                    ("rope.freq_base", [float("nan"), 0.0, -1.0, float("inf"), 1e-45, 3.4e38])]:
        for v in vals:
            gguf_case(f"{k}-{v}", lambda s, k=k, v=v: s.set_kv(f"llama.{k}", GT_F32, v),
                      [k, "epsilon", "theta", "rope", "eps"])
    for v in [float("nan"), 0.0, -1.0, float("inf"), 3e38]:
        def e(s, v=v):
            s.set_kv("llama.rope.scaling.type", GT_STR, b"linear")
            s.set_kv("llama.rope.scaling.factor", GT_F32, v)
        gguf_case(f"rope-linear-factor-{v}", e, ["scaling", "factor", "rope"])
    gguf_case("rope-scaling-yarn", lambda s: s.set_kv("llama.rope.scaling.type", GT_STR, b"yarn"),
              ["yarn", "scaling"])
    gguf_case("architecture-gpt2", lambda s: s.set_kv("general.architecture", GT_STR, b"gpt2"),
              ["architecture", "gpt2"])
    gguf_case("architecture-missing", lambda s: s.drop_kv("general.architecture"), ["architecture"])
    for v in (0, 1, 3, 7, 2**31, 2**32 - 1):
        gguf_case(f"alignment-{v}", lambda s, v=v: s.set_kv("general.alignment", GT_U32, v),
                  ["alignment", "offset", "align"])
    gguf_case("alignment-string", lambda s: s.set_kv("general.alignment", GT_STR, b"32"),
              ["alignment"])

    # The tokenizer's entries.
    def tok_edit(key, t, v):
        return lambda s: s.set_kv(key, t, v)

    gguf_case("tokens-empty", tok_edit("tokenizer.ggml.tokens", GT_ARR, (GT_STR, [])), ["token"])
    gguf_case("tokens-count-lie", tok_edit("tokenizer.ggml.tokens", GT_ARR,
                                           Raw(struct.pack("<IQ", GT_STR, 2**62))), None)
    gguf_case("tokens-invalid-utf8", lambda s: s.set_kv("tokenizer.ggml.tokens", GT_ARR, (
        GT_STR, [b"\xff\xfe" + bytes([i % 256]) if i == 300 else x for i, x in
                 enumerate(dict((k, v) for k, _, v in s.kvs)["tokenizer.ggml.tokens"][1])])), None)
    gguf_case("token-type-short", tok_edit("tokenizer.ggml.token_type", GT_ARR, (GT_I32, [1] * 10)),
              ["token_type", "token type", "token"])
    gguf_case("merges-garbage", tok_edit("tokenizer.ggml.merges", GT_ARR,
                                         (GT_STR, [b"a", b"", b"x y z", b"\xff \xfe"])), ["merge"])
    gguf_case("merges-missing", lambda s: s.drop_kv("tokenizer.ggml.merges"), ["merge"])
    gguf_case("bos-id-max", tok_edit("tokenizer.ggml.bos_token_id", GT_U32, 2**32 - 1),
              ["bos", "token", "id"])
    gguf_case("eos-id-vocab", tok_edit("tokenizer.ggml.eos_token_id", GT_U32, 49152),
              ["eos", "token", "id"])
    gguf_case("eos-id-string", tok_edit("tokenizer.ggml.eos_token_id", GT_STR, b"2"), ["eos"])
    for m in (b"llama", b"bert", b""):
        gguf_case(f"tokenizer-model-{m.decode() or 'empty'}",
                  tok_edit("tokenizer.ggml.model", GT_STR, m), ["tokenizer", "model"])
    gguf_case("tokenizer-pre-unknown", tok_edit("tokenizer.ggml.pre", GT_STR, b"qwerty"),
              ["pre", "tokenizer"])
    for name, tpl in [("invalid", b"{% for %}"),
                      ("loop", b"{% for i in range(1000000000) %}{{ i }}{% endfor %}"),
                      ("huge-output", b"{{ 'x' * 100000000 }}"),
                      ("raise", b"{{ raise_exception('hostile') }}"),
                      ("1mb", b"{# " + b"x" * (1 << 20) + b" #}{{ messages[0]['content'] }}")]:
        spec_edit = tok_edit("tokenizer.chat_template", GT_STR, tpl)
        path = os.path.join(gdir, f"template-{name}.gguf")

        def prepare(spec_edit=spec_edit, path=path):
            os.makedirs(gdir, exist_ok=True)
            s = ctx.base_spec().copy()
            spec_edit(s)
            write_gguf(path, s)

        for cmd in (["info"], ["generate", "--chat", "--prompt", "hi", "--max-tokens", "2"]):
            out.append(Case("models", f"models/template-{name}/{cmd[0]}",
                            [cmd[0], "--device", "cpu", "--model", path] + cmd[1:], "either",
                            ["template"], prepare=prepare))

    # Lengths and types that lie.
    gguf_case("key-length-max", lambda s: s.kvs.insert(0, (None, 0, struct.pack("<Q", U64_MAX))))
    gguf_case("string-length-2^63", tok_edit("general.name", GT_STR, Raw(struct.pack("<Q", 2**63))))
    gguf_case("array-count-max", tok_edit("general.tags", GT_ARR, Raw(struct.pack("<IQ", GT_U8, U64_MAX))))
    gguf_case("array-type-99", tok_edit("general.tags", GT_ARR, Raw(struct.pack("<IQ", 99, 4) + b"\0" * 16)))
    gguf_case("value-type-99", lambda s: s.kvs.insert(1, (None, 0, enc_string("x.y") + struct.pack("<I", 99))))
    gguf_case("nested-arrays-10000", tok_edit("general.tags", GT_ARR, Raw(
        struct.pack("<IQ", GT_ARR, 1) * 10000 + struct.pack("<IQ", GT_U8, 0))))

    # The tensor directory.
    def t_set(tensor_name, **kw):
        return lambda s: [setattr(s.tensor(tensor_name), k, v) for k, v in kw.items()]

    q0 = "blk.0.attn_q.weight"
    for n in (0, 1, 5, 2**32 - 1):
        gguf_case(f"tensor-ndims-{n}", t_set(q0, n_dims=n), None)
    gguf_case("tensor-dim-0", t_set(q0, dims=[96, 0]), None)
    gguf_case("tensor-dim-2^63", t_set(q0, dims=[96, 2**63]), None)
    gguf_case("tensor-dims-overflow", t_set(q0, dims=[2**32, 2**32]), None)
    gguf_case("tensor-3d", t_set(q0, dims=[96, 96, 2]), None)
    gguf_case("tensor-type-99", t_set(q0, ttype=99), None)
    gguf_case("tensor-type-q4_1-cols-95", t_set(q0, dims=[95, 96], ttype=Q4_1), None)
    gguf_case("tensor-type-f32-short", t_set(q0, ttype=F32), None)
    gguf_case("tensor-offset-past-end", t_set(q0, offset=1 << 40), None)
    gguf_case("tensor-offset-unaligned", t_set(q0, offset=1), None)
    gguf_case("tensor-offset-max", t_set(q0, offset=U64_MAX - 7), None)
    gguf_case("tensor-offsets-overlap", t_set(q0, offset=0), None)
    gguf_case("tensor-duplicate", lambda s: s.tensors.append(Tensor(**vars(s.tensor(q0)))), None)
    gguf_case("tensor-missing", lambda s: s.tensors.remove(s.tensor("blk.1.attn_k.weight")),
              ["blk.1.attn_k", "attn_k", "k_proj", "missing"])
    gguf_case("tensor-extra-layer", lambda s: s.tensors.append(
        Tensor("blk.7.attn_q.weight", [96, 96], F16, b"\0" * 96 * 96 * 2)), None)
    gguf_case("embedding-rows-100", t_set("token_embd.weight", dims=[96, 100],
                                         data=b"\0" * 96 * 100 * 2), None)
    gguf_case("tensor-name-empty", t_set(q0, name=""), None)
    gguf_case("tensor-name-1mb", t_set(q0, name="n" * (1 << 20)), None)
    gguf_case("embedding-vocab-mismatch", lambda s: s.set_kv("llama.vocab_size", GT_U32, 1000),
              ["vocab"])

    # Byte flips: in the header and directory (where a flip changes meaning) and anywhere.
    kv_end, dir_end = gguf_layout(ctx.base_spec())  # the tokenizer makes most of the metadata

    def flips(seed, count, lo, hi, base_path):
        def e(_s):
            rng = random.Random(seed)
            with open(base_path, "rb") as f:
                data = bytearray(f.read())
            for _ in range(count):
                i = rng.randrange(lo, min(hi, len(data)))
                data[i] ^= 1 << rng.randrange(8)
            return bytes(data)
        return e

    for seed in range(24):
        count = (1, 4, 32)[seed % 3]
        lo, hi = ((0, 64), (0, kv_end), (kv_end, dir_end), (0, 1 << 40))[seed % 4]
        gguf_case(f"flip-{seed}-{count}x-{lo}-{hi if hi < 1 << 40 else 'end'}",
                  flips(seed, count, lo, hi, ctx.tiny))
    for seed in range(6):  # the quantized copy: flips in its scales and quants
        gguf_case(f"q-flip-{seed}-64x-data", flips(100 + seed, 64, dir_end, 1 << 40, ctx.tinyq))

    # Truncations of the tiny model.
    def cut(n_or_frac, base_path=None):
        def e(s):
            data = gguf_bytes(s) if base_path is None else open(base_path, "rb").read()
            n = n_or_frac if isinstance(n_or_frac, int) else int(len(data) * n_or_frac)
            return data[:n] if n >= 0 else data[:len(data) + n]
        return e

    for n in (8, 16, 23, 100, 1000, 1_000_000, kv_end - 1, dir_end - 10, dir_end + 100, 0.5, 0.9, -1):
        gguf_case(f"truncated-{n}", cut(n))

    # The default model itself: flips and truncations of a copy (98 MB).
    def default_copy(name, edit):
        path = ctx.p("gguf", name + ".gguf")

        def prepare():
            os.makedirs(gdir, exist_ok=True)
            data = bytearray(open(ctx.model, "rb").read())
            edit(data)
            with open(path, "wb") as f:
                f.write(data)

        both(name, path, prepare)

    def flip_default(seed, lo, hi, count):
        def e(data):
            rng = random.Random(seed)
            for _ in range(count):
                i = rng.randrange(lo, min(hi, len(data)))
                data[i] ^= 1 << rng.randrange(8)
        return e

    default_copy("default-flip-header", flip_default(7, 0, 4096, 8))
    ctx.tokenizer_kvs()  # reads the default model's metadata end
    default_copy("default-flip-directory", flip_default(8, ctx.model_kv_end, ctx.model_kv_end + 13000, 16))
    default_copy("default-flip-data", flip_default(9, 2_000_000, 1 << 40, 256))
    default_copy("default-truncated-half", lambda d: d.__delitem__(slice(len(d) // 2, None)))
    default_copy("default-truncated-last", lambda d: d.__delitem__(slice(len(d) - 1, None)))

    # HF directories.
    def hf_case(name, config_edit=None, files=None, names=None):
        path = os.path.join(hdir, name)

        def prepare():
            os.makedirs(hdir, exist_ok=True)
            resolved = files() if callable(files) else files
            make_hf_dir(ctx, path, config_edit, resolved)

        both("hf-" + name, path, prepare, names)
        return prepare

    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"]
    for k in keys:
        for v, label in [(0, "0"), (-1, "-1"), (2**64, "2^64"), (1e300, "1e300"), ("12", "string"),
                         (2**40, "2^40")]:
            hf_case(f"{k}-{label}", lambda c, k=k, v=v: c.__setitem__(k, v), names=[k, "config"])
    raw_cfg = lambda text: (lambda: {"config.json": text})
    for label, text in [("nan", b'{"rms_norm_eps": NaN}'), ("empty", b""), ("open-brace", b"{"),
                        ("array", b"[]"), ("deep", b"[" * 100000 + b"]" * 100000),
                        ("10mb-spaces", b" " * 10_000_000 + b"{}"), ("invalid-utf8", b'{"\xff": 1}')]:
        hf_case(f"config-{label}", files=raw_cfg(text), names=["config"])
    for k, vals in [("rms_norm_eps", [-1, 0, 1e-60, "@@1e999@@"]), ("rope_theta", [0, -1, "@@1e999@@", 1e-320])]:
        for v in vals:
            hf_case(f"{k}-{v}", lambda c, k=k, v=v: c.__setitem__(k, v), names=[k, "config"])
    for label, scaling in [("linear-0", {"type": "linear", "factor": 0}),
                           ("linear-neg", {"type": "linear", "factor": -1}),
                           ("linear-1e308", {"type": "linear", "factor": 1e308}),
                           ("yarn", {"type": "yarn", "factor": 4}),
                           ("llama3-equal-freqs", {"rope_type": "llama3", "factor": 8,
                                                   "low_freq_factor": 1, "high_freq_factor": 1,
                                                   "original_max_position_embeddings": 8192}),
                           ("llama3-zero", {"rope_type": "llama3", "factor": 0,
                                            "low_freq_factor": 0, "high_freq_factor": 0,
                                            "original_max_position_embeddings": 0}),
                           ("string", "linear")]:
        hf_case(f"rope-scaling-{label}", lambda c, s=scaling: c.__setitem__("rope_scaling", s),
                names=["rope", "scaling", "factor", "config"])
    hf_case("rope-parameters-nan-like", lambda c: c.__setitem__(
        "rope_parameters", {"rope_theta": -5, "rope_type": "default"}), names=["rope", "theta", "config"])
    hf_case("architecture-gpt2", lambda c: (c.__setitem__("architectures", ["GPT2LMHeadModel"]),
                                            c.__setitem__("model_type", "gpt2")), names=["llama", "gpt2"])
    hf_case("tie-string", lambda c: c.__setitem__("tie_word_embeddings", "yes"), names=["tie", "config"])
    hf_case("untied-no-lm-head", lambda c: c.__setitem__("tie_word_embeddings", False),
            names=["lm_head", "missing"])
    # Files missing or broken.

    def st(header_edit=None, drop=None, mangle=None):
        def files():
            vocab = len(next(v for k, _, v in ctx.tokenizer_kvs() if k == "tokenizer.ggml.tokens")[1])
            ts = hf_tensors(vocab)
            if drop:
                ts = [t for t in ts if t[0] != drop]
            data = safetensors_bytes(ts, header_edit)
            return {"model.safetensors": mangle(data) if mangle else data}
        return files

    hf_case("no-config", files={"config.json": None}, names=["config", "not a model"])
    hf_case("no-safetensors", files={"model.safetensors": None}, names=["safetensors"])
    hf_case("no-tokenizer", files={"tokenizer.json": None}, names=["tokenizer"])
    hf_case("tokenizer-empty", files={"tokenizer.json": b""}, names=["tokenizer"])
    hf_case("tokenizer-{}", files={"tokenizer.json": b"{}"}, names=["tokenizer"])
    hf_case("tokenizer-no-merges", files=lambda: {"tokenizer.json": json.dumps(
        dict(hf_tokenizer_json(ctx.tokenizer_kvs()),
             model=dict(hf_tokenizer_json(ctx.tokenizer_kvs())["model"], merges=[]))).encode()},
            names=["merges", "tokenizer"])
    hf_case("tokenizer-config-eos-unknown", files={"tokenizer_config.json": json.dumps(
        {"eos_token": "<|no-such-token|>"}).encode()}, names=["eos", "token"])
    for v in (2**40, -1, "x"):
        hf_case(f"generation-config-eos-{v}", files={"generation_config.json": json.dumps(
            {"eos_token_id": v}).encode()}, names=["eos"])
    hf_case("safetensors-empty", files={"model.safetensors": b""}, names=["safetensors"])
    hf_case("safetensors-header-len-max", files={"model.safetensors": struct.pack("<Q", U64_MAX)},
            names=["safetensors", "header"])
    hf_case("safetensors-header-past-end", files={"model.safetensors": struct.pack("<Q", 1000) + b"{}"},
            names=["safetensors", "header"])
    hf_case("safetensors-header-not-json", files={"model.safetensors": struct.pack("<Q", 8) + b"not json"},
            names=["safetensors", "header"])
    for dtype in ("F8_E4M3", "I64", "BOOL", "Q4"):
        hf_case(f"safetensors-dtype-{dtype}", files=st(
            lambda h, d=dtype: h["model.layers.0.self_attn.q_proj.weight"].__setitem__("dtype", d)))
    hf_case("safetensors-offsets-reversed", files=st(
        lambda h: h["model.norm.weight"].__setitem__("data_offsets", list(reversed(h["model.norm.weight"]["data_offsets"])))))
    hf_case("safetensors-offsets-past-end", files=st(
        lambda h: h["model.norm.weight"].__setitem__("data_offsets", [0, 2**62])))
    hf_case("safetensors-shape-mismatch", files=st(
        lambda h: h["model.norm.weight"].__setitem__("shape", [97])))
    hf_case("safetensors-shape-overflow", files=st(
        lambda h: h["model.norm.weight"].__setitem__("shape", [2**32, 2**32, 2**32])))
    hf_case("safetensors-q-proj-shape", files=st(
        lambda h: h["model.layers.0.self_attn.q_proj.weight"].__setitem__("shape", [48, 192])))
    hf_case("safetensors-missing-tensor", files=st(drop="model.layers.1.mlp.down_proj.weight"),
            names=["down_proj", "missing"])
    hf_case("safetensors-truncated", files=st(mangle=lambda d: d[:len(d) // 2]), names=["safetensors"])
    hf_case("safetensors-duplicate-file", files=lambda: {"z-second.safetensors": ("link", os.path.join(ctx.hf, "model.safetensors"))})
    hf_case("config-is-directory", files={"config.json": ("dir",)}, names=["config"])
    hf_case("safetensors-is-directory", files={"model.safetensors": ("dir",)}, names=["safetensors"])
    for label, tpl in [("invalid", b"{% if %}"), ("loop", b"{% for i in range(10**9) %}x{% endfor %}"),
                       ("huge", b"{{ 'ab' * 50000000 }}"), ("empty", b"")]:
        prep = hf_case(f"chat-template-{label}", files={"chat_template.jinja": tpl}, names=["template"])
        # A chat through it too (generate --chat renders the template).
        path = os.path.join(hdir, f"chat-template-{label}")
        out.append(Case("models", f"models/hf-chat-template-{label}/generate-chat",
                        ["generate", "--device", "cpu", "--model", path, "--chat", "--prompt", "hi",
                         "--max-tokens", "2"], "either", ["template"], prepare=prep))
    return out


# --------------------------------------------------------------------------------------------
# Class 3: text inputs.
# --------------------------------------------------------------------------------------------

def text_cases(ctx):
    T, M = ctx.tiny, ctx.model
    out = []
    gen = ["generate", "--device", "cpu", "--model", T, "--max-tokens", "2"]
    files = {
        "20mb-ascii.txt": lambda: b"hello world " * (20_000_000 // 12),
        "20mb-random.bin": lambda: random.Random(5).randbytes(20_000_000),
        "invalid-utf8.txt": lambda: b"\xff\xfehello",
        "cut-utf8.txt": lambda: "caf\u00e9".encode()[:-1],
        "nul-100.txt": lambda: b"\0" * 100,
        "empty.txt": lambda: b"",
        "600-words.txt": lambda: b"word " * 600,
        "specials.txt": lambda: b"<|im_start|>" * 2000,
        "jinja.txt": lambda: b"{{ raise_exception('x') }} {% for %}",
    }

    def prep(name):
        def p():
            path = ctx.p("text", name)
            if not os.path.exists(path):
                os.makedirs(ctx.p("text"), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(files[name]())
        return p

    for name in files:
        for chat in ([], ["--chat"]):
            label = name + ("-chat" if chat else "")
            out.append(Case("text", f"text/prompt-file-{label}",
                            gen + chat + ["--prompt-file", ctx.p("text", name)], "either",
                            ["prompt", "UTF-8", "context", "longer", name], prepare=prep(name)))
    out.append(Case("text", "text/prompt-file-20mb-default-model",
                    ["generate", "--device", "cpu", "--model", M, "--max-tokens", "2",
                     "--prompt-file", ctx.p("text", "20mb-ascii.txt")], "refuse",
                    ["prompt", "longer", "context"], prepare=prep("20mb-ascii.txt")))
    for src in ("/dev/zero", "/dev/null", "/dev/urandom", "/nonexistent/file", "/tmp"):
        out.append(Case("text", f"text/prompt-file-{src}", gen + ["--prompt-file", src], "either",
                        ["prompt", src, "longer", "UTF-8", "directory"]))
    ev = ["eval-kv", "--device", "cpu", "--model", T, "--prompt-tokens", "64", "--eval-tokens", "8",
          "--policies", "window", "--budgets", "0.5"]
    for name in ("/dev/zero", "20mb-random.bin", "invalid-utf8.txt", "empty.txt"):
        path = name if name.startswith("/") else ctx.p("text", name)
        out.append(Case("text", f"text/eval-kv-text-{name}", ev + ["--text", path], "either",
                        ["text", name, "UTF-8", "tokens", "longer", "context"],
                        prepare=None if name.startswith("/") else prep(name)))
    for name, data in (("garbage", b"{not json\n\xff\n"), ("wrong-fields", b'{"policy": 3}\n'),
                       ("empty", b"")):
        path = ctx.p("text", f"from-json-{name}.jsonl")

        def prep_json(path=path, data=data):
            os.makedirs(ctx.p("text"), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

        out.append(Case("text", f"text/eval-kv-from-json-{name}", ["eval-kv", "--from-json", path],
                        "either", ["json", path, "line", "row"], prepare=prep_json))
    out.append(Case("text", "text/eval-kv-from-json-dev-zero", ["eval-kv", "--from-json", "/dev/zero"],
                    "either", ["json", "/dev/zero", "longer", "line"]))
    out.append(Case("text", "text/eval-kv-plot-bad-path", ev + ["--text", ctx.p("text", "600-words.txt"),
                                                                "--plot", "/nonexistent/dir/x.png"],
                    "refuse", ["plot", "/nonexistent"], prepare=prep("600-words.txt")))
    out.append(Case("text", "text/prompt-and-prompt-file", gen + ["--prompt", "x", "--prompt-file",
                                                                  "/dev/null"], "either", ["prompt"]))
    out.append(Case("text", "text/prompt-invalid-utf8-argv", gen + ["--prompt", b"\xff\xfe hi"],
                    "either", ["prompt", "UTF-8"]))
    out.append(Case("text", "text/prompt-empty", gen + ["--prompt", ""], "either", ["prompt", "empty"]))
    out.append(Case("text", "text/prompt-100kb-argv", gen + ["--prompt", "a " * 50000], "refuse",
                    ["prompt", "context"]))
    out.append(Case("text", "text/stop-invalid-utf8", gen + ["--prompt", "hi", "--stop", b"\xff"],
                    "either", ["stop", "UTF-8"]))
    out.append(Case("text", "text/stop-empty", gen + ["--prompt", "hi", "--stop", ""], "either", ["stop"]))
    many_stops = []
    for i in range(1000):
        many_stops += ["--stop", f"s{i}"]
    out.append(Case("text", "text/stop-x1000", gen + ["--prompt", "hi"] + many_stops, "ok"))
    # Chat on stdin.
    chat = ["chat", "--device", "cpu", "--model", T]

    def chat_case(name, data, extra=("--max-tokens", "3")):
        out.append(Case("text", f"text/chat-{name}", chat + list(extra), "session",
                        stdin=("bytes", data) if isinstance(data, bytes) else data))

    chat_case("invalid-utf8-line", b"\xff\xfe bad\nhello\n")
    chat_case("20mb-line", b"a" * 20_000_000 + b"\n")
    chat_case("20mb-line-then-hi", b"a" * 20_000_000 + b"\nhi\n")
    chat_case("dev-zero", ("file", "/dev/zero"))
    chat_case("nul-line", b"\0\0\0\nhi\n")
    chat_case("crlf-lines", b"\r\n\r\nhi\r\n")
    chat_case("200-lines", b"hi\n" * 200)
    chat_case("reset-spam", b"/reset\n" * 500 + b"hi\n")
    chat_case("unknown-command", b"/foo\n/\n//\nhi\n/exit\nignored\n")
    chat_case("specials-line", b"<|im_end|>" * 5000 + b"\nhi\n")
    chat_case("ansi-escape", b"\x1b[31mred\x1b[0m\x07\x08\n")
    chat_case("no-newline-eof", b"hello")
    chat_case("system-120kb", b"hi\n", extra=["--max-tokens", "3", "--system", "s " * 60000])
    chat_case("system-invalid-utf8", b"hi\n", extra=["--max-tokens", "3", "--system", b"\xc3\x28"])
    chat_case("long-conversation-tiny-context", b"tell me more about it please\n" * 60,
              extra=["--max-tokens", "20"])
    return out


# --------------------------------------------------------------------------------------------
# Class 4: output (closed pipes, /dev/full, closed descriptors).
# --------------------------------------------------------------------------------------------

def output_cases(ctx):
    T, M = ctx.tiny, ctx.model
    reqs = ctx.p("output-requests.jsonl")

    def prep():
        with open(reqs, "w") as f:
            for i in range(10):
                f.write(json.dumps({"prompt": f"number {i}", "max_tokens": 50}) + "\n")

    long = ["--prompt", "hi", "--max-tokens", "400", "--ignore-eos"]
    sources = {
        "generate": ["generate", "--device", "cpu", "--model", T] + long,
        "generate-json": ["generate", "--device", "cpu", "--model", T, "--json"] + long,
        "prompts-file": ["generate", "--device", "cpu", "--model", T, "--prompts-file", reqs,
                         "--ignore-eos"],
        "info": ["info", "--device", "cpu", "--model", T],
        "bench": ["bench", "--device", "cpu", "--model", T, "--prompt-tokens", "16",
                  "--gen-tokens", "4", "--repeats", "1"],
        "generate-tp3": ["generate", "--device", "cpu", "--model", T, "--tp", "3"] + long,
        "chat": ["chat", "--device", "cpu", "--model", T, "--max-tokens", "100"],
    }
    out = []
    for name, args in sources.items():
        stdin = ("bytes", b"hello\nhow are you\n") if name == "chat" else None
        for n in (0, 5):
            out.append(Case("output", f"output/{name}-head-c{n}", args, "pipe", stdin=stdin,
                            stdout=("head", n), prepare=prep))
        out.append(Case("output", f"output/{name}-dev-full", args, "full",
                        ["space", "write", "output", "stdout"], stdin=stdin, stdout="full", prepare=prep))
        out.append(Case("output", f"output/{name}-closed-stdout", args, "either",
                        ["stdout", "write", "output", "descriptor"], stdin=stdin, stdout="closed",
                        prepare=prep))
    out.append(Case("output", "output/default-generate-head-c5",
                    ["generate", "--device", "cpu", "--model", M] + long, "pipe", stdout=("head", 5)))
    refusal = ["generate", "--device", "cpu", "--model", T, "--prompt", "hi", "--block-size", "9999"]
    out.append(Case("output", "output/refusal-closed-stderr", refusal, "refuse", stderr="closed"))
    out.append(Case("output", "output/refusal-stderr-dev-full", refusal, "refuse", stderr="full"))
    out.append(Case("output", "output/generate-closed-stderr", sources["generate"], "ok",
                    stderr="closed"))
    out.append(Case("output", "output/prompts-file-closed-stderr", sources["prompts-file"], "batch",
                    stderr="closed", prepare=prep, requests=10))
    out.append(Case("output", "output/prompts-file-stderr-dev-full", sources["prompts-file"], "batch",
                    stderr="full", prepare=prep, requests=10))
    out.append(Case("output", "output/chat-closed-stdout-and-stderr", sources["chat"], "either",
                    stdin=("bytes", b"hi\n"), stdout="closed", stderr="closed"))
    out.append(Case("output", "output/chat-bad-line-closed-stderr", sources["chat"], "session",
                    stdin=("bytes", b"\xff\nhi\n"), stderr="closed"))
    return out


# --------------------------------------------------------------------------------------------
# Class 5: Ctrl-C.
# --------------------------------------------------------------------------------------------

def sigint_cases(ctx):
    M = ctx.model
    out = []
    gen = ["generate", "--device", "cpu", "--model", M, "--prompt", "Write a long story.",
           "--max-tokens", "2000", "--ignore-eos"]
    moments = {
        "at-0.05s": [("sleep", 0.05), ("sigint",)],
        "at-0.5s-loading": [("sleep", 0.5), ("sigint",)],
        "after-first-output": [("wait_out", b" ", 30), ("sigint",)],
        "after-3s": [("wait_out", b" ", 30), ("sleep", 3), ("sigint",)],
        "twice-0.1s-apart": [("wait_out", b" ", 30), ("sleep", 1), ("sigint",), ("sleep", 0.1), ("sigint",)],
        "three-times-fast": [("wait_out", b" ", 30), ("sigint",), ("sigint",), ("sigint",)],
    }
    for m, steps in moments.items():
        out.append(Case("sigint", f"sigint/generate-{m}", gen, "sigint", steps=steps))
    out.append(Case("sigint", "sigint/generate-json-after-3s", gen + ["--json"], "sigint",
                    steps=[("sleep", 4), ("sigint",)]))
    long_prompt = ctx.p("sigint-long-prompt.txt")

    def prep_long():
        with open(long_prompt, "w") as f:
            f.write("The history of the world in many words. " * 500)

    out.append(Case("sigint", "sigint/generate-during-prefill", ["generate", "--device", "cpu",
                    "--model", M, "--prompt-file", long_prompt, "--max-tokens", "50"], "sigint",
                    steps=[("sleep", 4), ("sigint",)], prepare=prep_long))
    out.append(Case("sigint", "sigint/generate-sigint-ignored-at-start", gen, "sigint",
                    steps=[("wait_out", b" ", 30), ("sigint",)], sigint_ignored=True))
    out.append(Case("sigint", "sigint/generate-sigint-ignored-loading", gen, "sigint",
                    steps=[("sleep", 0.3), ("sigint",)], sigint_ignored=True))
    # A requests file: every request must still print a line.
    reqs = ctx.p("sigint-requests.jsonl")

    def prep_reqs():
        with open(reqs, "w") as f:
            for i in range(20):
                f.write(json.dumps({"prompt": f"Story number {i}:", "max_tokens": 400}) + "\n")
            f.write("{not json\n\n")
            f.write(json.dumps({"prompt": "x " * 9000, "max_tokens": 4}) + "\n")

    batch = ["generate", "--device", "cpu", "--model", M, "--prompts-file", reqs, "--ignore-eos"]
    for m, steps in {"at-0.05s-loading": [("sleep", 0.05), ("sigint",)],
                     "at-0.15s-loading": [("sleep", 0.15), ("sigint",)],
                     "at-0.3s-loading": [("sleep", 0.3), ("sigint",)],
                     "at-4s": [("sleep", 4), ("sigint",)],
                     "twice-0.1s-apart": [("sleep", 4), ("sigint",), ("sleep", 0.1), ("sigint",)],
                     "twice-1.5s-apart": [("sleep", 4), ("sigint",), ("sleep", 1.5), ("sigint",)],
                     "three-times-fast": [("sleep", 4), ("sigint",), ("sigint",), ("sigint",)]}.items():
        out.append(Case("sigint", f"sigint/prompts-file-{m}", batch, "sigint", steps=steps,
                        requests=22, prepare=prep_reqs))
    # Chat: Ctrl-C stops a reply and keeps the conversation; at the prompt, twice quits.
    chat = ["chat", "--device", "cpu", "--model", M, "--max-tokens", "2000"]
    story = b"Tell me a very long story about dragons.\n"
    out.append(Case("sigint", "sigint/chat-during-reply-then-continue", chat, "session",
                    stdin="pipe", steps=[("write", story), ("wait_out", b" ", 30, 20), ("sigint",),
                                         ("sleep", 1), ("write", b"Now say hello.\n"),
                                         ("sleep", 3), ("sigint",), ("sleep", 1),
                                         ("write", b"/exit\n"), ("close_stdin",)]))
    out.append(Case("sigint", "sigint/chat-twice-at-prompt", chat, "sigint", stdin="pipe",
                    steps=[("sleep", 3), ("sigint",), ("sleep", 0.3), ("sigint",)]))
    # Stdin closes 8 s after the Ctrl-C: the wall time tells whether the Ctrl-C or the EOF ended it.
    for at in (0.05, 0.3):
        out.append(Case("sigint", f"sigint/chat-at-{at}s-loading", chat, "sigint", stdin="pipe",
                        steps=[("sleep", at), ("sigint",), ("sleep", 8), ("close_stdin",)]))
    out.append(Case("sigint", "sigint/chat-twice-during-reply", chat, "sigint", stdin="pipe",
                    steps=[("write", story), ("wait_out", b" ", 30, 10), ("sigint",), ("sigint",),
                           ("sleep", 2), ("close_stdin",)]))
    out.append(Case("sigint", "sigint/chat-after-stdin-eof", chat, "sigint", stdin="pipe",
                    steps=[("write", story), ("close_stdin",), ("wait_out", b" ", 30, 10),
                           ("sigint",)]))
    # Tools.
    out.append(Case("sigint", "sigint/bench", ["bench", "--device", "cpu", "--model", M,
                                               "--repeats", "5"], "sigint",
                    steps=[("sleep", 4), ("sigint",)]))
    out.append(Case("sigint", "sigint/bench-multi-round", ["bench", "--device", "cpu", "--model", M,
                                                           "--multi-round", "8", "--repeats", "1"],
                    "sigint", steps=[("sleep", 5), ("sigint",)]))
    return out


# --------------------------------------------------------------------------------------------
# Class 6: requests files.
# --------------------------------------------------------------------------------------------

def requests_cases(ctx):
    T, M = ctx.tiny, ctx.model
    out = []
    rdir = ctx.p("requests")

    def file_case(name, lines_fn, extra=(), model=None, expect="batch", names=None, count=True):
        path = os.path.join(rdir, name + ".jsonl")
        holder = {}

        def prepare():
            os.makedirs(rdir, exist_ok=True)
            data = lines_fn()
            with open(path, "wb") as f:
                f.write(data)
            # Lines that are not blank (Rust's is_ascii_whitespace: space, \t, \n, \x0c, \r).
            holder["n"] = sum(1 for l in data.split(b"\n") if l.strip(b" \t\n\x0c\r"))

        case = Case("requests", f"requests/{name}",
                    ["generate", "--device", "cpu", "--model", model or T, "--prompts-file", path]
                    + list(extra), expect, names, prepare=prepare)
        if count:
            # The count is known only once the file is made: filled in by prepare.
            orig = case.prepare

            def prepare_and_count():
                orig()
                case.requests = holder["n"]
            case.prepare = prepare_and_count
        out.append(case)

    def j(**o):
        return json.dumps(o).encode()

    good = j(prompt="hello", max_tokens=2)
    bad = [b"{", b"[]", b"null", b"42", b'"text"', b'{"prompt": 3}', b'{"prompt": null}',
           b'{"prompt": "x", "max_tokens": -1}', b'{"prompt": "x", "max_tokens": 18446744073709551616}',
           b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": "x", "temperature": "NaN"}',
           b'{"prompt": "x", "temperature": -1}', b'{"prompt": "x", "temperature": 1e39}',
           b'{"prompt": "x", "seed": -5}', b'{"prompt": "x", "session": 7}',
           b'{"prompt": "x", "unknown": 1}', b'{"prompt": "x", "kv_policy": "bogus"}',
           b'{"prompt": "x", "kv_budget": 1e999}', b'{"prompt": "x", "kv_budget": -2, "kv_policy": "window"}',
           b'{"prompt": "x", "kv_budget_tokens": 18446744073709551615, "kv_policy": "h2o"}',
           b'{"prompt": "\xff\xfe"}', b'\xef\xbb\xbf{"prompt": "bom"}', b'{"prompt": "\\ud800"}',
           b'{"prompt": ""}', j(prompt="<|im_start|>" * 5, max_tokens=2), j(prompt="x " * 700),
           b'{"prompt": "x", "prompt": "y"}', b'  {"prompt": "spaces"}  \r',
           b"[" * 5000 + b"]" * 5000, b'{"prompt": "x", "max_tokens": 0}',
           j(prompt="s", session=""), j(prompt="s", session="a" * 100000, max_tokens=1)]
    file_case("malformed-lines", lambda: b"\n".join(l for b_ in bad for l in (good, b_, b"")) + b"\n")
    file_case("100mb-line", lambda: good + b"\n" + j(prompt="a" * 100_000_000, max_tokens=1)
              + b"\n" + good + b"\n")
    file_case("100mb-garbage-line", lambda: b"x" * 100_000_000 + b"\n" + good + b"\n")
    file_case("100mb-no-newline", lambda: good + b"\n" + b"{" * 100_000_000)

    # Sparse files past and at the 1 GiB bound (no disk is used for the zeros).
    for label, size in (("1gib-plus-1", (1 << 30) + 1), ("1gib", 1 << 30)):
        path = os.path.join(rdir, label + ".jsonl")

        def prepare(path=path, size=size):
            os.makedirs(rdir, exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)

        # At the bound the file is read: one line of NUL bytes, one error line for it.
        at_bound = size == 1 << 30
        out.append(Case("requests", f"requests/sparse-{label}",
                        ["generate", "--device", "cpu", "--model", T, "--prompts-file", path],
                        "batch" if at_bound else "refuse", ["1073741824", "bytes", "long"],
                        requests=1 if at_bound else None, prepare=prepare))
    for src in ("/dev/null", "/dev/zero", "/nonexistent.jsonl", "/tmp"):
        out.append(Case("requests", f"requests/file-{src}",
                        ["generate", "--device", "cpu", "--model", T, "--prompts-file", src],
                        "either", ["requests", src, "prompts", "directory", "bytes", "empty"]))
    file_case("only-blank-lines", lambda: b"\n \n\t\n\r\n" * 100, count=False, expect="either",
              names=["request", "empty", "no "])
    # Many requests through a tiny KV cache: every one must get its line.
    file_case("2000-requests-kv-blocks-4", lambda: b"\n".join(
        j(prompt=f"request {i}", max_tokens=4) for i in range(2000)) + b"\n",
        ["--kv-blocks", "4", "--ignore-eos"])
    file_case("500-requests-kv-blocks-1-some-too-big", lambda: b"\n".join(
        j(prompt=("word " * (i % 7 * 5)) + str(i), max_tokens=4) for i in range(500)) + b"\n",
        ["--kv-blocks", "1", "--ignore-eos"])
    file_case("300-requests-10-sessions-kv-blocks-8", lambda: b"\n".join(
        j(prompt=f"turn {i} of session {i % 10}. " * 3, max_tokens=3, session=f"s{i % 10}")
        for i in range(300)) + b"\n", ["--kv-blocks", "8", "--ignore-eos"])
    file_case("300-requests-tp3-kv-blocks-4", lambda: b"\n".join(
        j(prompt=f"request {i}", max_tokens=4) for i in range(300)) + b"\n",
        ["--kv-blocks", "4", "--tp", "3", "--ignore-eos"])
    file_case("1000-requests-max-batch-1", lambda: b"\n".join(
        j(prompt=f"r{i}", max_tokens=1) for i in range(1000)) + b"\n",
        ["--max-batch", "1", "--max-batched-tokens", "1"])
    file_case("200-requests-eviction-tiny-kv", lambda: b"\n".join(
        j(prompt="lorem ipsum dolor " * 10, max_tokens=4, kv_policy=["window", "h2o", "keyformer", "sink"][i % 4],
          kv_budget=0.5) for i in range(200)) + b"\n", ["--kv-blocks", "6"])
    file_case("default-model-100-requests-kv-blocks-8", lambda: b"\n".join(
        j(prompt=f"Question {i}: what is {i} + {i}?", max_tokens=4) for i in range(100)) + b"\n",
        ["--kv-blocks", "8", "--ignore-eos"], model=M)
    file_case("max-tokens-past-context", lambda: b"\n".join(
        [j(prompt="hi", max_tokens=100000), j(prompt="hi", max_tokens=18446744073709551615), good])
        + b"\n", ["--ignore-eos"])
    return out


# --------------------------------------------------------------------------------------------
# Class "tp": --tensor-parallel 3 on the default model.
# --------------------------------------------------------------------------------------------

def tp_cases(ctx):
    M = ctx.model
    base = ["--device", "cpu", "--model", M, "--tp", "3"]
    gen = ["generate"] + base + ["--prompt", "Write a long story.", "--max-tokens", "400", "--ignore-eos"]
    reqs = ctx.p("tp-requests.jsonl")

    def prep():
        with open(reqs, "w") as f:
            for i in range(4):
                f.write(json.dumps({"prompt": f"Tell me about {i}", "max_tokens": 8}) + "\n")
            f.write("{broken\n")
            f.write(json.dumps({"prompt": "x " * 9000, "max_tokens": 2}) + "\n")

    reqs_long = ctx.p("tp-requests-long.jsonl")

    def prep_long():
        with open(reqs_long, "w") as f:
            for i in range(8):
                f.write(json.dumps({"prompt": f"Story {i}:", "max_tokens": 300}) + "\n")

    chat = ["chat"] + base + ["--max-tokens", "30"]
    return [
        Case("tp", "tp/generate", gen[:-2] + ["16"], "ok"),
        Case("tp", "tp/generate-head-c5", gen, "pipe", stdout=("head", 5)),
        Case("tp", "tp/generate-dev-full", gen, "full", ["space", "write", "stdout"], stdout="full"),
        Case("tp", "tp/generate-sigint-after-output", gen, "sigint",
             steps=[("wait_out", b" ", 30), ("sleep", 1), ("sigint",)]),
        Case("tp", "tp/generate-sigint-loading", gen, "sigint", steps=[("sleep", 0.3), ("sigint",)]),
        Case("tp", "tp/generate-sigint-twice", gen, "sigint",
             steps=[("wait_out", b" ", 30), ("sigint",), ("sleep", 0.1), ("sigint",)]),
        Case("tp", "tp/prompts-file-with-bad-lines", ["generate"] + base + ["--prompts-file", reqs],
             "batch", requests=6, prepare=prep),
        Case("tp", "tp/prompts-file-sigint", ["generate"] + base + ["--prompts-file", reqs_long,
                                                                    "--ignore-eos"],
             "sigint", steps=[("sleep", 5), ("sigint",)], requests=8, prepare=prep_long),
        Case("tp", "tp/chat-stdin", chat, "session",
             stdin=("bytes", b"hi\n\xff\xfe bad\n/reset\n" + b"a" * 5_000_000 + b"\nbye\n")),
        Case("tp", "tp/chat-sigint-during-reply", chat[:-1] + ["2000"], "session", stdin="pipe",
             steps=[("write", b"Tell me a long story.\n"), ("wait_out", b" ", 30, 10), ("sigint",),
                    ("sleep", 1), ("write", b"hello\n"), ("sleep", 3), ("close_stdin",)]),
        Case("tp", "tp/chat-kv-blocks-2", chat + ["--kv-blocks", "2"], "session",
             stdin=("bytes", b"hi\n" + b"tell me more about it " * 20 + b"\nbye\n")),
        Case("tp", "tp/info", ["info"] + base, "ok"),
    ]


# --------------------------------------------------------------------------------------------
# Class 7: turbo serve.
# --------------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_req(port, method, path, body=None, headers=None, timeout=90):
    """(status, body) of one request, or (None, error text)."""
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        h = {"content-type": "application/json"}
        h.update(headers or {})
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data
    except Exception as e:  # a refused, reset or timed-out request is a result here
        return None, f"{type(e).__name__}: {e}"


def raw_http(port, data, read=True, timeout=20, pause=0.0):
    """Sends raw bytes; returns the response's status line (or what went wrong)."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if isinstance(data, list):
            for part in data:
                s.sendall(part)
                time.sleep(pause)
        else:
            s.sendall(data)
        line = b""
        if read:
            s.settimeout(timeout)
            while b"\r\n" not in line and len(line) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                line += chunk
        s.close()
        return line.split(b"\r\n")[0].decode("latin-1")
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def hwm_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for l in f:
                if l.startswith("VmHWM:"):
                    return int(l.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def serve_campaign(ctx, label, model, extra, concurrency, stream_tokens, log):
    """Starts a server, sends the hostile requests, checks it still answers, stops it with SIGINT.
    Returns the record of the whole run and the per-request results."""
    port = free_port()
    argv = ["serve", "--device", "cpu", "--model", model, "--host", "127.0.0.1",
            "--port", str(port)] + extra
    tmp = tempfile.mkdtemp(prefix="serve-", dir=ctx.work)
    err_path = os.path.join(tmp, "stderr")
    errf = open(err_path, "wb")
    start = time.monotonic()
    proc = subprocess.Popen([ctx.turbo] + argv, stdin=subprocess.DEVNULL, stdout=errf, stderr=errf,
                            start_new_session=True, env=CHILD_ENV)
    peak = [0.0]
    stop_poll = threading.Event()

    mem_killed = [False]

    def poll():
        while not stop_poll.is_set():
            peak[0] = max(peak[0], hwm_mb(proc.pid))
            if peak[0] > RSS_KILL_MB and not mem_killed[0]:
                mem_killed[0] = True
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.05)

    threading.Thread(target=poll, daemon=True).start()
    results = []  # (phase, what, status or error, seconds)
    lock = threading.Lock()

    def record(phase, what, status, t0):
        with lock:
            results.append((phase, what, status, round(time.monotonic() - t0, 2)))

    def req(phase, what, method, path, body=None, headers=None, timeout=90):
        t0 = time.monotonic()
        st, data = http_req(port, method, path, body, headers, timeout)
        record(phase, what, st if st is not None else data, t0)
        return st, data

    # Ready within 60 s.
    ready = False
    while time.monotonic() - start < 60 and proc.poll() is None:
        st, _ = http_req(port, "GET", "/health", timeout=2)
        if st == 200:
            ready = True
            break
        time.sleep(0.3)
    log(f"  serve {label}: ready={ready} after {time.monotonic() - start:.1f} s on port {port}")

    def chat_body(**kw):
        o = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        o.update(kw)
        return json.dumps(o)

    def alive():
        return proc.poll() is None

    if ready:
        req("basic", "health", "GET", "/health")
        req("basic", "models", "GET", "/v1/models")
        req("basic", "metrics", "GET", "/metrics")
        req("basic", "chat", "POST", "/v1/chat/completions", chat_body())
        # Malformed JSON and wrong types.
        bodies = [b"", b"{", b"[]", b"null", b"42", b'"x"', b"{\"messages\": ", b"\xff\xfe",
                  b"[" * 100000, b'{"messages": [' + b"{}," * 10000 + b"{}]}",
                  b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}']
        for b in bodies:
            req("malformed", repr(b[:30]), "POST", "/v1/chat/completions", b)
            req("malformed", repr(b[:30]), "POST", "/v1/completions", b)
        wrong = [dict(max_tokens=-1), dict(max_tokens=2**64), dict(max_tokens="8"), dict(max_tokens=1e300),
                 dict(temperature=-1), dict(temperature="hot"), dict(temperature=1e39), dict(top_p=2),
                 dict(top_k=-5), dict(min_p=1.5), dict(n=0), dict(n=17), dict(n=2**40),
                 dict(logprobs=True, top_logprobs=21), dict(logprobs=True, top_logprobs=-1),
                 dict(frequency_penalty=5), dict(presence_penalty=float("inf") if False else -3),
                 dict(seed=-1), dict(seed=2**64), dict(stop=["x"] * 10000), dict(stop=[1, 2]),
                 dict(stop="a" * 1_000_000), dict(messages=[]), dict(messages="hi"),
                 dict(messages=[{"role": "wizard", "content": "hi"}]),
                 dict(messages=[{"role": "user"}]),
                 dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                 dict(messages=[{"role": "user", "content": 12}]),
                 dict(messages=[{"role": "user", "content": "hi " * 200000}]),
                 dict(logit_bias={"1": 5}), dict(tools=[{"type": "function"}]), dict(stream="yes"),
                 dict(stream=True, stream_options={"include_usage": "yes"}), dict(session=5),
                 dict(session="s" * 100000), dict(model="no-such-model"), dict(ignore_eos="x"),
                 dict(repetition_penalty=0), dict(response_format={"type": "json_schema"})]
        for w in wrong:
            req("wrong-type", json.dumps(w)[:60], "POST", "/v1/chat/completions", chat_body(**w))
        comp = [dict(prompt=[[-1]]), dict(prompt=[2**40]), dict(prompt=[]), dict(prompt=[[]]),
                dict(prompt=[[1, 2]] * 2000, max_tokens=1), dict(prompt=None), dict(prompt={"x": 1}),
                dict(prompt="hi", echo=True), dict(prompt="hi", best_of=3), dict(prompt="hi", suffix="x"),
                dict(prompt="hi", logprobs=21), dict(prompt="<|im_start|>" * 100000),
                dict(prompt=["a"] * 2000, max_tokens=1), dict(prompt="hi", max_tokens=0)]
        for c_ in comp:
            body = dict(max_tokens=4)
            body.update(c_)
            req("wrong-type", "completions " + json.dumps(c_)[:50], "POST", "/v1/completions",
                json.dumps(body))
        for path in ("/", "/v1", "/v1/chat/completions/../models", "/%ff", "/" + "a" * 8000):
            req("routes", path[:40], "GET", path)
        req("routes", "DELETE models", "DELETE", "/v1/models")
        req("routes", "GET chat", "GET", "/v1/chat/completions")
        # Protocol-level garbage on raw sockets.
        raws = {
            "garbage": b"\x00\x01\x02 garbage\r\n\r\n",
            "http09": b"GET /health\r\n\r\n",
            "content-length-huge": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n{}",
            "content-length-negative": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
            "content-length-twice": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 9\r\n\r\n{}",
            "chunked-bad": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "header-1mb": b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 1_000_000 + b"\r\n\r\n",
            "headers-20000": b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 20000 + b"\r\n",
            "request-line-1mb": b"GET /" + b"a" * 1_000_000 + b" HTTP/1.1\r\n\r\n",
            "expect-100": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
        }
        for name, data in raws.items():
            t0 = time.monotonic()
            record("protocol", name, raw_http(port, data), t0)
        # Half a request, then gone; and a slow client (bounded: 10 pauses of 0.3 s).
        for i in range(5):
            t0 = time.monotonic()
            record("protocol", "half-request-close", raw_http(
                port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro", read=False), t0)
        t0 = time.monotonic()
        record("protocol", "slow-client", raw_http(
            port, [b"GET /health HTTP/1.1\r\n"] + [b"X-Slow: 1\r\n"] * 10 + [b"\r\n"], pause=0.3), t0)
        # Huge bodies: past --max-body-bytes (8 MiB), at it, and a 100 MB upload.
        req("huge", "9 MB body", "POST", "/v1/chat/completions",
            chat_body(messages=[{"role": "user", "content": "a" * 9_000_000}]))
        body = chat_body(messages=[{"role": "user", "content": "a"}])
        n = 8 * 1024 * 1024 - 1 - (len(body) - 1)  # a valid body one byte under the bound
        req("huge", "8 MiB - 1 body", "POST", "/v1/chat/completions",
            chat_body(messages=[{"role": "user", "content": "a" * n}]))
        req("huge", "8 MiB prompt", "POST", "/v1/completions",
            json.dumps({"prompt": "word " * (1_600_000), "max_tokens": 1}))
        t0 = time.monotonic()
        big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        record("huge", "100 MB upload", raw_http(port, [big] + [b"a" * 1_000_000] * 100, timeout=30), t0)
        # Many at once: bounded to `concurrency` requests, each with a 90 s timeout.
        threads = []
        for i in range(concurrency):
            kind = i % 4
            if kind == 0:
                args = ("POST", "/v1/chat/completions", chat_body(max_tokens=8, temperature=0.7, seed=i))
            elif kind == 1:
                args = ("POST", "/v1/completions", json.dumps({"prompt": f"Number {i} is", "max_tokens": 8}))
            elif kind == 2:
                args = ("POST", "/v1/chat/completions", chat_body(max_tokens=8, stream=True))
            else:
                args = ("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4, "n": 3}))
            t = threading.Thread(target=req, args=("concurrent", f"#{i} kind {kind}") + args)
            threads.append(t)
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # Clients that leave mid-stream (reset connections), and ones that leave before an answer.
        def leave_mid_stream(i):
            t0 = time.monotonic()
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                body = chat_body(max_tokens=stream_tokens, stream=True, ignore_eos=True).encode()
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                got = b""
                while b"data:" not in got and len(got) < 100000:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                if i % 2:  # half of them reset the connection (SO_LINGER 0)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
                record("disconnect", f"mid-stream #{i}", "left after first chunk" if b"data:" in got
                       else "no chunk: " + got[:60].decode("latin-1"), t0)
            except Exception as e:
                record("disconnect", f"mid-stream #{i}", f"{type(e).__name__}: {e}", t0)

        def leave_before_answer(i):
            t0 = time.monotonic()
            body = chat_body(max_tokens=stream_tokens, ignore_eos=True).encode()
            record("disconnect", f"before answer #{i}", raw_http(
                port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body, read=False), t0)

        dthreads = [threading.Thread(target=leave_mid_stream, args=(i,)) for i in range(20)]
        dthreads += [threading.Thread(target=leave_before_answer, args=(i,)) for i in range(10)]
        for t in dthreads:
            t.start()
        for t in dthreads:
            t.join(60)
        # The cancelled requests must end: pending back to 0 within 30 s.
        pending = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            st, data = http_req(port, "GET", "/metrics", timeout=10)
            if st == 200:
                m = re.search(rb"^turbo_requests_pending(?:\{[^}]*\})? (\S+)", data, re.M)
                pending = float(m.group(1)) if m else None
                if pending == 0:
                    break
            time.sleep(0.5)
        record("check", "requests_pending back to 0", f"pending={pending}", t0)
        # A normal request afterwards.
        st, data = req("after", "normal chat request", "POST", "/v1/chat/completions", chat_body())
        normal_ok = st == 200 and b"choices" in data
    else:
        normal_ok, pending = False, None
    alive_before_stop = alive()
    peak[0] = max(peak[0], hwm_mb(proc.pid))
    # SIGINT: stops accepting, lets running requests finish, exits 0.
    sig_t = time.monotonic()
    if alive_before_stop:
        os.killpg(proc.pid, signal.SIGINT)
    status, usage = None, None
    while time.monotonic() - sig_t < 45:
        pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            status, usage = st, ru
            break
        time.sleep(0.1)
    timed_out = status is None
    if timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = status
    stop_poll.set()
    errf.close()
    err = read_head(err_path, STDERR_KEEP).decode("utf-8", "replace")
    rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else None
    # VmHWM polled while it ran (its ru_maxrss would count this script's memory, see LAUNCHER).
    peak_mb = peak[0]
    rec = {"cls": "serve", "name": f"serve/{label}", "expect": "serve",
           "repro": "$TURBO " + " ".join(shlex.quote(a) for a in argv).replace(ctx.model, "$MODEL")
           .replace(ctx.work, "$WORK") + f"   # then the requests of serve_campaign ({label})",
           "rc": rc, "signal": sig, "wall_s": round(time.monotonic() - start, 1),
           "maxrss_mb": round(peak_mb, 1), "timed_out": False, "signals_sent": [("SIGINT", 0)],
           "stderr": err, "stderr_bytes": os.path.getsize(err_path), "notes": [],
           "ready": ready, "alive_before_stop": alive_before_stop, "normal_after": normal_ok,
           "pending_after_disconnects": pending, "exit_after_sigint_s": round(time.monotonic() - sig_t, 1),
           "requests_sent": sum(1 for r in results if r[0] != "check"), "results": results}
    f = []
    if "panicked" in err or rc == 101:
        f.append("panic")
    if sig == "SIGABRT" or "memory allocation of" in err:
        f.append("abort")
    elif sig and sig != "SIGINT" and not mem_killed[0]:
        f.append(f"signal death ({sig})")
    if mem_killed[0]:
        f.append(f"killed by the harness at {peak_mb:.0f} MB")
    if not ready:
        f.append("server never answered /health")
    if ready and not alive_before_stop:
        f.append("server died during the requests")
    if ready and not normal_ok:
        f.append("no answer to a normal request afterwards")
    if ready and pending != 0:
        f.append(f"requests still pending after the clients left ({pending})")
    if peak_mb * 1024 * 1024 > RSS_LIMIT:
        f.append(f"over 2 GB ({peak_mb:.0f} MB)")
    if timed_out:
        f.append("did not exit within 45 s of SIGINT")
    elif rc != 0:
        f.append(f"exit {rc} after SIGINT")
    slow = [r for r in results if r[3] > TIME_LIMIT_S]
    if slow:
        f.append(f"{len(slow)} requests over 60 s")
    # A request with no HTTP answer, where the client did not leave on purpose, is lost.
    lost = [r for r in results if r[0] not in ("disconnect", "protocol", "huge", "check")
            and not isinstance(r[2], int)]
    if lost:
        f.append(f"lost requests: {len(lost)} with no HTTP answer")
    five = [r for r in results if isinstance(r[2], int) and r[2] >= 500 and r[2] != 503]
    if five:
        f.append(f"{len(five)} answers 5xx (other than 503)")
    rec["failures"] = f
    # Raw clients that got no answer before they gave up (not targets: the server stayed up).
    rec["notes"] = [f"{r[0]} {r[1]}: {r[2]} after {r[3]} s" for r in results
                    if r[0] in ("protocol", "huge") and "Timeout" in str(r[2])]
    rec["lost"] = len(lost)
    rec["over_60"] = len(slow)
    return rec


# --------------------------------------------------------------------------------------------
# The campaign.
# --------------------------------------------------------------------------------------------

CLASSES = [("sizes", "sizes from flags", sizes_cases), ("models", "model files", model_cases),
           ("text", "text inputs", text_cases), ("output", "output (pipes, full disk)", output_cases),
           ("sigint", "Ctrl-C", sigint_cases), ("requests", "requests files", requests_cases),
           ("tp", "tensor parallel 3 (default model)", tp_cases), ("serve", "serve", None)]


def summarize(records, meta):
    """The table, the failures with their reproduction commands, and the refusal lines."""
    lines = [f"# Hostile campaign, {meta['date']}", "",
             f"binary `{meta['turbo']}` (sha256 {meta['sha256'][:16]}), model `{meta['model']}`, "
             f"load average at start {meta['load_start']}, at end {meta.get('load_end')}, "
             f"{meta.get('wall_min', '?')} min", "",
             "| class | runs | panics | aborts | signal deaths | > 2 GB | > 60 s | lost requests |",
             "|---|---|---|---|---|---|---|---|"]
    for key, title, _ in CLASSES:
        rs = [r for r in records if r["cls"] == key]
        if not rs:
            continue

        def n(pred):
            return sum(1 for r in rs if pred(r))

        if key == "serve":
            runs = f"{sum(r['requests_sent'] for r in rs)} requests ({len(rs)} servers)"
            over60 = sum(r["over_60"] for r in rs)
            lost = sum(r["lost"] for r in rs)
        else:
            runs = str(len(rs))
            over60 = n(lambda r: r["timed_out"])
            reqs = [r for r in rs if r.get("requests") is not None]
            lost = sum(max(0, r["requests"] - r["output_lines"]) for r in reqs
                       if any(x.startswith("lost") for x in r["failures"])) if reqs else "-"
        row = [title, runs, n(lambda r: "panic" in r["failures"]), n(lambda r: "abort" in r["failures"]),
               n(lambda r: any(x.startswith("signal death") for x in r["failures"])),
               n(lambda r: any(x.startswith("over 2 GB") for x in r["failures"])), over60, lost]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    for key, title in (("failures", "Targets missed (the table's columns)"),
                       ("refusal_misses", "Refusals that are not one line naming what was wrong")):
        failed = [r for r in records if r.get(key)]
        lines += ["", f"## {title}: {len(failed)} runs", ""]
        for r in failed:
            lines += [f"- `{r['name']}`: {'; '.join(r[key])} (exit {r['rc']}, signal {r['signal']}, "
                      f"{r['wall_s']} s, {r['maxrss_mb']} MB)",
                      f"  - `{r['repro']}`"]
            first = [l for l in r["stderr"].splitlines() if l.strip()][:4]
            for l in first:
                lines.append(f"  - stderr: `{l[:300]}`")
    noted = [r for r in records if r["notes"] and not r["failures"] and not r.get("refusal_misses")]
    lines += ["", f"## Notes ({len(noted)} runs)", ""]
    for r in noted:
        lines.append(f"- `{r['name']}`: {'; '.join(r['notes'])} (exit {r['rc']}, signal {r['signal']}) "
                     f"`{r['repro']}`")
        first = [l for l in r["stderr"].splitlines() if l.strip()][:2]
        for l in first:
            lines.append(f"  - stderr: `{l[:300]}`")
    refusals = {}
    for r in records:
        if r.get("refusal"):
            key = re.sub(r"/[^ :']*", "PATH", r["refusal"])[:200]
            refusals.setdefault(key, []).append(r["name"])
    lines += ["", f"## Refusal lines ({len(refusals)} distinct, paths shown as PATH)", ""]
    for k, names in sorted(refusals.items()):
        lines.append(f"- {len(names)}x `{k}` (e.g. {names[0]})")
    return "\n".join(lines) + "\n"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    cache = os.environ.get("TURBO_CACHE", os.path.expanduser("~/.cache/turbo"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turbo", default=os.path.join(here, "..", "target", "release", "turbo"))
    ap.add_argument("--model", default=os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--work", default="/tmp/turbo-hostile")
    ap.add_argument("--classes", default=",".join(k for k, _, _ in CLASSES))
    ap.add_argument("--only", help="run only the cases whose name matches this regex")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    a = ap.parse_args()
    ctx = Ctx(os.path.abspath(a.turbo), os.path.abspath(a.model), os.path.abspath(a.work))
    os.makedirs(ctx.work, exist_ok=True)
    classes = a.classes.split(",")
    cases = []
    for key, _, fn in CLASSES:
        if key in classes and fn:
            cases += fn(ctx)
    if a.only:
        cases = [c for c in cases if re.search(a.only, c.name)]
    if a.list:
        for c in cases:
            print(c.name)
        if "serve" in classes:
            print("serve/default-model\nserve/tiny-tp3-small-kv")
        return 0
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"duplicate case names: {sorted(dup)[:5]}"
    if not os.access(ctx.turbo, os.X_OK):
        sys.exit(f"no executable turbo at {ctx.turbo} (pass --turbo)")
    if not os.path.isfile(ctx.model):
        sys.exit(f"no default model at {ctx.model} (pass --model)")
    results_dir = ctx.p("results")
    os.makedirs(results_dir, exist_ok=True)
    log_path = os.path.join(results_dir, "runs.jsonl")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "turbo": ctx.turbo, "model": ctx.model,
            "sha256": hashlib.sha256(open(ctx.turbo, "rb").read()).hexdigest(),
            "load_start": os.getloadavg()[0]}
    t_start = time.monotonic()

    def log(msg):
        print(msg, flush=True)

    log(f"making the tiny models in {ctx.work}")
    ctx.ensure_base()
    records = []
    with open(log_path, "w") as out:
        for i, case in enumerate(cases):
            if case.prepare:
                case.prepare()
            with tempfile.TemporaryDirectory(dir=ctx.work) as tmp:
                rec = run_case(ctx, case, tmp)
            judge(rec, case.names)
            records.append(rec)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            flag = ("FAIL " + "; ".join(rec["failures"])) if rec["failures"] else "ok"
            log(f"[{i + 1}/{len(cases)}] {case.name}: exit {rec['rc']} {rec['signal'] or ''} "
                f"{rec['wall_s']} s {rec['maxrss_mb']:.0f} MB {flag}")
        if "serve" in classes:
            for label, model, extra, conc, stream_tokens in [
                    ("default-model", ctx.model, [], 200, 1000),
                    ("tiny-tp3-small-kv", ctx.tiny, ["--tp", "3", "--kv-blocks", "4", "--max-pending", "50",
                                                     "--max-batch", "8"], 200, 30)]:
                if a.only and not re.search(a.only, f"serve/{label}"):
                    continue
                rec = serve_campaign(ctx, label, model, extra, conc, stream_tokens, log)
                records.append(rec)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                codes = {}
                for r in rec["results"]:
                    codes[str(r[2])[:40]] = codes.get(str(r[2])[:40], 0) + 1
                log(f"serve/{label}: exit {rec['rc']} {rec['signal'] or ''} peak {rec['maxrss_mb']:.0f} MB, "
                    f"{rec['requests_sent']} requests, answers {codes}, "
                    f"{'FAIL ' + '; '.join(rec['failures']) if rec['failures'] else 'ok'}")
    meta["load_end"] = os.getloadavg()[0]
    meta["wall_min"] = round((time.monotonic() - t_start) / 60, 1)
    summary = summarize(records, meta)
    with open(os.path.join(results_dir, "summary.md"), "w") as f:
        f.write(summary)
    print(summary)
    return 1 if any(r["failures"] or r.get("refusal_misses") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
