#include "engine/scaler_rules.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <charconv>
#include <cstdio>
#include <cmath>
#include <limits>

#include "ops/rules.h"

namespace ampfuse::engine {
namespace {

constexpr double kFltMax = std::numeric_limits<float>::max();
constexpr double kFltMin = std::numeric_limits<float>::min();

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0.0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: positional for exponents in [-4, 16).
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  const bool neg = sci[0] == '-';
  const size_t e = sci.find('e');
  std::string digits;
  for (size_t i = neg ? 1 : 0; i < e; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
      out += digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(exp) + 1) + "." + digits.substr(static_cast<size_t>(exp) + 1);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return out + ebuf;
}


// An integer list from a list or tuple of ints, or a 1-D integer tensor (the C++ archive's form).
std::optional<std::vector<int64_t>> int_list(const c10::IValue& v) {
  std::vector<int64_t> out;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.dim() != 1 || t.is_floating_point() || t.is_complex() || t.scalar_type() == at::kBool) {
      return std::nullopt;
    }
    const at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
    out.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
    return out;
  }
  std::vector<c10::IValue> held;
  if (v.isList()) {
    held = v.toListRef().vec();
  } else if (v.isTuple()) {
    held = v.toTupleRef().elements().vec();
  } else {
    return std::nullopt;
  }
  for (const auto& x : held) {
    if (!x.isInt()) return std::nullopt;
    out.push_back(x.toInt());
  }
  return out;
}

}  // namespace

c10::IValue optional_value(const std::optional<double>& v) {
  return v.has_value() ? c10::IValue(*v) : c10::IValue();
}

bool is_number(const c10::IValue& v) { return v.isInt() || v.isDouble(); }
double number(const c10::IValue& v) { return v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble(); }

c10::Dict<std::string, c10::IValue> entry_dict() {
  return c10::impl::toTypedDict<std::string, c10::IValue>(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
}

std::string repr(const c10::IValue& v) {
  if (v.isNone()) return "None";
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isDouble()) return float_repr(v.toDouble());
  if (v.isString()) return "'" + v.toStringRef() + "'";
  if (v.isList() || v.isTuple()) {
    const auto items = v.isList() ? v.toListRef().vec() : v.toTupleRef().elements().vec();
    std::string out = v.isList() ? "[" : "(";
    for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + repr(items[i]);
    if (v.isTuple() && items.size() == 1) out += ",";
    return out + (v.isList() ? "]" : ")");
  }
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.dim() == 1 && t.numel() <= 16 && !t.is_floating_point() && !t.is_complex()) {
      const at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
      std::string out = "tensor([";
      for (int64_t i = 0; i < c.numel(); ++i) out += (i ? ", " : "") + std::to_string(c.data_ptr<int64_t>()[i]);
      return out + "])";
    }
    return c10::str("a tensor of shape ", t.sizes(), " and dtype ", t.scalar_type());
  }
  return c10::str("a value of type ", v.tagKind());
}

void check_scale_bounds(const c10::IValue& min_scale, const c10::IValue& max_scale) {
  const bool has_min = !min_scale.isNone();
  const bool has_max = !max_scale.isNone();
  TORCH_CHECK_VALUE(!has_min || (is_number(min_scale) && std::isfinite(number(min_scale)) &&
                                 number(min_scale) >= 0 && number(min_scale) <= kFltMax),
                    "min_scale must be a finite number in [0, 3.40282e+38",
                    "] (the float32 range), got ", repr(min_scale), ".");
  TORCH_CHECK_VALUE(!has_max || (is_number(max_scale) && number(max_scale) > 0),
                    "max_scale must be a number > 0 (inf: unbounded), got ", repr(max_scale), ".");
  TORCH_CHECK_VALUE(!has_min || !has_max || number(min_scale) <= number(max_scale), "min_scale (",
                    repr(min_scale), ") must not be greater than max_scale (", repr(max_scale), ").");
  TORCH_CHECK_VALUE(!has_max || number(max_scale) >= kFltMin, "max_scale (", repr(max_scale),
                    ") is below the smallest normal float32 scale (", float_repr(kFltMin), ").");
}

ScalerCheckpoint check_scaler_checkpoint(const c10::Dict<std::string, c10::IValue>& entries,
                                         const ScalerCheckpoint& current, const std::string& source) {
  TORCH_CHECK(entries.size() != 0,
              "The source state dict is empty, possibly because it was saved from a disabled "
              "instance of GradScaler.");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    TORCH_CHECK_VALUE(entries.contains(key), "GradScaler state dict has no '", key, "' entry.");
  }
  auto get = [&](const char* key, c10::IValue fallback) {
    auto it = entries.find(key);
    return it == entries.end() ? std::move(fallback) : it->value();
  };
  auto is_int = [](const c10::IValue& v) { return v.isInt(); };  // bools are not ints here
  ScalerCheckpoint out;
  const c10::IValue scale = entries.at("scale");
  TORCH_CHECK_VALUE(is_number(scale) && number(scale) > 0 && number(scale) <= std::numeric_limits<float>::max(),
                    source, "'s scale must be a positive finite number that float32 holds, got ", repr(scale), ".");
  out.scale = number(scale);
  const c10::IValue growth = entries.at("growth_factor");
  TORCH_CHECK_VALUE(is_number(growth) && number(growth) > 1.0 && std::isfinite(number(growth)), source,
                    "'s growth_factor must be a finite number > 1.0, got ", repr(growth), ".");
  out.growth_factor = number(growth);
  const c10::IValue backoff = entries.at("backoff_factor");
  TORCH_CHECK_VALUE(is_number(backoff) && number(backoff) > 0.0 && number(backoff) < 1.0, source,
                    "'s backoff_factor must be in (0, 1), got ", repr(backoff), ".");
  out.backoff_factor = number(backoff);
  const c10::IValue interval = entries.at("growth_interval");
  constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();  // the device counters are int32
  TORCH_CHECK_VALUE(is_int(interval) && interval.toInt() >= 1 && interval.toInt() <= kMaxCount, source,
                    "'s growth_interval must be an integer in [1, ", kMaxCount, "], got ", repr(interval), ".");
  out.growth_interval = interval.toInt();
  const c10::IValue tracker = entries.at("_growth_tracker");
  TORCH_CHECK_VALUE(is_int(tracker) && tracker.toInt() >= 0 && tracker.toInt() <= kMaxCount, source,
                    "'s _growth_tracker must be an integer in [0, ", kMaxCount, "], got ", repr(tracker), ".");
  out.growth_tracker = tracker.toInt();
  const c10::IValue hysteresis = get("hysteresis", c10::IValue(current.hysteresis));
  TORCH_CHECK_VALUE(is_int(hysteresis) && hysteresis.toInt() >= 1 && hysteresis.toInt() <= kMaxCount, source,
                    "'s hysteresis must be an integer in [1, ", kMaxCount, "], got ", repr(hysteresis), ".");
  out.hysteresis = hysteresis.toInt();
  // A torch checkpoint carries no hysteresis budget: start with a full one.
  const c10::IValue left = get("_hysteresis_tracker", c10::IValue(out.hysteresis));
  TORCH_CHECK_VALUE(is_int(left) && left.toInt() >= 0 && left.toInt() <= out.hysteresis, source,
                    "'s _hysteresis_tracker must be an integer in [0, hysteresis], got ", repr(left), ".");
  out.hysteresis_tracker = left.toInt();
  const c10::IValue consecutive = get("consecutive_hysteresis", c10::IValue(current.consecutive_hysteresis));
  TORCH_CHECK_VALUE(consecutive.isBool(), source, "'s consecutive_hysteresis must be a bool, got ",
                    repr(consecutive), ".");
  out.consecutive_hysteresis = consecutive.toBool();
  const c10::IValue min_scale = get("min_scale", optional_value(current.min_scale));
  const c10::IValue max_scale = get("max_scale", optional_value(current.max_scale));
  try {
    check_scale_bounds(min_scale, max_scale);
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, source, "'s scale bounds are invalid: ", e.what_without_backtrace());
  }
  if (!min_scale.isNone()) out.min_scale = number(min_scale);
  if (!max_scale.isNone()) out.max_scale = number(max_scale);
  const c10::IValue stats = get("stats", c10::IValue(c10::List<int64_t>(current.stats)));
  const auto counters = int_list(stats);
  bool ok = counters.has_value() && static_cast<int64_t>(counters->size()) == kNumScaleStats;
  for (size_t i = 0; ok && i < counters->size(); ++i) ok = (*counters)[i] >= 0;
  TORCH_CHECK_VALUE(ok, source, "'s stats must be ", static_cast<int>(kNumScaleStats),
                    " non-negative integers, got ", repr(stats), ".");
  out.stats = *counters;
  return out;
}

c10::Dict<std::string, c10::IValue> scaler_checkpoint_op(const c10::Dict<std::string, c10::IValue>& entries,
                                                          int64_t hysteresis, bool consecutive_hysteresis,
                                                          std::optional<double> min_scale,
                                                          std::optional<double> max_scale,
                                                          std::vector<int64_t> stats, std::string source) {
  ScalerCheckpoint current;
  current.hysteresis = hysteresis;
  current.consecutive_hysteresis = consecutive_hysteresis;
  current.min_scale = min_scale;
  current.max_scale = max_scale;
  current.stats = std::move(stats);
  const ScalerCheckpoint c = check_scaler_checkpoint(entries, current, source);
  auto out = entry_dict();
  out.insert("scale", c.scale);
  out.insert("growth_factor", c.growth_factor);
  out.insert("backoff_factor", c.backoff_factor);
  out.insert("growth_interval", c.growth_interval);
  out.insert("growth_tracker", c.growth_tracker);
  out.insert("hysteresis", c.hysteresis);
  out.insert("hysteresis_tracker", c.hysteresis_tracker);
  out.insert("consecutive_hysteresis", c.consecutive_hysteresis);
  out.insert("min_scale", optional_value(c.min_scale));
  out.insert("max_scale", optional_value(c.max_scale));
  out.insert("stats", c10::List<int64_t>(c.stats));
  return out;
}

void scale_bounds_op(const c10::IValue& min_scale, const c10::IValue& max_scale) {
  check_scale_bounds(min_scale, max_scale);
}

void check_init_scale(double init_scale) {
  TORCH_CHECK(init_scale > 0.0 && init_scale <= std::numeric_limits<float>::max(),
              "init_scale must be a positive finite number that float32 holds (at most ",
              std::numeric_limits<float>::max(), "), got ", init_scale, ".");
}

void scaler_options_op(double init_scale, double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis) {
  check_init_scale(init_scale);
  check_update_options(growth_factor, backoff_factor, growth_interval, hysteresis);
}

void check_on_min_scale(const c10::IValue& on_min_scale, const std::optional<std::string>& shown) {
  const bool ok = !shown && on_min_scale.isString() &&
                  (on_min_scale.toStringRef() == "warn" || on_min_scale.toStringRef() == "raise" ||
                   on_min_scale.toStringRef() == "ignore");
  TORCH_CHECK_VALUE(ok, "on_min_scale must be 'warn', 'raise' or 'ignore', got ", shown ? *shown : repr(on_min_scale),
                    ".");
}

std::string floor_hit_message(int64_t new_hits, double floor) {
  char value[32];
  std::snprintf(value, sizeof(value), "%g", floor);  // Python's format(floor, "g")
  return c10::str("GradScaler: the loss scale hit its floor (", value, ") ", new_hits,
                  " time(s): gradients keep overflowing even at the smallest scale. Training has probably diverged "
                  "(check the learning rate, the data, and whether the model was pretrained in bf16).");
}

}  // namespace ampfuse::engine
