// The whole ampfuse C++ API: the ops (ampfuse/ops.h), GradScaler (ampfuse/grad_scaler.h), the
// fused optimizers with fp32 master weights (ampfuse/optim.h) and GradAccumulator
// (ampfuse/accumulation.h). Link ampfuse::ampfuse (find_package(ampfuse)).
#pragma once

#include "ampfuse/ops.h"

#include "ampfuse/accumulation.h"
#include "ampfuse/grad_scaler.h"
#include "ampfuse/optim.h"
