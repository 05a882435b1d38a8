#pragma once
// Gradient-norm clipping, torch.nn.utils.clip_grad_norm_ semantics, split into pieces so that
// data-parallel code can all-reduce partial norms:
//
//   double part = grad_norm_partial(local_params, p);      // sum |g|^p, or max |g| for p = inf
//   allreduce(part, p == inf ? MAX : SUM);
//   double norm = total_norm_from_partial(part, p);
//   clip_grads_with_norm_(local_params, max_norm, norm);
//
// or, with the scaling fused into the optimizer's update (no pass over the gradients):
//
//   optimizer.step_scaled(clip_coefficient(max_norm, norm));
//
// Parameters whose grad() is undefined are skipped. Norms accumulate in double, in a fixed chunk
// order, so the result does not depend on the number of threads. Every function throws
// acc::TypeError when a gradient is not f32 or not contiguous, naming the parameter.

#include "acc/optim/optimizer.hpp"

namespace acc::optim {

/// Sum of g * g over every gradient (the partial of the 2-norm).
double grad_norm_squared(const NamedParams& params);

/// Sum of |g|^norm_type over every gradient, or max |g| when norm_type is infinity (0 without
/// gradients). Throws acc::ValueError unless norm_type > 0.
double grad_norm_partial(const NamedParams& params, double norm_type = 2.0);

/// partial^(1 / norm_type), or partial itself when norm_type is infinity. Throws acc::ValueError
/// unless norm_type > 0.
double total_norm_from_partial(double partial, double norm_type = 2.0);

/// The norm of all gradients together, as if concatenated into one vector. Throws as
/// grad_norm_partial.
double get_total_norm(const NamedParams& params, double norm_type = 2.0);

/// Multiplies every gradient by clip_coef = max_norm / (total_norm + 1e-6) when clip_coef < 1.
/// Throws acc::ValueError unless max_norm >= 0.
void clip_grads_with_norm_(const NamedParams& params, double max_norm, double total_norm);

/// The factor clip_grads_with_norm_ multiplies the gradients by: max_norm / (total_norm + 1e-6)
/// when that is < 1, else 1 (also when total_norm is NaN, which clips nothing). Pass it to
/// Optimizer::step_scaled to clip inside the update. Throws acc::ValueError unless
/// max_norm >= 0.
double clip_coefficient(double max_norm, double total_norm);

/// Clips the gradients in place so that their total norm is at most max_norm and returns the
/// total norm before clipping. With error_if_nonfinite, a NaN or infinite norm throws
/// acc::ValueError (with the gradients unchanged); without it, an infinite norm zeroes the finite
/// gradients and a NaN norm leaves them as they are. Throws acc::ValueError unless max_norm >= 0
/// and norm_type > 0.
double clip_grad_norm_(const NamedParams& params, double max_norm, double norm_type = 2.0,
                       bool error_if_nonfinite = false);

}  // namespace acc::optim
