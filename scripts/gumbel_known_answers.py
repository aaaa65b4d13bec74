"""Known answers of Keyformer's counter-based Gumbel noise (turbo_keyformer::gumbel), computed
with Python integers, independently of the Rust and CUDA ports:

    python3 scripts/gumbel_known_answers.py

prints, per counter (seed, step, layer, head, key), `gumbel_bits`, the uniform's f32 bits and
the uniform, as frozen in crates/turbo-keyformer/src/gumbel.rs.
"""

import struct

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def mix32(x):
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & M32
    return x ^ (x >> 16)


def gumbel_bits(seed, step, layer, head, key):
    h = mix(seed ^ GAMMA)
    h = mix(h ^ ((step << 32) | layer) ^ GAMMA)
    x = mix32((h & M32) ^ key)
    return mix32(x ^ (h >> 32) ^ head)


def uniform(bits):
    u = (2 * (bits >> 9) + 1) / 16777216.0  # exact in f32
    return struct.unpack("<I", struct.pack("<f", u))[0], u


for counter in [(0, 0, 0, 0, 0), (1, 2, 3, 4, 5), (0xDEADBEEF, 17, 31, 7, 4095), (M64, M32, M32, M32, M32)]:
    bits = gumbel_bits(*counter)
    ubits, u = uniform(bits)
    print(counter, f"0x{bits:08X}", f"0x{ubits:08X}", f"{u:.8f}")
