"""The CPU's features and the vector width of the compiled kernels: the CPU's own, or the one
$PYDTNN_VECTOR_BITS forces. cpu_features() is the one reading of /proc/cpuinfo (the width below, and the
model and ISA that autotune.py's cache keys name).

The register-blocked kernels (kernels/conv3x3.py, convkxk.py, col2im.py, vectors.py) are written as
LLVM IR vectors of VECTOR_BITS bits, and the direct convolution's layout (conv_direct.dense_layout)
rounds to whole vectors of that width. Numba compiles them for the CPU they run on, so the instructions
are that CPU's; the width is chosen once per process, from its features (/proc/cpuinfo):

- 512 where the CPU has AVX-512F (16 float32 lanes; 32 vector registers hold a block's 12
  accumulators with room to spare),
- 256 where it has AVX2 (8 float32 lanes, FMA),
- 128 otherwise: the portable path (SSE2, which every x86-64 CPU has; LLVM emits what the CPU has).

PYDTNN_VECTOR_BITS=128, 256 or 512 forces a width, whatever the CPU: a wider one than the CPU's runs
correctly (LLVM splits each vector into the CPU's), which is how the tests check every path on any
machine. A forced width other than the CPU's keeps its compiled kernels in a cache folder of its own
(kernels/jit.py), so that the two never mix.
"""

import functools

from pydtnn import env

WIDTHS = env.VECTOR_BITS


@functools.cache
def cpu_features(path="/proc/cpuinfo"):
    """(model name, feature flags) of this CPU, from the first processor listed in `path`:
    ('AMD EPYC 7B13', frozenset({'avx2', 'fma', ...})); ('unknown', frozenset()) where it cannot be read.
    The one reading of the CPU: the kernels' width (native_bits) and the autotune cache key (isa_name)."""
    model, flags = "unknown", frozenset()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "Model", "cpu model") and model == "unknown" and value.strip():
                    model = " ".join(value.split())  # x86 names it "model name"; ARM "Model", MIPS "cpu model"
                elif name == "flags" and not flags:
                    flags = frozenset(value.split())
                if model != "unknown" and flags:
                    break
    except OSError:
        pass
    return model, flags


def native_bits(flags=None):
    """512 with AVX-512F, 256 with AVX2 and FMA, else 128; flags: cpu_features()'s unless given."""
    flags = cpu_features()[1] if flags is None else flags
    if "avx512f" in flags:
        return 512
    if "avx2" in flags and "fma" in flags:
        return 256
    return 128


def isa_name(flags=None):
    """'avx512f', 'avx2' or 'other': the vector ISA named in the autotune cache's keys (AVX2 without FMA is
    'avx2' there, as keys already written say); flags: cpu_features()'s unless given."""
    flags = cpu_features()[1] if flags is None else flags
    return "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"


def chosen_bits():
    """$PYDTNN_VECTOR_BITS when set (env.vector_bits: ConfigError unless 128, 256 or 512), else native_bits()."""
    return env.vector_bits() or native_bits()


VECTOR_BITS = chosen_bits()
VECTOR_BYTES = VECTOR_BITS // 8


def describe():
    """"256-bit vectors, the CPU's" or "128-bit vectors, forced by PYDTNN_VECTOR_BITS (the CPU's: 256)"."""
    native = native_bits()
    if VECTOR_BITS == native:
        return f"{VECTOR_BITS}-bit vectors, the CPU's"
    return f"{VECTOR_BITS}-bit vectors, forced by PYDTNN_VECTOR_BITS (the CPU's: {native})"
