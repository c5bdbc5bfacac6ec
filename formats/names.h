// Enum names kept once: a table of {value, name} rows, from which both directions are read
// (the name of a value, the value of a name) and which opt::choice_of takes as an option's
// choices (lib/options.h). A value may have more than one row; its first is its name.
//
// Thread safety: pure functions of constant tables.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>
#include <utility>

namespace eaglekit {

template <class E, std::size_t N>
using NameTable = std::array<std::pair<E, std::string_view>, N>;

// The first name `table` gives `value`; "?" for a value it does not list.
template <class E, std::size_t N>
constexpr std::string_view name_in(const NameTable<E, N>& table, E value) {
  for (const auto& [v, name] : table)
    if (v == value) return name;
  return "?";
}

// The value `name` spells in `table`, or nullopt.
template <class E, std::size_t N>
constexpr std::optional<E> value_in(const NameTable<E, N>& table, std::string_view name) {
  for (const auto& [v, n] : table)
    if (n == name) return v;
  return std::nullopt;
}

}  // namespace eaglekit
