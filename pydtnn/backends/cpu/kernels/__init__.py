"""Compiled CPU kernels (Numba), one module per family; the CPU backend imports them (and with them
Numba and LLVM, about 100 MB of memory) only when a layer first uses one.

- conv3x3.py       one-group 3x3 stride-1 convolution: register-blocked blocks written as LLVM IR
                   vectors (vectors.py); the forward keeps every sample's padded input for the
                   weight gradient, and dx is the forward applied to dy with flipped, transposed weights
- convkxk.py       one-group 5x5 and 7x7 stride-1 convolution: conv3x3.py's layout and blocks, the
                   k*k taps a loop in the forward block, the weight gradient in groups of three taps
- depthwise3x3.py  depthwise 3x3 stride-1 convolution: a 9-tap row sum LLVM vectorizes
- winograd.py      Winograd F(2x2, 3x3) input and output transforms, and dy's F(3x3, 2x2) transform
                   for the weight gradient (the 16 products each way are BLAS GEMMs)
- col2im.py        a strided convolution's dx from its per-position shares; dx's flipped weights
- normalization.py training-mode BatchNorm, one channel at a time through all its passes
- elementwise.py   the convolution bias, ReLU (capped: ReLU6)
- pooling.py       max pooling over any window, 2x2 stride-2 average pooling
- updates.py       SGD and Adam/AdamW updates (the math of pydtnn/backends/base.py, same order)
- vectors.py       IR vector helpers, vector copies and padding, of the width isa.py picks (the
                   CPU's: 512 bits with AVX-512F, 256 with AVX2, 128 otherwise; $PYDTNN_VECTOR_BITS
                   forces one, so every width is tested on any x86-64)
- jit.py           the decorators, the on-disk cache, the launcher of the *_chunks twins

im2col + GEMM copies the input nine times into a matrix that does not fit in cache, and with 16-64
channels the GEMM has too small a dimension for BLAS to reach its peak. The convolution kernels never
build that matrix: each sample's input is padded into a scratch array, and outputs are computed on the
"wide" grid q = ho*Wp + wo (wo running over the padded width Wp, the columns wo >= Wo computed and
dropped), where every tap of the kernel is one fixed offset into the padded input.

Every kernel splits by samples, channels or elements so that the result does not depend on the thread
count. The NumPy path of the CPU backend stays the reference and the fallback (kernels="numpy" or
PYDTNN_CPU_KERNELS=numpy); tests/test_cpu_kernels.py checks that both agree.
"""
