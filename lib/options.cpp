#include "lib/options.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "formats/error.h"

namespace eaglekit::opt {

namespace {

using json = nlohmann::ordered_json;

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

std::string flag_of(const Option& o) { return "--" + (o.flag.empty() ? o.key : o.flag); }

// "a, b or c"
std::string one_of(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? " or " : ", ";
    s += names[i];
  }
  return s;
}

std::string number_text(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// A whole-string signed integer in [lo, hi], or throws with `what` it takes.
std::int64_t parse_int(std::string_view text, const Option& o, std::int64_t lo, std::int64_t hi,
                       const char* what) {
  const std::string s(text);
  errno = 0;
  char* end = nullptr;
  const long long v = s.empty() ? 0 : std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || v < lo || v > hi)
    throw UsageError(flag_of(o) + " takes " + what + ", not '" + s + "'");
  return v;
}

bool parse_bool(std::string_view text, const Option& o) {
  if (text == "true" || text == "on" || text == "1" || text == "yes") return true;
  if (text == "false" || text == "off" || text == "0" || text == "no") return false;
  throw UsageError(flag_of(o) + " takes true or false, not '" + std::string(text) + "'");
}

}  // namespace

Option row(const char* key, const char* metavar, const char* help) {
  Option o;
  o.key = key;
  o.flag = key;
  std::replace(o.flag.begin(), o.flag.end(), '_', '-');
  o.metavar = metavar;
  o.help = help;
  return o;
}

Option optional_value(const char* key, const char* metavar, bool& flag, std::string& value, const char* help) {
  Option o = row(key, metavar, help);
  o.ref = OptionalValueRef{&flag, &value};
  return o;
}

std::string Option::text() const {
  return std::visit(
      Overloaded{
          [](const std::string* p) { return *p; },
          [](const std::int64_t* p) { return std::to_string(*p); },
          [](const std::uint64_t* p) { return std::to_string(*p); },
          [](const int* p) { return std::to_string(*p); },
          [](const double* p) { return number_text(*p); },
          [](const bool* p) { return std::string(*p ? "on" : "off"); },
          [](const std::vector<std::int64_t>* p) {
            std::string s;
            for (auto v : *p) s += (s.empty() ? "" : ",") + std::to_string(v);
            return s;
          },
          [](const ChoiceRef& c) { return c.names.at(c.get()); },
          [](const OptionalValueRef& r) { return *r.flag ? (r.value->empty() ? "on" : *r.value) : std::string("off"); },
      },
      ref);
}

void Option::set_text(std::string_view text) const {
  const Option& o = *this;
  std::visit(
      Overloaded{
          [&](std::string* p) { *p = std::string(text); },
          [&](std::int64_t* p) {
            *p = parse_int(text, o, std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(),
                           "an integer");
          },
          [&](std::uint64_t* p) {
            const std::string s(text);
            char* end = nullptr;
            errno = 0;
            const unsigned long long v = s.empty() || s[0] == '-' ? 0 : std::strtoull(s.c_str(), &end, 10);
            if (s.empty() || s[0] == '-' || end != s.c_str() + s.size() || errno == ERANGE)
              throw UsageError(flag_of(o) + " takes a non-negative integer, not '" + s + "'");
            *p = v;
          },
          [&](int* p) {
            *p = static_cast<int>(parse_int(text, o, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(),
                                            "an integer"));
          },
          [&](double* p) {
            const std::string s(text);
            char* end = nullptr;
            errno = 0;
            const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
            if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE || !std::isfinite(v))
              throw UsageError(flag_of(o) + " takes a number, not '" + s + "'");
            *p = v;
          },
          [&](bool* p) { *p = parse_bool(text, o); },
          [&](std::vector<std::int64_t>* p) {
            std::vector<std::int64_t> ids;
            std::string item;
            std::stringstream ss{std::string(text)};
            const std::string whole(text);
            while (std::getline(ss, item, ',')) {
              if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 9)
                throw UsageError(flag_of(o) + " takes comma-separated layer ids such as 2,16,29, not '" + whole + "'");
              ids.push_back(std::stoll(item));
            }
            if (ids.empty())
              throw UsageError(flag_of(o) + " takes comma-separated layer ids such as 2,16,29, not '" + whole + "'");
            *p = std::move(ids);
          },
          [&](const ChoiceRef& c) {
            for (std::size_t i = 0; i < c.accepted.size(); ++i) {
              if (c.accepted[i] == text) {
                c.set(c.accepted_to[i]);
                return;
              }
            }
            throw UsageError(flag_of(o) + " must be " + one_of(c.names) + ", not '" + std::string(text) + "'");
          },
          [&](const OptionalValueRef& r) {
            *r.flag = true;
            *r.value = std::string(text);
          },
      },
      ref);
}

bool Bound::holds(double x) const {
  return (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi) && (!finite || std::isfinite(x));
}

std::string Bound::message(const std::string& flag, const std::string& value) const {
  if (!says.empty()) {
    std::string s = says;
    const std::size_t at = s.find("{}");
    if (at != std::string::npos) s.replace(at, 2, value);
    return flag + " " + s;
  }
  const bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
  std::string s;
  if (has_lo && has_hi)
    s = "must be in " + std::string(lo_open ? "(" : "[") + number_text(lo) + ", " + number_text(hi) +
        (hi_open ? ")" : "]");
  else if (has_lo && lo == 0)
    s = lo_open ? (finite ? "must be a positive number" : "must be positive") : "must not be negative";
  else if (has_lo)
    s = (lo_open ? "must be above " : "must be at least ") + number_text(lo);
  else
    s = (hi_open ? "must be below " : "must be at most ") + number_text(hi);
  return flag + " " + s;
}

void check_bounds(const Groups& groups) {
  for (const auto& g : groups) {
    for (const auto& o : g.options) {
      if (!o.bound) continue;
      double x = 0;
      std::string text;
      if (const auto* p = std::get_if<std::int64_t*>(&o.ref)) {
        x = static_cast<double>(**p);
        text = std::to_string(**p);
      } else if (const auto* q = std::get_if<int*>(&o.ref)) {
        x = **q;
        text = std::to_string(**q);
      } else if (const auto* d = std::get_if<double*>(&o.ref)) {
        x = **d;
        text = std::to_string(**d);
      } else {
        throw std::logic_error(flag_of(o) + ": a bound on an option that is not a signed number");
      }
      if (!o.bound->holds(x)) throw UsageError(o.bound->message(flag_of(o), text));
    }
  }
}

Group Group::only(std::initializer_list<const char*> keys) const {
  for (const char* k : keys)
    if (!find(k)) throw std::logic_error(title + " options have no '" + k + "'");
  Group g{title, {}};
  for (const auto& o : options)
    if (std::any_of(keys.begin(), keys.end(), [&](const char* k) { return o.key == k; })) g.options.push_back(o);
  return g;
}

Group Group::without(std::initializer_list<const char*> keys) const {
  for (const char* k : keys)
    if (!find(k)) throw std::logic_error(title + " options have no '" + k + "'");
  Group g{title, {}};
  for (const auto& o : options)
    if (std::none_of(keys.begin(), keys.end(), [&](const char* k) { return o.key == k; })) g.options.push_back(o);
  return g;
}

Group Group::with(const char* key, const std::function<Option(Option)>& change) const {
  if (!find(key)) throw std::logic_error(title + " options have no '" + key + "'");
  Group g = *this;
  for (auto& o : g.options)
    if (o.key == key) o = change(o);
  return g;
}

const Option* Group::find(std::string_view key_or_flag) const {
  for (const auto& o : options)
    if (o.key == key_or_flag || (!o.flag.empty() && o.flag == key_or_flag)) return &o;
  return nullptr;
}

std::string to_json(const Groups& groups) {
  json j;
  for (const auto& g : groups) {
    for (const auto& o : g.options) {
      if (!o.in_json) continue;
      std::visit(Overloaded{
                     [&](const ChoiceRef& c) { j[o.key] = c.names.at(c.get()); },
                     [&](const OptionalValueRef& r) { j[o.key] = *r.flag; },
                     [&](const auto* p) { j[o.key] = *p; },
                 },
                 o.ref);
    }
  }
  return j.dump(2) + "\n";
}

void apply_json(const Groups& groups, const std::string& json_text, const std::string& where) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(where + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw UsageError(where + ": expected a JSON object of options");
  for (const auto& [raw_key, value] : j.items()) {
    std::string key = raw_key;
    std::replace(key.begin(), key.end(), '-', '_');
    const Option* found = nullptr;
    for (const auto& g : groups)
      for (const auto& o : g.options)
        if (o.in_json && (o.key == key || (!o.alias.empty() && o.alias == key))) found = &o;
    if (!found) throw UsageError(where + ": unknown option '" + raw_key + "'");
    auto bad = [&, k = raw_key](const std::string& expected) {
      return UsageError(where + ": option '" + k + "' must be " + expected + ", not " + value.dump());
    };
    std::visit(Overloaded{
                   [&](std::string* p) {
                     if (!value.is_string()) throw bad("a string");
                     *p = value.get<std::string>();
                   },
                   [&](bool* p) {
                     if (!value.is_boolean()) throw bad("true or false");
                     *p = value.get<bool>();
                   },
                   [&](const OptionalValueRef& r) {
                     if (!value.is_boolean()) throw bad("true or false");
                     *r.flag = value.get<bool>();
                   },
                   [&](double* p) {
                     if (!value.is_number()) throw bad("a number");
                     *p = value.get<double>();
                   },
                   [&](std::vector<std::int64_t>* p) {
                     if (!value.is_array()) throw bad("a list of integers");
                     std::vector<std::int64_t> ids;
                     for (const auto& x : value) {
                       if (!x.is_number_integer()) throw bad("a list of integers");
                       ids.push_back(x.get<std::int64_t>());
                     }
                     *p = std::move(ids);
                   },
                   [&](std::uint64_t* p) {
                     if (!value.is_number_integer() || (value.is_number_integer() && !value.is_number_unsigned() &&
                                                        value.get<std::int64_t>() < 0))
                       throw bad("a non-negative integer");
                     *p = value.get<std::uint64_t>();
                   },
                   [&](std::int64_t* p) {
                     if (!value.is_number_integer()) throw bad("an integer");
                     *p = value.get<std::int64_t>();
                   },
                   [&](int* p) {
                     if (!value.is_number_integer() || value.get<std::int64_t>() < std::numeric_limits<int>::min() ||
                         value.get<std::int64_t>() > std::numeric_limits<int>::max())
                       throw bad("an integer");
                     *p = static_cast<int>(value.get<std::int64_t>());
                   },
                   [&](const ChoiceRef& c) {
                     if (value.is_string()) {
                       const std::string s = value.get<std::string>();
                       for (std::size_t i = 0; i < c.accepted.size(); ++i) {
                         if (c.accepted[i] == s) {
                           c.set(c.accepted_to[i]);
                           return;
                         }
                       }
                     }
                     throw bad(one_of(c.names));
                   },
               },
               found->ref);
  }
}

}  // namespace eaglekit::opt
