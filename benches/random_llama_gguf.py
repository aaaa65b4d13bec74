"""Writes a LLaMA-shaped GGUF with random weights, for benchmarks at real model sizes, F16 or Q8_0.

Tensors are written one at a time, so a 70B shape (75 GB in Q8_0, too large for a 128 GB disk in F16)
needs little memory. Values do not change speed: one random block is tiled. The vocabulary is the
tokenizer's (SmolLM2's 49,152 tokens from --tokenizer, a `tokenizer.ggml.*` JSON dump, gzipped).
Needs numpy and the `gguf` Python package.

    python3 benches/random_llama_gguf.py OUT.gguf --shape llama3-70b --dtype q8_0 --tokenizer smollm2-tokenizer.json.gz
"""
import argparse, gzip, json, time
import numpy as np
import gguf

SHAPES = {  # hidden, layers, heads, kv heads, ffn, rope theta
    "llama3-8b": (4096, 32, 32, 8, 14336, 500000.0),
    "llama3-70b": (8192, 80, 64, 8, 28672, 500000.0),
    "tiny": (256, 2, 4, 2, 512, 10000.0),
}
Q8 = gguf.GGMLQuantizationType.Q8_0


def random_source(dtype, nbytes=1 << 26):
    """A random byte pattern of whole blocks: F16 values of sd 0.02, or Q8_0 blocks (f16 scale, 32 int8)."""
    rng = np.random.default_rng(0)
    if dtype == "f16":
        return (rng.standard_normal(nbytes // 2, dtype=np.float32) * 0.02).astype(np.float16).view(np.uint8)
    blocks = nbytes // 34
    out = np.empty((blocks, 34), dtype=np.uint8)
    out[:, :2] = np.full((blocks, 1), 0.02 / 40, dtype=np.float16).view(np.uint8)
    out[:, 2:] = np.clip(rng.standard_normal((blocks, 32)) * 40, -127, 127).astype(np.int8).view(np.uint8)
    return out.reshape(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama3-8b", choices=SHAPES)
    ap.add_argument("--dtype", default="f16", choices=["f16", "q8_0"])
    ap.add_argument("--tokenizer", required=True)
    a = ap.parse_args()
    t0 = time.time()
    tok = json.load(gzip.open(a.tokenizer))
    D, L, H, KV, F, theta = SHAPES[a.shape]
    V, hd = len(tok["tokenizer.ggml.tokens"]), D // H
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_context_length(8192); w.add_embedding_length(D); w.add_block_count(L); w.add_feed_forward_length(F)
    w.add_head_count(H); w.add_head_count_kv(KV); w.add_rope_freq_base(theta); w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hd); w.add_vocab_size(V); w.add_file_type(1 if a.dtype == "f16" else 7)
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
    row_bytes = (lambda c: 2 * c) if a.dtype == "f16" else (lambda c: c // 32 * 34)
    for name, r, c in mats:
        if a.dtype == "f16":
            w.add_tensor_info(name, (r, c), np.dtype(np.float16), r * c * 2)
        else:
            w.add_tensor_info(name, (r, row_bytes(c)), np.dtype(np.uint8), r * row_bytes(c), raw_dtype=Q8)
    for name in norms:
        w.add_tensor_info(name, (D,), np.dtype(np.float32), D * 4)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
    src = random_source(a.dtype)
    for name, r, c in mats:
        n = r * row_bytes(c)
        data = np.tile(src, -(-n // src.size))[:n]
        w.write_tensor_data(data.view(np.float16).reshape(r, c) if a.dtype == "f16" else data.reshape(r, row_bytes(c)))
    for _ in norms:
        w.write_tensor_data(np.ones(D, dtype=np.float32))
    w.close()
    print(f"wrote {a.out} ({a.shape}, {a.dtype}) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
