"""CUDA sources of the GPU backend (pooling, batch normalization, dropout masks) and its elementwise kernels
(ReLU, BatchNorm's running statistics, the SGD and Adam/AdamW updates)."""

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

# Batch normalization of x (N, C, L): per-channel sums in float64, in two launches each, deterministic (no
# atomics): bn_partials gives S partial sums per channel (block (c, s) takes the s-th share of channel c's
# N * L values), a finishing kernel adds them in order and derives the per-channel coefficients; then one
# elementwise pass applies them. The rounding of the tensors' own arithmetic is that of Backend's NumPy
# form (a product, then a sum, each rounded to float32: no fused multiply-add).
BN_SRC = r"""
#define BN_THREADS 256
extern "C" {
// mode 0: sum(x); mode 1: sum((x - mean)^2); mode 2: sum(dy) and sum(dy * (x - mean))
__global__ void bn_partials(const float* x, const float* dy, const double* mean, double* part0, double* part1,
                            int mode, int C, long long L, long long NL, int S) {
    int c = blockIdx.x, s = blockIdx.y, t = threadIdx.x;
    long long chunk = (NL + S - 1) / S;
    long long k0 = (long long)s * chunk, k1 = min(NL, k0 + chunk);
    double m = mode ? mean[c] : 0.0, a0 = 0.0, a1 = 0.0;
    for (long long k = k0 + t; k < k1; k += BN_THREADS) {
        long long n = k / L;
        long long at = (n * C + c) * L + (k - n * L);
        double v = x[at];
        if (mode == 0) {
            a0 += v;
        } else if (mode == 1) {
            double d = v - m;
            a0 += d * d;
        } else {
            double g = dy[at];
            a0 += g;
            a1 += g * (v - m);
        }
    }
    __shared__ double s0[BN_THREADS], s1[BN_THREADS];
    s0[t] = a0;
    s1[t] = a1;
    __syncthreads();
    for (int w = BN_THREADS / 2; w > 0; w >>= 1) {
        if (t < w) {
            s0[t] += s0[t + w];
            s1[t] += s1[t + w];
        }
        __syncthreads();
    }
    if (t == 0) {
        part0[c * S + s] = s0[0];
        if (mode == 2) part1[c * S + s] = s1[0];
    }
}

__global__ void bn_mean(const double* part, double* mean, int C, int S, double m) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double sum = 0.0;
    for (int s = 0; s < S; s++) sum += part[c * S + s];
    mean[c] = sum / m;
}

// var, inv_std = 1 / sqrt(var + eps), and the affine map's a = weight * inv_std, b = bias - mean * a (float32)
__global__ void bn_forward_coefficients(const double* part, const double* mean, const float* weight,
                                        const float* bias, int C, int S, double m, double eps, double* var,
                                        double* inv_std, float* a, float* b) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double sum = 0.0;
    for (int s = 0; s < S; s++) sum += part[c * S + s];
    double v = sum / m, inv = 1.0 / sqrt(v + eps), scale = (double)weight[c] * inv;
    var[c] = v;
    inv_std[c] = inv;
    a[c] = (float)scale;
    b[c] = (float)((double)bias[c] - mean[c] * scale);
}

// db = sum(dy), dw = sum(dy * xhat), and dx = k1 * dy + k2 * x + k0 (base.batchnorm_dx_coefficients)
__global__ void bn_backward_coefficients(const double* part0, const double* part1, const double* mean,
                                         const double* inv_std, const float* weight, int C, int S, double m,
                                         double* db, double* dw, float* k1, float* k2, float* k0) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double sum_dy = 0.0, sum_dy_xc = 0.0;
    for (int s = 0; s < S; s++) {
        sum_dy += part0[c * S + s];
        sum_dy_xc += part1[c * S + s];
    }
    double inv = inv_std[c], dweight = sum_dy_xc * inv, scale = (double)weight[c] * inv;
    double c2 = -scale * inv * (dweight / m);
    db[c] = sum_dy;
    dw[c] = dweight;
    k1[c] = (float)scale;
    k2[c] = (float)c2;
    k0[c] = (float)(-scale * (sum_dy / m) - c2 * mean[c]);
}

__global__ void bn_affine(const float* x, const float* a, const float* b, float* y, long long total, int C,
                          long long L) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int c = (int)((i / L) % C);
    y[i] = __fadd_rn(__fmul_rn(x[i], a[c]), b[c]);
}

__global__ void bn_affine_dx(const float* dy, const float* x, const float* k1, const float* k2, const float* k0,
                             float* dx, long long total, int C, long long L) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= total) return;
    int c = (int)((i / L) % C);
    dx[i] = __fadd_rn(__fadd_rn(__fmul_rn(x[i], k2[c]), k0[c]), __fmul_rn(dy[i], k1[c]));
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
def elementwise_kernels():
    """(relu, relu backward, BatchNorm running update): CuPy elementwise kernels, one pass each.

    ReLU keeps NaN (as np.maximum does); its gradient is dy times the mask, so a NaN or infinite dy
    stays NaN where the mask is 0, as dy * (y > 0) does. The running update rounds as the NumPy form of
    Backend.batchnorm_update_running: running * (1 - momentum) in float32, then the float64 term added."""
    import cupy

    relu = cupy.ElementwiseKernel(
        "T x, T cap, bool capped", "T y",
        "y = (x != x) ? x : (x > (T)0 ? ((capped && x > cap) ? cap : x) : (T)0);", "pydtnn_relu")
    relu_backward = cupy.ElementwiseKernel(
        "T dy, T y, T cap, bool capped", "T dx",
        "dx = dy * (T)((y > (T)0) && (!capped || y < cap));", "pydtnn_relu_backward")
    running = cupy.ElementwiseKernel(
        "float64 mean, float64 var, float32 keep, float64 momentum, float64 var_factor",
        "float32 running_mean, float32 running_var",
        """
        running_mean = (float)((double)(running_mean * keep) + momentum * mean);
        running_var = (float)((double)(running_var * keep) + var_factor * var);
        """, "pydtnn_bn_running")
    return relu, relu_backward, running


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
