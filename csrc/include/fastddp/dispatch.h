// Run-time choices as compile-time constants: the wire format, error feedback and stochastic
// rounding each pick a template instance, so that a loop is compiled once per combination with
// no branch on them left inside it. The math is always done in fp32; only the wire side varies.
#pragma once

#include <type_traits>

#include "fastddp/rounding.h"

namespace fastddp {

template <math::WireKind K>
using Kind = std::integral_constant<math::WireKind, K>;

template <bool B>
using Bool = std::integral_constant<bool, B>;

// f(Kind<kFp16>{}) or f(Kind<kBf16>{}); f reads the format as decltype(kind)::value.
template <class F>
decltype(auto) with_kind(math::WireKind kind, F&& f) {
  if (kind == math::WireKind::kBf16) {
    return f(Kind<math::WireKind::kBf16>{});
  }
  return f(Kind<math::WireKind::kFp16>{});
}

// f(Bool<true>{}) or f(Bool<false>{}).
template <class F>
decltype(auto) with_bool(bool b, F&& f) {
  if (b) {
    return f(Bool<true>{});
  }
  return f(Bool<false>{});
}

// f(feedback, stochastic), both as Bool<>.
template <class F>
decltype(auto) with_mode(const math::Mode& mode, F&& f) {
  return with_bool(mode.feedback, [&](auto feedback) {
    return with_bool(mode.stochastic, [&](auto stochastic) { return f(feedback, stochastic); });
  });
}

}  // namespace fastddp
