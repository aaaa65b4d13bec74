#!/usr/bin/env python3
"""Golden dequantization of GGUF's 5-bit and K-quant block types, from the `gguf` Python package.

Writes tests/golden/kquants.json: for each type, random blocks (seeded, with finite f16 scales in the
range real quantizers produce) as hex, and the float32 values gguf-py's reference dequantizer gives
for them, as the hex of their bit patterns. turbo-core's test `kquants_dequantize_like_gguf_py`
decodes the same bytes and must match bit for bit.

    python3 -m pip install --target /tmp/pydeps gguf numpy
    PYTHONPATH=/tmp/pydeps python3 scripts/kquant_golden.py
"""
import json, os
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# type: (bytes per block, offsets of its f16 scale fields)
LAYOUT = {
    T.Q5_0: (22, [0]),
    T.Q5_1: (24, [0, 2]),
    T.Q2_K: (84, [80, 82]),
    T.Q3_K: (110, [108]),
    T.Q4_K: (144, [0, 2]),
    T.Q5_K: (176, [0, 2]),
    T.Q6_K: (210, [208]),
}
BLOCKS = 16

def main():
    rng = np.random.default_rng(20261127)
    out = {"generator": "scripts/kquant_golden.py (gguf-py quants.dequantize)", "types": {}}
    for t, (size, scales) in LAYOUT.items():
        raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
        for at in scales:
            # Scales of either sign (a minimum's scale can be negative in a hand-made file), a few exact zeros.
            v = (rng.standard_normal(BLOCKS) * 0.02).astype(np.float16)
            v[0] = 0.0
            raw[:, at:at + 2] = v.view(np.uint8).reshape(BLOCKS, 2)
        values = dequantize(raw.reshape(-1), t).astype(np.float32).reshape(-1)
        out["types"][t.name] = {
            "blocks": [bytes(b).hex() for b in raw],
            "values": values.view(np.uint32).tolist(),
        }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "kquants.json")
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print("wrote", os.path.normpath(path))

if __name__ == "__main__":
    main()
