#!/usr/bin/env python3
"""Export the SmolLM2-135M-Instruct GGUF as a real HF-layout checkpoint (safetensors + config + tokenizer).

Command (from the repo root; same venv/versions as make_golden.py):

    /work/venv/bin/python tests/golden/export_hf.py \
        --gguf /work/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out /work/models/smollm2-hf --out-bf16 /work/models/smollm2-hf-bf16

Versions: python 3.11.7, torch 2.15.0, transformers 5.23.0, tokenizers 0.23.3, gguf 0.19.0,
accelerate 1.15.0, safetensors 0.8.0, numpy 2.4.6.

The weights are the transformers-dequantized GGUF weights (Q4_1/Q8_0 -> f32, q/k un-permuted into
HF layout), i.e. exactly the weights make_golden.py ran; so the f32 export reproduces
smollm2_greedy.json. lm_head is tied to embed_tokens (config tie_word_embeddings=true; the
safetensors file holds only model.embed_tokens.weight). The GGUF quantization_config is dropped
from config.json so the directory loads as a plain Llama checkpoint. The tokenizer is saved with
the fixed pre-tokenizer Sequence[Digits(individual_digits=True), ByteLevel(...)] (see
make_golden.py TOKENIZER NOTE). The bf16 copy is the f32 weights cast with round-to-nearest-even.
"""

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.dont_write_bytecode = True  # don't leave __pycache__ in the repo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import load_tokenizer  # noqa: E402


def strip_gguf_quant(model):
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from GGUF Q4_1, dequantized)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="/work/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default="/work/models/smollm2-hf")
    ap.add_argument("--out-bf16", default="/work/models/smollm2-hf-bf16")
    args = ap.parse_args()

    gguf_dir, gguf_name = os.path.split(os.path.abspath(args.gguf))
    tok, info = load_tokenizer(gguf_dir, gguf_name)
    print("pre_tokenizer patched:", info["patched"])
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    model.eval()
    strip_gguf_quant(model)

    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)

    # Verify: reload the export and compare logits + tokenization against the in-memory model.
    prompt = "The capital of France is 12345"
    ids = tok.encode(prompt, add_special_tokens=False)
    tok2 = AutoTokenizer.from_pretrained(args.out)
    assert tok2.encode(prompt, add_special_tokens=False) == ids, "reloaded tokenizer differs"
    assert "Digits" in json.dumps(json.loads(tok2.backend_tokenizer.to_str())["pre_tokenizer"])
    m2 = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    with torch.no_grad():
        x = torch.tensor([ids])
        a = model(input_ids=x).logits
        b = m2(input_ids=x).logits
    print("f32 reload max |dlogit|:", float((a - b).abs().max()))
    assert torch.equal(a, b)

    if args.out_bf16:
        mb = model.to(torch.bfloat16)
        mb.config.dtype = torch.bfloat16
        mb.save_pretrained(args.out_bf16, safe_serialization=True)
        tok.save_pretrained(args.out_bf16)
        m3 = AutoModelForCausalLM.from_pretrained(args.out_bf16, dtype=torch.float32)
        with torch.no_grad():
            c = m3(input_ids=x).logits
        print("bf16-weights (f32 compute) vs f32 max |dlogit|:", float((a - c).abs().max()),
              "argmax equal:", bool((a.argmax(-1) == c.argmax(-1)).all()))

    for d in [args.out, args.out_bf16]:
        if d:
            print(d, sorted(os.listdir(d)))


if __name__ == "__main__":
    main()
