// Precompiled header for the translation units that use LibTorch (see CMakeLists.txt).
#pragma once
#include <torch/torch.h>
