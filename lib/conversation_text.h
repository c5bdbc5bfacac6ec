// How much text each conversation of a --data file holds, for estimating its tokens before
// anything is dumped (`stats --plan-dump`, lib/stats.h plan_dump). Implemented in
// lib/dataset.cpp beside load_conversations, whose file reading it shares.
//
// Thread safety: pure function of its argument.
// Throws what load_conversations throws (IoError, FormatError naming file and line).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eaglekit {

struct ConversationText {
  std::string id;              // as load_conversations reads it
  std::uint64_t text_bytes = 0;  // UTF-8 bytes of every string value but the id keys'
};

// One entry per conversation, in load_conversations' order (files, then lines).
std::vector<ConversationText> conversation_text_bytes(const std::string& path);

}  // namespace eaglekit
