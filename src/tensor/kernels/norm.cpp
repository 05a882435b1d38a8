#include <cmath>
#include <vector>

#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "vec_math.hpp"

namespace acc::kernels {
namespace {
int64_t row_grain(int64_t C) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1));
}
}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t C, float eps) {
  parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* xr = x + n * C;
      const float m = vec::sum(xr, C) / static_cast<float>(C);
      const float v = vec::sum_sq_dev(xr, m, C) / static_cast<float>(C);
      float s = 1.f / std::sqrt(v + eps);
      float* o = out + n * C;
      if (b) {
        for (int64_t i = 0; i < C; ++i) o[i] = (xr[i] - m) * s * w[i] + b[i];
      } else {
        for (int64_t i = 0; i < C; ++i) o[i] = (xr[i] - m) * s * w[i];
      }
      mean[n] = m;
      rstd[n] = s;
    }
  });
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                        const float* w, const float* mean, const float* rstd, int64_t N,
                        int64_t C) {
  // dx rows are independent; dw/db are reductions over rows, done per thread chunk in private
  // buffers and summed in chunk order so the result does not depend on scheduling.
  const int64_t grain = row_grain(C);
  const int64_t nchunks = (N + grain - 1) / grain;
  std::vector<float> part_dw(dw ? static_cast<size_t>(nchunks * C) : 0, 0.f);
  std::vector<float> part_db(db ? static_cast<size_t>(nchunks * C) : 0, 0.f);
  parallel_for(nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* pdw = dw ? part_dw.data() + c * C : nullptr;
      float* pdb = db ? part_db.data() + c * C : nullptr;
      for (int64_t n = c * grain; n < std::min(N, (c + 1) * grain); ++n) {
        const float* xr = x + n * C;
        const float* g = dout + n * C;
        const float m = mean[n], s = rstd[n];
        // sum(g w) and sum(g w xhat) = s * sum(g w (x - m)), in 16 lanes each.
        float lane_g[16] = {0}, lane_gx[16] = {0};
        int64_t i0 = 0;
        for (; i0 + 16 <= C; i0 += 16) {
          for (int j = 0; j < 16; ++j) {
            const float gw = g[i0 + j] * w[i0 + j];
            lane_g[j] += gw;
            lane_gx[j] += gw * (xr[i0 + j] - m);
          }
        }
        float sum_g = 0.f, sum_gx_raw = 0.f;
        for (int j = 0; j < 16; ++j) {
          sum_g += lane_g[j];
          sum_gx_raw += lane_gx[j];
        }
        for (; i0 < C; ++i0) {
          sum_g += g[i0] * w[i0];
          sum_gx_raw += g[i0] * w[i0] * (xr[i0] - m);
        }
        float sum_gx = sum_gx_raw * s;
        sum_g /= static_cast<float>(C);
        sum_gx /= static_cast<float>(C);
        float* __restrict d = dx + n * C;
        for (int64_t i = 0; i < C; ++i) {
          const float xhat = (xr[i] - m) * s;
          d[i] = (g[i] * w[i] - sum_g - xhat * sum_gx) * s;
        }
        if (pdw) {
          float* __restrict a = pdw;
          for (int64_t i = 0; i < C; ++i) a[i] += g[i] * (xr[i] - m) * s;
        }
        if (pdb) {
          float* __restrict a = pdb;
          for (int64_t i = 0; i < C; ++i) a[i] += g[i];
        }
      }
    }
  });
  for (int64_t c = 0; c < nchunks; ++c) {
    if (dw) {
      for (int64_t i = 0; i < C; ++i) dw[i] += part_dw[c * C + i];
    }
    if (db) {
      for (int64_t i = 0; i < C; ++i) db[i] += part_db[c * C + i];
    }
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps) {
  parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* xr = x + n * C;
      const float ss = vec::dot(xr, xr, C);
      const float s = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
      float* o = out + n * C;
      for (int64_t i = 0; i < C; ++i) o[i] = xr[i] * s * w[i];
      rstd[n] = s;
    }
  });
}

void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
  const int64_t grain = row_grain(C);
  const int64_t nchunks = (N + grain - 1) / grain;
  std::vector<float> part_dw(dw ? static_cast<size_t>(nchunks * C) : 0, 0.f);
  parallel_for(nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* pdw = dw ? part_dw.data() + c * C : nullptr;
      for (int64_t n = c * grain; n < std::min(N, (c + 1) * grain); ++n) {
        const float* xr = x + n * C;
        const float* g = dout + n * C;
        const float s = rstd[n];
        float lane[16] = {0};
        int64_t i0 = 0;
        for (; i0 + 16 <= C; i0 += 16) {
          for (int j = 0; j < 16; ++j) lane[j] += g[i0 + j] * w[i0 + j] * xr[i0 + j];
        }
        float dot = 0.f;
        for (int j = 0; j < 16; ++j) dot += lane[j];
        for (; i0 < C; ++i0) dot += g[i0] * w[i0] * xr[i0];
        const float k = dot * s * s / static_cast<float>(C);
        float* __restrict d = dx + n * C;
        for (int64_t i = 0; i < C; ++i) d[i] = s * (g[i] * w[i] - xr[i] * k);
        if (pdw) {
          float* __restrict a = pdw;
          for (int64_t i = 0; i < C; ++i) a[i] += g[i] * xr[i] * s;
        }
      }
    }
  });
  if (dw) {
    for (int64_t c = 0; c < nchunks; ++c) {
      for (int64_t i = 0; i < C; ++i) dw[i] += part_dw[c * C + i];
    }
  }
}

void softmax_forward(float* out, const float* x, int64_t N, int64_t C) {
  parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* xr = x + n * C;
      float* o = out + n * C;
      const float mx = vec::max(xr, C);
      for (int64_t i = 0; i < C; ++i) o[i] = vec::exp(xr[i] - mx);
      const float inv = 1.f / vec::sum(o, C);
      for (int64_t i = 0; i < C; ++i) o[i] *= inv;
    }
  });
}

void softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* yr = y + n * C;
      const float* g = dy + n * C;
      const float dot = vec::dot(yr, g, C);
      float* d = dx + n * C;
      for (int64_t i = 0; i < C; ++i) d[i] = yr[i] * (g[i] - dot);
    }
  });
}

void log_softmax_forward(float* out, const float* x, int64_t N, int64_t C) {
  parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* xr = x + n * C;
      const float mx = vec::max(xr, C);
      const float lse = mx + std::log(vec::sum_exp(xr, mx, C));
      float* o = out + n * C;
      for (int64_t i = 0; i < C; ++i) o[i] = xr[i] - lse;
    }
  });
}

void log_softmax_backward(float* dx, const float* y, const float* dy, int64_t N, int64_t C) {
  parallel_for(N, row_grain(C), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* yr = y + n * C;
      const float* g = dy + n * C;
      const float s = vec::sum(g, C);
      float* d = dx + n * C;
      for (int64_t i = 0; i < C; ++i) d[i] = g[i] - vec::exp(yr[i]) * s;
    }
  });
}

}  // namespace acc::kernels
