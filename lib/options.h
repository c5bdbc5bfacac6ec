// Options as tables. Each group of options (data selection, batches, model, optimisation,
// run) is one table of Option rows bound to the fields of its struct; the same row drives
// the command-line flag and its help text (with the default read from the field), the key
// of a --config JSON file, and the JSON echo of a run's options (train_options.json in
// every checkpoint). Enum options are choices parsed once, here, into their enum class.
//
// A row names its field; the field's initializer is the one default. The key is snake_case
// and the flag is the key with '-' ("max_length" -> --max-length) unless the row says
// otherwise; a boolean gets --KEY and --no-KEY. A number's row may carry its bound (at least
// N, positive, in [a, b), ...): check_bounds refuses a value outside it, once every flag and
// --config key is set, so a struct's check() keeps only what involves several options.
//
// Thread safety: a Group points into one struct; use it from one thread. Errors:
// UsageError naming the flag or JSON key and what it takes.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace eaglekit::opt {

// An enum field seen as one of a fixed list of names. The first name of a value is the one
// shown and written; later ones for the same value are accepted spellings (fp32 for
// float32).
struct ChoiceRef {
  std::vector<std::string> names;         // canonical names first, in enum order
  std::vector<std::string> accepted;      // every accepted spelling
  std::vector<std::size_t> accepted_to;   // accepted[i] -> index into names
  std::function<std::size_t()> get;       // the field's index into names
  std::function<void(std::size_t)> set;
};

// An option with an optional value: `--resume` alone sets the flag, `--resume DIR` (or
// --resume=DIR) also sets the text. In JSON the two are separate keys.
struct OptionalValueRef {
  bool* flag;
  std::string* value;
};

// The values a number option takes: lo <= x (lo < x when lo_open), x <= hi (x < hi when
// hi_open), and a finite x when `finite`. Built by the row modifiers at_least, positive,
// at_most, below, finite and refusal (below).
struct Bound {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;
  bool finite = false;
  // What the refusal says after "--FLAG "; "" derives it from the bound ("must be at least
  // 1", "must not be negative", "must be positive", "must be a positive number" (finite),
  // "must be in [0, 1)"). "{}" in it stands for the value (std::to_string).
  std::string says;

  bool holds(double x) const;
  std::string message(const std::string& flag, const std::string& value) const;
};

using Ref = std::variant<std::string*, std::int64_t*, std::uint64_t*, int*, double*, bool*,
                         std::vector<std::int64_t>*, ChoiceRef, OptionalValueRef>;

struct Option {
  std::string key;           // JSON key, snake_case
  std::string flag;          // without "--"; "" when the option has no flag (JSON only)
  std::string metavar;       // "N", "DIR", ...; "" for booleans and choices
  std::string help;
  std::string default_note;  // shown as the default instead of the value, "" none
  std::string alias;         // an older JSON key still read, "" none
  char short_flag = 0;       // a one-letter form (-o FILE, -oFILE), 0 none
  bool required = false;     // the command needs it: help says so instead of a default
  bool in_json = true;       // false: a command-line switch only (--json, --config)
  std::optional<Bound> bound;  // numbers: the values check_bounds accepts; none: any
  Ref ref;

  // The current value as the command line spells it ("0.05", "pad", "2,16,29", "on").
  std::string text() const;
  // Sets the value from command-line text. Throws UsageError naming --FLAG.
  void set_text(std::string_view text) const;
  bool is_bool() const { return std::holds_alternative<bool*>(ref); }
};

// The row builders. `key` becomes the flag with '-'.
Option row(const char* key, const char* metavar, const char* help);

template <class T>
Option field(const char* key, const char* metavar, T& value, const char* help) {
  Option o = row(key, metavar, help);
  o.ref = &value;
  return o;
}

// A choice among names (value, spelling): the first spelling of each value is its name, in
// order; the others are accepted too ("ckpt" for pt).
template <class E, class Names>
Option choice_of(const char* key, E& value, const Names& names, const char* help) {
  Option o = row(key, "", help);
  ChoiceRef c;
  std::vector<E> values;
  for (const auto& [v, name] : names) {
    std::size_t index = values.size();
    for (std::size_t i = 0; i < values.size(); ++i)
      if (values[i] == v) index = i;
    if (index == values.size()) {
      values.push_back(v);
      c.names.emplace_back(name);
    }
    c.accepted.emplace_back(name);
    c.accepted_to.push_back(index);
  }
  E* p = &value;
  c.get = [p, values] {
    for (std::size_t i = 0; i < values.size(); ++i)
      if (values[i] == *p) return i;
    return std::size_t{0};
  };
  c.set = [p, values](std::size_t i) { *p = values[i]; };
  o.ref = std::move(c);
  return o;
}

template <class E>
Option choice(const char* key, E& value, std::initializer_list<std::pair<E, const char*>> names,
              const char* help) {
  return choice_of(key, value, names, help);
}

Option optional_value(const char* key, const char* metavar, bool& flag, std::string& value, const char* help);

// Row modifiers, chained: field(...).note("the base's").named("cp").
inline Option note(Option o, const char* default_note) {
  o.default_note = default_note;
  return o;
}
inline Option flag_named(Option o, const char* flag) {
  o.flag = flag;
  return o;
}
inline Option alias(Option o, const char* old_key) {
  o.alias = old_key;
  return o;
}
inline Option short_named(Option o, char letter) {
  o.short_flag = letter;
  return o;
}
inline Option required(Option o) {
  o.required = true;
  return o;
}
inline Option json_only(Option o) {
  o.flag.clear();
  return o;
}
inline Option cli_only(Option o) {
  o.in_json = false;
  return o;
}

// Bound modifiers for number rows, chained like the others:
// below(at_least(field(...), 0), 1) takes [0, 1). Each sets one side of the row's bound.
inline Bound& bound_of(Option& o) {
  if (!o.bound) o.bound = Bound{};
  return *o.bound;
}
inline Option at_least(Option o, double lo) {
  bound_of(o).lo = lo;
  bound_of(o).lo_open = false;
  return o;
}
inline Option positive(Option o) {  // > 0
  bound_of(o).lo = 0;
  bound_of(o).lo_open = true;
  return o;
}
inline Option at_most(Option o, double hi) {
  bound_of(o).hi = hi;
  bound_of(o).hi_open = false;
  return o;
}
inline Option below(Option o, double hi) {
  bound_of(o).hi = hi;
  bound_of(o).hi_open = true;
  return o;
}
inline Option finite(Option o) {  // not infinite either (a --config value such as 1e999)
  bound_of(o).finite = true;
  return o;
}
// The refusal's own words after "--FLAG " instead of the derived ones; "{}" the value.
inline Option refusal(Option o, const char* says) {
  bound_of(o).says = says;
  return o;
}

struct Group {
  std::string title;  // "Data", "Model", ...
  std::vector<Option> options;

  // The same group with only these keys (in the group's order). Throws std::logic_error
  // for a key the group does not have: a command asks for what exists.
  Group only(std::initializer_list<const char*> keys) const;
  Group without(std::initializer_list<const char*> keys) const;
  const Option* find(std::string_view key_or_flag) const;
  // The same group with the row `key` passed through `change` (a bound modifier): a command
  // whose bound differs from the group's usual one (evaluate takes --eval-fraction 1).
  // Throws std::logic_error for a key the group does not have.
  Group with(const char* key, const std::function<Option(Option)>& change) const;
};

using Groups = std::vector<Group>;

// Throws UsageError (Bound::message) for the first row, in table order, whose value lies
// outside its bound.
void check_bounds(const Groups& groups);

// Every JSON option of `groups` as one object, in table order, pretty-printed with a final
// newline.
std::string to_json(const Groups& groups);
// Sets the options a JSON object names. Keys may use '_' or '-'; an alias key is read as
// its option. Throws UsageError naming `where` and the key for an unknown key or a value
// of the wrong type.
void apply_json(const Groups& groups, const std::string& json_text, const std::string& where);

}  // namespace eaglekit::opt
