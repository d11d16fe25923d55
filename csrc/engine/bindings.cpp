// The engine's registrations: the implementations of the engine rules whose schemas the one
// TORCH_LIBRARY block declares (csrc/ops/registration.cpp), and the engine's native objects as
// torch custom classes (torch.classes.ampfuse.*), the ones Python holds.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "engine/accumulator_window.h"
#include "engine/hyper_checks.h"
#include "engine/master_keeper.h"
#include "engine/optimizer_kind.h"
#include "engine/scaler_rules.h"
#include "engine/step_plan.h"

TORCH_LIBRARY_FRAGMENT(ampfuse, m) {
  // Catch-all kernels: these rules take no tensors.
  m.impl("scaler_checkpoint_check", &ampfuse::engine::scaler_checkpoint_op);
  m.impl("accumulator_counters_check", &ampfuse::engine::check_accumulator_counters);
  m.impl("accumulator_sums_scale_check", &ampfuse::engine::check_window_sums_scale);
  m.impl("group_hyper_check", &ampfuse::engine::group_hyper_op);
  m.impl("optimizer_kind", &ampfuse::engine::optimizer_kind_op);
  m.impl("scale_bounds_check", &ampfuse::engine::scale_bounds_op);
  m.impl("scaler_options_check", &ampfuse::engine::scaler_options_op);
  m.impl("on_min_scale_check", [](std::optional<std::string> v, std::optional<std::string> shown) {
    ampfuse::engine::check_on_min_scale(v ? c10::IValue(*v) : c10::IValue(), shown);
  });
  m.impl("floor_hit_message", [](int64_t n, double floor) { return ampfuse::engine::floor_hit_message(n, floor); });

  using ampfuse::engine::AccumulatePlan;
  using ampfuse::engine::AccumulatorWindow;
  using ampfuse::engine::MasterKeeper;
  using ampfuse::engine::StepPlan;
  // GradAccumulator's micro-batch plan (step_plan.h): a micro-batch's fp32 accumulation in
  // one native call, and the window's flags a StepPlan reads its sums by. Held by an
  // AccumulatorWindow; eager only, as StepPlan.
  m.class_<AccumulatePlan>("AccumulatePlan");
  // GradAccumulator's window (accumulator_window.h): layout, collect, the window's end and
  // the partial sums of a mid-window checkpoint.
  using Tensors = std::vector<at::Tensor>;
  m.class_<AccumulatorWindow>("AccumulatorWindow")
      .def(torch::init<bool, bool>())
      .def("start", &AccumulatorWindow::start)
      .def("plan_says_same_layout", &AccumulatorWindow::plan_says_same_layout)
      .def("collect", &AccumulatorWindow::collect)
      .def("collect_planned", &AccumulatorWindow::collect_planned)
      .def("drop_plan", &AccumulatorWindow::drop_plan)
      .def("has_plan", &AccumulatorWindow::has_plan)
      .def("plan_id", &AccumulatorWindow::plan_id)
      .def("plan_says_no_grads", &AccumulatorWindow::plan_says_no_grads)
      .def("plan", [](const c10::intrusive_ptr<AccumulatorWindow>& self) { return self->plan(); })
      .def("scale", &AccumulatorWindow::scale)
      .def("end", &AccumulatorWindow::end)
      .def("params", [](const c10::intrusive_ptr<AccumulatorWindow>& self) { return Tensors(self->params()); })
      .def("buffers", [](const c10::intrusive_ptr<AccumulatorWindow>& self) { return Tensors(self->buffers()); })
      .def("flats", [](const c10::intrusive_ptr<AccumulatorWindow>& self) {
        Tensors out;
        for (const auto& f : self->flats()) if (f.defined()) out.push_back(f);
        return out;
      })
      .def("device_names", &AccumulatorWindow::device_names)
      .def("found_infs", &AccumulatorWindow::found_infs)
      .def("flags", &AccumulatorWindow::flags_list)
      .def("set_flags", &AccumulatorWindow::set_flags_list)
      .def("indices_of_buffered", &AccumulatorWindow::indices_of_buffered)
      .def("check_checkpoint", &AccumulatorWindow::check_checkpoint)
      .def("load", &AccumulatorWindow::load);
  // The persistent step plan of an optimizer (step_plan.h): its tensors validated once, a
  // step (or the scaler's check) one native call whatever the number of params. Eager only:
  // compiled and traced steps go through the ops above. (Registered after AccumulatePlan, which
  // bind_source takes.)
  m.class_<StepPlan>("StepPlan")
      .def(torch::init<std::string>())
      .def("set_hyper", &StepPlan::set_hyper)
      .def("set_options", &StepPlan::set_options)
      .def("hyper_names", &StepPlan::hyper_names)
      .def("add_bucket", &StepPlan::add_bucket, "",
           {torch::arg("group"), torch::arg("params"), torch::arg("masters"), torch::arg("state0"),
            torch::arg("state1"), torch::arg("state2"), torch::arg("steps"), torch::arg("fp32_grads"),
            torch::arg("absmax0") = c10::List<at::Tensor>(), torch::arg("absmax1") = c10::List<at::Tensor>(),
            torch::arg("absmax2") = c10::List<at::Tensor>()})
      .def("add_idle", &StepPlan::add_idle)
      .def("bind_source", &StepPlan::bind_source)
      .def("finalize", &StepPlan::finalize)
      .def("step", &StepPlan::step)
      .def("check", &StepPlan::check)
      .def("num_params", &StepPlan::num_params)
      .def("kind", &StepPlan::kind);
  // Who keeps each param's master (master_keeper.h): one per optimizer.
  m.class_<MasterKeeper>("MasterKeeper")
      .def(torch::init<std::string>())
      .def("claim", &MasterKeeper::claim)
      .def("needs_claim", &MasterKeeper::needs_claim)
      .def("restart_replaced", &MasterKeeper::restart_replaced)
      .def("sync_from_params", &MasterKeeper::sync_from_params)
      .def("hold_plan", &MasterKeeper::hold_plan);
}
