#include "tools/cli.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <iostream>
#include <optional>
#include <sstream>
#include <string_view>
#include <utility>
#include <stdexcept>
#include <variant>

#include "formats/error.h"

namespace eaglekit::tools {

bool g_verbose = false;

bool stderr_is_tty() { return ::isatty(2) == 1; }

std::string own_executable() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw IoError::from_errno("/proc/self/exe", "readlink", errno);
  return std::string(buf, static_cast<std::size_t>(n));
}

std::chrono::milliseconds collective_timeout(double seconds) {
  if (!(seconds > 0) || seconds > 7 * 24 * 3600.0)
    throw UsageError("--timeout takes a positive number of seconds (at most a week), not " + std::to_string(seconds));
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
}

opt::Groups LoaderJob::groups() {
  using opt::at_least;
  using opt::field;
  opt::Group loader{
      "Loader",
      {field("batches", "N", batches, "Stop after N batches, continuing into later epochs (-1: one epoch)"),
       at_least(field("rank", "N", rank, "Data-parallel rank"), 0),
       at_least(field("world_size", "N", world_size, "Data-parallel size"), 1),
       at_least(field("first_token", "N", first_token, "Token window of each row: first column"), 0),
       at_least(field("last_token", "N", last_token, "Token window of each row: end column, exclusive (-1: row end)"),
                -1),
       at_least(field("cp_rank", "N", cp_rank, "Context-parallel rank: holds its chunk of every row"), 0),
       at_least(field("cp_size", "N", cp_size, "Context-parallel size"), 1),
       field("resume", "STATE", resume, "Sampler state to continue from (JSON, or a file holding it)"),
       field("strict", "", strict, "Fail on the first bad record instead of skipping it")}};
  // The collator takes rows of one token (train needs two).
  return {split_data_options(*this),
          batch_options(*this).with("max_length", [](opt::Option o) { return at_least(std::move(o), 1); }), loader};
}

bool CommandLine::given(std::string_view key) const {
  for (const auto& [o, v] : values)
    if (o->key == key) return true;
  return false;
}

void CommandLine::check_choice(std::string_view key,
                               const std::function<std::string(const std::string& value)>& message) const {
  for (const auto& [o, v] : values) {
    if (o->key != key) continue;
    const auto* c = std::get_if<opt::ChoiceRef>(&o->ref);
    if (!c) throw std::logic_error("check_choice: '" + std::string(key) + "' is not a choice");
    if (std::find(c->accepted.begin(), c->accepted.end(), v) == c->accepted.end()) throw UsageError(message(v));
  }
}

void CommandLine::apply(const std::function<void(const std::string& path)>& on_config) const {
  if (on_config) {
    for (const auto& [o, v] : values)
      if (o->key == "config") on_config(v);
  }
  for (const auto& [o, v] : values) o->set_text(v);
}

namespace {

const opt::Option* find_flag(const opt::Groups& groups, std::string_view flag) {
  for (const auto& g : groups)
    for (const auto& o : g.options)
      if (!o.flag.empty() && o.flag == flag) return &o;
  return nullptr;
}

const opt::Option* find_short(const opt::Groups& groups, char letter) {
  for (const auto& g : groups)
    for (const auto& o : g.options)
      if (!o.flag.empty() && o.short_flag == letter) return &o;
  return nullptr;
}

// An old spelling that now has another name: "--dtype is now --compute-dtype".
const opt::Option* find_alias(const opt::Groups& groups, std::string_view flag) {
  for (const auto& g : groups)
    for (const auto& o : g.options) {
      if (o.alias.empty() || o.flag.empty()) continue;
      std::string a = o.alias;
      std::replace(a.begin(), a.end(), '_', '-');
      if (a == flag) return &o;
    }
  return nullptr;
}

bool takes_optional_value(const opt::Option& o) { return std::holds_alternative<opt::OptionalValueRef>(o.ref); }

// Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
// neighbours ("--max-setps") each cost 1.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// " (did you mean --X?)" for the command's flag nearest to a mistyped `name` (a typo, a
// '_' for '-', a missing or extra letter), "" when none is near: at most 2 edits, and fewer
// than a third of the name's letters for short names.
std::string did_you_mean(const opt::Groups& groups, const std::string& name) {
  std::string spelled = name;
  std::replace(spelled.begin(), spelled.end(), '_', '-');
  std::string best;
  std::size_t best_d = std::string::npos;
  auto consider = [&](const std::string& flag) {
    const std::size_t d = edit_distance(spelled, flag);
    if (d < best_d) {
      best_d = d;
      best = flag;
    }
  };
  for (const auto& g : groups)
    for (const auto& o : g.options) {
      if (o.flag.empty()) continue;
      consider(o.flag);
      if (o.is_bool()) consider("no-" + o.flag);
    }
  consider("help");
  if (best.empty() || best_d > 2 || 3 * best_d >= std::max(spelled.size(), best.size())) return "";
  return " (did you mean --" + best + "?)";
}

}  // namespace

CommandLine parse_command_line(int argc, char** argv, const opt::Groups& groups, std::size_t max_positionals) {
  CommandLine cl;
  bool only_positionals = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (only_positionals || arg.size() < 2 || arg[0] != '-' || arg == "-") {
      if (cl.positionals.size() >= max_positionals)
        throw UsageError("unexpected argument '" + arg + "' (see --help)");
      cl.positionals.push_back(arg);
      continue;
    }
    if (arg == "--") {
      only_positionals = true;
      continue;
    }
    if (arg == "-h" || arg == "--help") {
      cl.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      // -o FILE, -oFILE; -x for a boolean.
      const opt::Option* o = find_short(groups, arg[1]);
      if (!o || (o->is_bool() && arg.size() > 2) || takes_optional_value(*o))
        throw UsageError("unknown option '" + arg + "' (see --help)");
      if (o->is_bool()) {
        cl.values.emplace_back(o, "true");
      } else if (arg.size() > 2) {
        cl.values.emplace_back(o, arg.substr(2));
      } else {
        if (i + 1 >= argc) throw UsageError(arg + " needs a value " + o->metavar + " (see --help)");
        cl.values.emplace_back(o, argv[++i]);
      }
      continue;
    }
    std::string name = arg.substr(2);
    std::optional<std::string> inline_value;
    if (const auto eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const opt::Option* o = find_flag(groups, name);
    if (!o && name.rfind("no-", 0) == 0) {
      const opt::Option* positive = find_flag(groups, name.substr(3));
      if (positive && positive->is_bool()) {
        if (inline_value) throw UsageError("--" + name + " takes no value (see --help)");
        cl.values.emplace_back(positive, "false");
        continue;
      }
    }
    if (!o) {
      if (const opt::Option* renamed = find_alias(groups, name))
        throw UsageError("--" + name + " is now --" + renamed->flag + " (see --help)");
      throw UsageError("unknown option '--" + name + "'" + did_you_mean(groups, name) + " (see --help)");
    }
    if (o->is_bool()) {
      cl.values.emplace_back(o, inline_value ? *inline_value : "true");
    } else if (takes_optional_value(*o)) {
      if (inline_value) {
        cl.values.emplace_back(o, *inline_value);
      } else if (i + 1 < argc && argv[i + 1][0] != '-') {
        cl.values.emplace_back(o, argv[++i]);
      } else {
        cl.values.emplace_back(o, "");
      }
    } else if (inline_value) {
      cl.values.emplace_back(o, *inline_value);
    } else {
      if (i + 1 >= argc) throw UsageError("--" + name + " needs a value " + o->metavar + " (see --help)");
      cl.values.emplace_back(o, argv[++i]);
    }
  }
  return cl;
}

std::optional<CommandLine> parse_or_help(int argc, char** argv, const opt::Groups& groups, const std::string& usage,
                                         const std::string& description, std::size_t max_positionals) {
  CommandLine cl = parse_command_line(argc, argv, groups, max_positionals);
  if (!cl.help) return cl;
  std::cout << help_text(usage, description, groups);
  return std::nullopt;
}

namespace {

// Words of `text` filled into lines of at most `width` columns after `indent`.
void wrap(std::ostringstream& os, const std::string& text, std::size_t indent, std::size_t width,
          std::size_t first_column) {
  std::istringstream words(text);
  std::string w;
  std::size_t col = first_column;
  bool first = true;
  while (words >> w) {
    if (!first && col + 1 + w.size() > width) {
      os << "\n" << std::string(indent, ' ');
      col = indent;
    } else if (!first) {
      os << ' ';
      ++col;
    }
    os << w;
    col += w.size();
    first = false;
  }
}

}  // namespace

std::string help_text(const std::string& usage, const std::string& description, const opt::Groups& groups) {
  constexpr std::size_t kIndent = 28, kWidth = 100;
  std::ostringstream os;
  os << "Usage: " << usage << "\n\n";
  wrap(os, description, 0, kWidth, 0);
  os << "\n";
  for (const auto& g : groups) {
    bool any = false;
    for (const auto& o : g.options) any = any || !o.flag.empty();
    if (!any) continue;
    os << "\n" << g.title << ":\n";
    for (const auto& o : g.options) {
      if (o.flag.empty()) continue;
      std::string left = "  ";
      if (o.short_flag) left += std::string("-") + o.short_flag + ", ";
      left += "--";
      // A boolean that is on by default shows both forms; one that is off shows the flag.
      const bool on_by_default = o.is_bool() && o.text() == "on";
      if (on_by_default && o.key.rfind("no_", 0) != 0) left += "[no-]";
      left += o.flag;
      if (const auto* c = std::get_if<opt::ChoiceRef>(&o.ref)) {
        left += " ";
        for (std::size_t i = 0; i < c->names.size(); ++i) left += (i ? "|" : "") + c->names[i];
      } else if (!o.metavar.empty()) {
        left += " " + o.metavar;
      }
      std::string help = o.help;
      std::string dflt = o.default_note;
      if (dflt.empty()) {
        const std::string t = o.text();
        if (o.is_bool()) {
          if (on_by_default) dflt = t;
        } else if (!t.empty() && o.in_json) {
          dflt = t;
        }
        if (takes_optional_value(o)) dflt.clear();
      }
      if (o.required) {
        help += " (required)";
      } else if (!dflt.empty()) {
        help += " (default: " + dflt + ")";
      }
      os << left;
      std::size_t col = left.size();
      if (col + 2 > kIndent) {
        os << "\n" << std::string(kIndent, ' ');
      } else {
        os << std::string(kIndent - col, ' ');
      }
      wrap(os, help, kIndent, kWidth, kIndent);
      os << "\n";
    }
  }
  os << "\n  -h, --help" << std::string(kIndent - 12, ' ') << "Show this help\n";
  return os.str();
}

}  // namespace eaglekit::tools
