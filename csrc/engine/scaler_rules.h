// The GradScaler's numeric rules, once for both surfaces: the scale bounds and the checkpoint's
// entries (types, ranges, defaults). The C++ GradScaler calls these directly; Python reaches
// them through the ampfuse::scaler_checkpoint_check and ampfuse::scale_bounds_check ops
// (engine/bindings.cpp), so both raise the same message for the same bad entry.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include "ops/validation.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ampfuse::engine {

// An optional number as an IValue (None when absent).
c10::IValue optional_value(const std::optional<double>& v);

// An empty dict of named values (str -> any IValue).
c10::Dict<std::string, c10::IValue> entry_dict();

// Whether a value is a number (an int or a float, not a bool), and the number.
bool is_number(const c10::IValue& v);
double number(const c10::IValue& v);

// A value as Python's repr() writes it (floats shortest round-trip with a ".0" or an exponent,
// strings quoted, None/True/False): the messages of both surfaces print values this way.
std::string repr(const c10::IValue& v);

// min_scale: None or a finite number in [0, FLT_MAX]; max_scale: None or a number > 0 (inf:
// unbounded) not below the smallest normal float32; min <= max. Raises c10::ValueError.
void check_scale_bounds(const c10::IValue& min_scale, const c10::IValue& max_scale);

// The options a scale update takes (the update op's rule, ops/validation.h), checked by the
// scalers at construction too, so that an option update() would refuse is refused before any step.
using detail::check_update_options;

// A scale a scaler starts from: positive, finite and representable in float32.
void check_init_scale(double init_scale);

// The values a scaler checkpoint sets, checked.
struct ScalerCheckpoint {
  double scale = 0.0;
  double growth_factor = 0.0;
  double backoff_factor = 0.0;
  int64_t growth_interval = 0;
  int64_t growth_tracker = 0;
  int64_t hysteresis = 1;
  int64_t hysteresis_tracker = 1;
  bool consecutive_hysteresis = false;
  std::optional<double> min_scale, max_scale;
  std::vector<int64_t> stats;
};

// The entries of a scaler checkpoint (torch.amp.GradScaler's five, and ampfuse's: hysteresis,
// _hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale, stats), every one checked
// before the caller changes anything. An absent ampfuse entry keeps `current`'s value (a torch
// checkpoint starts with a full hysteresis budget). `source` names the checkpoint in messages
// ("the state dict", "the checkpoint"). Raises c10::ValueError naming the entry.
ScalerCheckpoint check_scaler_checkpoint(const c10::Dict<std::string, c10::IValue>& entries,
                                         const ScalerCheckpoint& current, const std::string& source);

// What a scaler does when its scale hits its floor: "warn", "raise" or "ignore" (ValueError naming
// the option otherwise; `shown`: a value the caller holds that is no string, as it prints it, and
// refused), and the report of `new_hits` hits at `floor` (min_scale, or the smallest normal
// float32) both surfaces warn or raise with.
void check_on_min_scale(const c10::IValue& on_min_scale, const std::optional<std::string>& shown = std::nullopt);
std::string floor_hit_message(int64_t new_hits, double floor);

// The two as ops (registration.cpp), for Python: the checked values by name.
c10::Dict<std::string, c10::IValue> scaler_checkpoint_op(const c10::Dict<std::string, c10::IValue>& entries,
                                                          int64_t hysteresis, bool consecutive_hysteresis,
                                                          std::optional<double> min_scale,
                                                          std::optional<double> max_scale,
                                                          std::vector<int64_t> stats, std::string source);
void scale_bounds_op(const c10::IValue& min_scale, const c10::IValue& max_scale);
void scaler_options_op(double init_scale, double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis);

}  // namespace ampfuse::engine
