// The TTT attention kernels by name, the one enum every layer above them takes: the
// --ttt-attention option, TttOptions::attention, and the ring's pair kernel
// (RingOptions::pair_kernel, trainer/parallel/ring_attention.h, where kLocal is the dense
// per-pair reference and ring_pair_kernel says which kernel carries out --ttt-attention on
// a cp group). LibTorch-free.
//
// Thread safety: free functions. Errors: check_ttt_attention throws UsageError.
#pragma once

#include <string_view>

#include "formats/names.h"

namespace eaglekit::trainer {

// The TTT attention kernel (docs/ttt.md, "Two implementations" and "Fused kernels"): auto
// (fused where this build has it; else on the CPU tiled from kTttFlashMinLength positions,
// local below, and local on other devices), local (ttt_attention_local: O(L^2) memory), tiled
// (ttt_attention_flash: O(L) memory, any device) or fused (ttt_attention_fused: LibTorch's
// fused kernels, O(L) memory, LibTorch >= 2.5). trainer::TttOptions::attention takes it.
enum class TttAttention { kAuto, kLocal, kTiled, kFused };
inline constexpr NameTable<TttAttention, 4> kTttAttentionNames{{{TttAttention::kAuto, "auto"},
                                                                 {TttAttention::kLocal, "local"},
                                                                 {TttAttention::kTiled, "tiled"},
                                                                 {TttAttention::kFused, "fused"}}};
inline std::string_view ttt_attention_name(TttAttention a) { return name_in(kTttAttentionNames, a); }
// UsageError naming `flag` when this build cannot run `a` (fused on LibTorch < 2.5).
void check_ttt_attention(TttAttention a, std::string_view flag = "--ttt-attention");

}  // namespace eaglekit::trainer
