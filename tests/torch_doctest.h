// doctest for test files that also use LibTorch. LibTorch pulls in glog, whose CHECK macros
// clash with doctest's: ATen comes first, glog's names are dropped, then doctest defines its
// own. Include this before any other LibTorch header, in place of <doctest/doctest.h>.
#pragma once

#include <ATen/ATen.h>
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>
