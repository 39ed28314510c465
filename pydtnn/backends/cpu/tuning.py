"""Every tuning value of the CPU backend, in one object: which algorithm takes which layer, and from
what size a kernel is split over the threads or compiled. Measured on a 2-core AVX2 VM
(docs/performance.md); a backend takes its own (CPUBackend(tuning=...)), so two can differ."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    # Columns of the convolution GEMMs of forward and dx: a sample with fewer output pixels shares its
    # GEMM with the next samples.
    gemm_min_columns: int = 128
    # A GEMM split over its rows cuts them at multiples of this (whole register blocks).
    row_step: int = 8
    # A GEMM's work, for the rule on what is too small to split, in bytes: its FLOPs over this (BLAS does
    # about 80 GFLOP/s per core here, NumPy copies about 10 GB/s). By their operands alone, MobileNetV1's
    # 512- and 1024-channel 1x1 layers at 4x4 and 2x2 (4-5 ms of GEMM) ran on one thread.
    gemm_flops_per_byte: int = 8
    # Narrowest output computed by the compiled one-group 3x3 kernels: they compute Wo + 2 columns per
    # output row, and on narrower images im2col + GEMM is faster.
    direct_min_width: int = 8
    # Below twice that width, layers with this many input channels or more take im2col + GEMM too: the
    # compiled weight gradient loses to the GEMM's there (256 -> 256 channels at 8x8, batch 64: backward
    # 164 against 147 ms on one thread, 113 against 83 on two).
    direct_narrow_max_channels: int = 256
    # The weight gradient of the compiled one-group 3x3 kernels sums over this many bytes of padded input
    # at a time (a chunk of samples), so that they stay in cache.
    direct_chunk_bytes: int = 1 << 20
    # The NumPy depthwise convolution works in batch chunks of about this many bytes of output, so the
    # running sums stay in cache.
    depthwise_chunk_bytes: int = 1 << 20
    # The weight gradient of a one-group 1x1 stride-1 layer sums its per-sample products in blocks of
    # this many samples, one partial sum per block.
    pointwise_block: int = 8
    # From this size on, the flipped, transposed weights of a GEMM-path dx are copied by a compiled
    # kernel (NumPy's copy of the reversed view: 2-4 ms for 512 x 512 x 3 x 3, the kernel 1.2-1.7).
    flip_compiled_min_bytes: int = 1 << 20
    # From this size on, a convolution's bias is added and summed by compiled kernels: NumPy's sum over
    # axes (0, 2, 3) takes 0.7 ms for (64, 512, 2, 2), the kernel 0.2; below it Numba is not loaded for it.
    bias_compiled_min_bytes: int = 1 << 18
    # Compiled BatchNorm is split over channels only from this tensor size: below it a hand-off to the
    # threads costs more than the second core saves.
    batchnorm_split_bytes: int = 1 << 20
    # The NumPy BatchNorm works in batch chunks of this many bytes of input: a chunk, its centered copy
    # and the matching dy fit in L2, so the centering done inside a reduction never goes back to memory.
    batchnorm_chunk_bytes: int = 1 << 18
    # Parameters of at least this size take the compiled SGD and Adam updates (VGG-11's 28 M parameters,
    # SGD with momentum: 45 -> 32 ms a step on one thread, 41 -> 23 on two; Adam 131 -> 30 and 25);
    # smaller ones stay in cache through the NumPy passes.
    update_compiled_min_bytes: int = 1 << 20
    # Below this many bytes of work a kernel runs unsplit: handing a chunk to another thread and taking
    # it back costs 30-100 microseconds here, which is what NumPy takes for about 1 MB.
    split_min_bytes: int = 1 << 21


DEFAULT = Tuning()  # what a CPUBackend made without tuning= takes
