// Host stand-in for CUDA's header: see cuda_host.h.
#pragma once
#include "cuda_host.h"
