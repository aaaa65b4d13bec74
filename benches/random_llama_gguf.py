"""Writes a LLaMA-shaped GGUF with random weights, for benchmarks at real model sizes: F16, Q8_0, or
Q4_K_M (llama.cpp's mix: Q4_K, with Q6_K for the output and for attn_v / ffn_down of some layers).

Tensors are written one at a time, so a 70B shape (75 GB in Q8_0, too large for a 128 GB disk in F16)
needs little memory. Values do not change speed: one random block is tiled. The vocabulary is the
tokenizer's (SmolLM2's 49,152 tokens from --tokenizer, a `tokenizer.ggml.*` JSON dump, gzipped).
Needs numpy and the `gguf` Python package.

    python3 benches/random_llama_gguf.py OUT.gguf --shape llama3-70b --dtype q8_0 --tokenizer smollm2-tokenizer.json.gz
    python3 benches/random_llama_gguf.py OUT.gguf --shape llama3-8b --dtype q4_k_m --tokenizer smollm2-tokenizer.json.gz
    python3 benches/random_llama_gguf.py OUT.gguf --layers 8 --context 16384 --tokenizer smollm2-tokenizer.json.gz  # quick kernel A/B
"""
import argparse, gzip, json, time
import numpy as np
import gguf

SHAPES = {  # hidden, layers, heads, kv heads, ffn, rope theta
    "llama3-8b": (4096, 32, 32, 8, 14336, 500000.0),
    "llama3-70b": (8192, 80, 64, 8, 28672, 500000.0),
    "smollm2-135m": (576, 30, 9, 3, 1536, 100000.0),
    "tiny": (256, 2, 4, 2, 512, 10000.0),
}
Q = gguf.GGMLQuantizationType
BLOCK = {"q8_0": (32, 34), "q4_k": (256, 144), "q6_k": (256, 210)}  # values, bytes


def random_source(dtype, nbytes=1 << 26):
    """A random byte pattern of whole blocks with values of mean 0 and sd about 0.02: F16 values,
    Q8_0 blocks (f16 scale, 32 int8), Q4_K blocks (every sub-block's scale and minimum 8, so
    value = 8 d q - 8 dmin with dmin = 7.5 d), or Q6_K blocks (every scale 16)."""
    rng = np.random.default_rng(0)
    if dtype == "f16":
        return (rng.standard_normal(nbytes // 2, dtype=np.float32) * 0.02).astype(np.float16).view(np.uint8)
    size = BLOCK[dtype][1]
    blocks = nbytes // size
    out = rng.integers(0, 256, (blocks, size), dtype=np.uint8)
    half = lambda v: np.full((blocks, 1), v, dtype=np.float16).view(np.uint8)
    if dtype == "q8_0":
        out[:, :2] = half(0.02 / 40)
        out[:, 2:] = np.clip(rng.standard_normal((blocks, 32)) * 40, -127, 127).astype(np.int8).view(np.uint8)
    elif dtype == "q4_k":
        d = 0.02 / 37
        out[:, 0:2], out[:, 2:4] = half(d), half(7.5 * d)
        out[:, 4:12], out[:, 12:16] = 0x08, 0x88
    else:  # q6_k: ql, qh random; 16 int8 scales; f16 d last
        out[:, 192:208] = 16
        out[:, 208:210] = half(0.02 / (16 * 18.5))
    return out.reshape(-1)


def q4_k_m_type(name, layers):
    """The type llama.cpp's Q4_K_M gives a tensor: Q6_K for the output, and for attn_v and ffn_down
    of the first and last eighth of the layers and every third layer between; Q4_K otherwise."""
    if name == "output.weight":
        return "q6_k"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return "q6_k"
    return "q4_k"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama3-8b", choices=SHAPES)
    ap.add_argument("--dtype", default="f16", choices=["f16", "q8_0", "q4_k_m"])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--layers", type=int, help="blocks instead of the shape's (a quick file whose every layer has the "
                    "shape's cost, e.g. for comparing kernels)")
    ap.add_argument("--context", type=int, default=8192, help="context length the file declares")
    a = ap.parse_args()
    t0 = time.time()
    tok = json.load(gzip.open(a.tokenizer))
    D, L, H, KV, F, theta = SHAPES[a.shape]
    if a.layers is not None:
        if a.layers < 1:
            ap.error("--layers must be at least 1")
        L = a.layers
    if a.context < 1:
        ap.error("--context must be at least 1")
    V, hd = len(tok["tokenizer.ggml.tokens"]), D // H
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_context_length(a.context); w.add_embedding_length(D); w.add_block_count(L); w.add_feed_forward_length(F)
    w.add_head_count(H); w.add_head_count_kv(KV); w.add_rope_freq_base(theta); w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd); w.add_vocab_size(V); w.add_file_type({"f16": 1, "q8_0": 7, "q4_k_m": 15}[a.dtype])
    w.add_tokenizer_model(tok["tokenizer.ggml.model"]); w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"]); w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0); w.add_pad_token_id(2)

    # (name, rows, cols) of every matrix, then the norms (always F32).
    mats = [("token_embd.weight", V, D), ("output.weight", V, D)]
    for i in range(L):
        p = f"blk.{i}."
        mats += [(p + "attn_q.weight", H * hd, D), (p + "attn_k.weight", KV * hd, D), (p + "attn_v.weight", KV * hd, D),
                 (p + "attn_output.weight", D, H * hd), (p + "ffn_gate.weight", F, D), (p + "ffn_up.weight", F, D),
                 (p + "ffn_down.weight", D, F)]
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(L) for n in ("attn", "ffn")]
    def type_of(name):
        return q4_k_m_type(name, L) if a.dtype == "q4_k_m" else a.dtype

    def row_bytes(name, c):
        t = type_of(name)
        return 2 * c if t == "f16" else c // BLOCK[t][0] * BLOCK[t][1]

    for name, r, c in mats:
        if a.dtype == "f16":
            w.add_tensor_info(name, (r, c), np.dtype(np.float16), r * c * 2)
        else:
            n = row_bytes(name, c)
            raw = {"q8_0": Q.Q8_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}[type_of(name)]
            w.add_tensor_info(name, (r, n), np.dtype(np.uint8), r * n, raw_dtype=raw)
    for name in norms:
        w.add_tensor_info(name, (D,), np.dtype(np.float32), D * 4)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
    sources = {}
    for name, r, c in mats:
        t = type_of(name)
        if t not in sources:  # made once per type: setdefault would draw it for every matrix
            sources[t] = random_source(t)
        src = sources[t]
        n = r * row_bytes(name, c)
        data = np.tile(src, -(-n // src.size))[:n]
        w.write_tensor_data(data.view(np.float16).reshape(r, c) if t == "f16" else data.reshape(r, row_bytes(name, c)))
    for _ in norms:
        w.write_tensor_data(np.ones(D, dtype=np.float32))
    w.close()
    print(f"wrote {a.out} ({a.shape}, {a.dtype}) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
