"""CUDA sources of the GPU backend (pooling, dropout masks) and its elementwise SGD and Adam/AdamW update kernels."""

import functools

# -- CUDA kernels ----------------------------------------------------------------------------
POOL_SRC = r"""
typedef float real;
extern "C" {
__global__ void maxpool_fwd(const real* x, real* y, int* arg, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int wo = i % Wo, ho = (i / Wo) % Ho;
    long long nc = i / ((long long)Wo * Ho);
    const real* xc = x + nc * H * W;
    int h0 = ho * sh - pt, w0 = wo * sw - pl, best_at = -1;
    real best = -__int_as_float(0x7f800000);
    for (int a = 0; a < kh; a++) {
        int h = h0 + a;
        if (h < 0 || h >= H) continue;
        for (int b = 0; b < kw; b++) {
            int w = w0 + b;
            if (w < 0 || w >= W) continue;
            real v = xc[h * W + w];
            // the first maximum in row-major window order wins; NaN wins over numbers
            if (best_at < 0 || v > best || (v != v && best == best)) { best = v; best_at = h * W + w; }
        }
    }
    y[i] = best;
    arg[i] = best_at;
}

// first output row (column) whose window reaches input row h: ceil((h + pt - kh + 1) / sh), at least 0
__device__ int first_window(int h, int pt, int kh, int sh) {
    int a = h + pt - kh + 1;
    return a <= 0 ? 0 : (a + sh - 1) / sh;
}

// dx[p] = sum of dy[o] over the windows o that contain p and whose maximum was p: a gather, no atomics
__global__ void maxpool_bwd(const real* dy, const int* arg, real* dx, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int w = i % W, h = (i / W) % H;
    long long nc = i / ((long long)W * H);
    int p = h * W + w;
    int ho1 = min(Ho - 1, (h + pt) / sh), wo1 = min(Wo - 1, (w + pl) / sw);
    real s = 0;
    for (int ho = first_window(h, pt, kh, sh); ho <= ho1; ho++)
        for (int wo = first_window(w, pl, kw, sw); wo <= wo1; wo++) {
            long long o = (nc * Ho + ho) * Wo + wo;
            if (arg[o] == p) s += dy[o];
        }
    dx[i] = s;
}

// mean over the window; zero padding counts in the divisor (kh * kw), as PyTorch's default
__global__ void avgpool_fwd(const real* x, real* y, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int wo = i % Wo, ho = (i / Wo) % Ho;
    long long nc = i / ((long long)Wo * Ho);
    const real* xc = x + nc * H * W;
    int h0 = ho * sh - pt, w0 = wo * sw - pl;
    real s = 0;
    for (int a = max(0, -h0); a < kh && h0 + a < H; a++)
        for (int b = max(0, -w0); b < kw && w0 + b < W; b++) s += xc[(h0 + a) * W + w0 + b];
    y[i] = s / (real)(kh * kw);
}

__global__ void avgpool_bwd(const real* dy, real* dx, long long total, int H, int W, int Ho, int Wo,
                            int kh, int kw, int sh, int sw, int pt, int pl) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int w = i % W, h = (i / W) % H;
    long long nc = i / ((long long)W * H);
    int ho1 = min(Ho - 1, (h + pt) / sh), wo1 = min(Wo - 1, (w + pl) / sw);
    real s = 0;
    for (int ho = first_window(h, pt, kh, sh); ho <= ho1; ho++)
        for (int wo = first_window(w, pl, kw, sw); wo <= wo1; wo++) s += dy[(nc * Ho + ho) * Wo + wo];
    dx[i] = s / (real)(kh * kw);
}
}
"""

# splitmix64 of (seed, index): a uniform 24-bit number per element, compared with the drop rate
DROPOUT_SRC = r"""
unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ULL;
z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
z = z ^ (z >> 31);
float u = (float)(z >> 40) * (1.0f / 16777216.0f);
mask = u >= rate ? (T)scale : (T)0;
"""


@functools.cache
def update_kernels():
    """(sgd, sgd with momentum, adam): CuPy elementwise kernels of Backend.sgd_update and adam_update."""
    import cupy

    sgd = cupy.ElementwiseKernel(
        "T g, T lr, T wd", "T p", "p = p - lr * (g + wd * p);", "pydtnn_sgd")
    sgd_momentum = cupy.ElementwiseKernel(
        "T g, T lr, T wd, T momentum, T keep, bool nesterov, bool first", "T p, T buf",
        """
        T d = g + wd * p;
        buf = first ? d : momentum * buf + keep * d;
        p = p - lr * (nesterov ? d + momentum * buf : buf);
        """, "pydtnn_sgd_momentum")
    adam = cupy.ElementwiseKernel(
        "T g, T lr_t, T one_m_beta1, T beta2, T one_m_beta2, T eps, T wd, T decay, T bc2_sqrt", "T p, T m, T v",
        """
        p = p * decay;
        T d = g + wd * p;
        m = m + one_m_beta1 * (d - m);
        v = beta2 * v + one_m_beta2 * d * d;
        p = p - lr_t * m / (sqrt(v) / bc2_sqrt + eps);
        """, "pydtnn_adam")
    return sgd, sgd_momentum, adam
