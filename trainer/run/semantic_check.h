// `eaglekit validate --base DIR`: does each record's hidden state predict its own next
// token through the base's head? For sampled positions t of every record (those whose
// next token is counted by the loss mask), it computes argmax(lm_head(h[t])) with the
// hidden state taken as after the final norm (post) and as before it (pre: the base's
// RMSNorm applied first), and counts how often each equals input_ids[t + 1].
//
// From those counts it tells the dump's norm form (the form that is right where the other is
// wrong clearly more often: McNemar's z beyond 4), how
// the per-record agreement is distributed, and which records agree far less than the rest:
// a record whose count is below what the dataset's median agreement makes plausible
// (binomial tail below `tail`) is a suspect. Swapped hidden states, ids shifted by one,
// another layer or another model all look like that; for each suspect the report says
// whether h[t] predicts input_ids[t] or [t + 2] instead (a shift). A dataset whose pooled
// agreement is near chance for both forms was likely dumped from another model than the
// base.
//
// Memory is bounded: records are read `chunk` at a time (on `jobs` threads) and their
// sampled rows go through the head in blocks. Cost: positions x H x V multiply-adds per
// record (Llama-3.1-8B, 32 positions: 17 GFLOP).
//
// Thread safety: one call at a time per BaseModel. Errors: UsageError for bad options or a
// base that does not fit the data; FormatError/IoError from reading records.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace eaglekit {
struct Dataset;
struct SampleRef;
}  // namespace eaglekit

namespace eaglekit::trainer {

struct BaseModel;

struct SemanticOptions {
  std::int64_t positions = 32;  // sampled per record, evenly over its counted positions
  double tail = 1e-6;           // binomial tail probability below which a record is a suspect
  int jobs = 0;                 // reader threads; 0: all cores
  std::string device = "cpu";   // where the head runs
  // The form each record is measured in: its stated one (SampleRef::hidden_states_prenorm)
  // when it states one; else this, where -1 also takes the form its layout implies
  // (SampleRef::layout_prenorm) first: -1 the form detected over the dataset (post when
  // unclear), 0 post, 1 pre. A record read in a form its flag or this option names whose
  // states predict clearly better in the other form (McNemar's z > 4 over its own
  // positions) is a suspect.
  int unstated_form = -1;
};

// What validate --base says before it starts: the work of the check (records x positions
// through the base's [V, H] head, both forms) and, on the CPU, a lower bound of its time
// from a matmul timed here; it says "this will take long" above a minute. One line.
std::string semantic_check_notice(std::int64_t records, std::int64_t positions, std::int64_t vocab_size,
                                  std::int64_t hidden_size, const std::string& device);

struct SemanticRecord {
  std::string id;
  std::int64_t positions = 0;
  std::int64_t agree_post = 0, agree_pre = 0;
  std::int64_t agree_same = 0;   // argmax == input_ids[t] (ids shifted one way)
  std::int64_t agree_skip = 0;   // argmax == input_ids[t + 2] (the other way)
  std::int64_t post_only = 0, pre_only = 0;  // positions only that form gets right
  std::optional<bool> stated;    // the record's stated form (true pre-norm)
  std::optional<bool> layout;    // the form its layout implies (SampleRef::layout_prenorm)
  bool measured_pre = false;     // the form its agreement is read in
  std::string reason;            // for suspects, in words
};

struct SemanticReport {
  std::int64_t records = 0, positions = 0;
  std::int64_t agree_post = 0, agree_pre = 0;  // pooled
  std::int64_t post_only = 0, pre_only = 0;    // positions only that form gets right
  bool has_final_norm = false;                 // the base holds model.norm.weight (pre is measured)
  std::string norm_form;                       // "post", "pre", or "unclear" (norm_sequential_test)
  std::string norm_test;                       // that test in words
  std::int64_t stated_pre = 0, stated_post = 0;  // records that state their form
  double chance = 0;                           // 1 / vocab_size
  double p10 = 0, median = 0, p90 = 0;         // per-record agreement in the detected form
  std::vector<SemanticRecord> suspects;
  std::vector<SemanticRecord> per_record;      // every record's counts, in the order given
  std::vector<std::string> problems;           // dataset-level, in words
  std::string to_json() const;
  std::string to_text() const;
};

SemanticReport semantic_check(const Dataset& dataset, const std::vector<SampleRef>& samples, const BaseModel& base,
                              const SemanticOptions& options);

// The norm form's sequential test, one rule for `validate --base` (over every record it reads)
// and for train's and evaluate's measurement (which reads records until the rule decides).
// Records are read in norm_read_order: looks after 8, 16, 32, ... records, each look's records
// spread evenly over the list with the earlier looks' among them, the last look at all of them.
// At look k (1, 2, ...) the exact two-sided sign test on the positions where exactly one form
// predicts the next token decides when its p <= kNormAlpha / 2^k, so that over all looks the
// chance of naming a form when neither predicts better is at most kNormAlpha (a Bonferroni
// split; a form that predicts better is named at the first look whose counts show it). A look
// whose pooled agreement is near chance for both forms ends the test: "unclear" (the dump is
// not of this base). A base without a final norm: "unclear" (nothing tells the forms apart).
inline constexpr double kNormAlpha = 1e-4;
std::vector<std::size_t> norm_read_order(std::size_t n);  // a permutation of [0, n)
std::vector<std::size_t> norm_looks(std::size_t n);       // how many records have been read at each look

struct NormTest {
  std::string form = "unclear";  // "post", "pre" or "unclear"
  bool near_chance = false;
  int look = 0, looks = 0;       // the look that decided (or the last one read), of how many
  double p = 1;                  // the sign test's p at that look
  double threshold = 0;          // kNormAlpha / 2^look
  std::int64_t records = 0, positions = 0, agree_post = 0, agree_pre = 0, post_only = 0, pre_only = 0;
};
// `read`: per-record counts in norm_read_order of a list of `total` records, as far as read.
NormTest norm_sequential_test(const std::vector<SemanticRecord>& read, std::size_t total, std::int64_t vocab_size,
                              bool has_final_norm);

// What measure_norm_form found: "post", "pre" or "unclear", and the counts in words.
struct NormMeasurement {
  std::string form;
  std::string said;
  std::int64_t records = 0, positions = 0, post_only = 0, pre_only = 0;
};

// How `train` and `evaluate` tell the norm form of records that state none and whose layout
// implies none (run_setup.h plan_hidden_states_norm): norm_sequential_test over `samples`,
// reading them look by look until it decides, all of them are read, or `max_records` are
// (for a cost bound: a clear dump decides at the first look of 8). The head runs on the CPU
// (a plan opens no device). Cost: records x positions x 2 x V x H multiply-adds.
inline constexpr std::int64_t kNormMaxRecords = 4096;
NormMeasurement measure_norm_form(const Dataset& dataset, const std::vector<SampleRef>& samples, const BaseModel& base,
                                  std::int64_t max_records = kNormMaxRecords, std::int64_t positions = 32);

}  // namespace eaglekit::trainer
