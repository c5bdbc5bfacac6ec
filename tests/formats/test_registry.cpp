// The format rows: one per format, each fact read from them (detection, names, the index's
// codes, the lists help prints), and the index codes old .eki files hold.
#include <doctest/doctest.h>

#include <cstring>
#include <set>
#include <string>

#include "formats/format.h"
#include "formats/registry.h"

using namespace eaglekit;

TEST_CASE("registry: index codes stay the ones existing index files hold") {
  // On disk in every .eki file written so far (docs/formats.md, "Dataset index"): a row may
  // move, but its code may not change.
  const std::pair<Format, int> kCodes[] = {{Format::kPt, 1},   {Format::kPtGzip, 2},
                                           {Format::kSafetensors, 3}, {Format::kHdf5, 4},
                                           {Format::kEks, 5},  {Format::kTorchLegacy, 6},
                                           {Format::kDeepSpec, 7}, {Format::kNemoCache, 8}};
  for (const auto& [format, code] : kCodes) {
    CAPTURE(format_name(format));
    REQUIRE(format_row(format) != nullptr);
    CHECK(format_row(format)->index_code == code);
  }
  std::set<int> codes;
  for (const FormatRow& row : format_rows()) {
    CAPTURE(row.name);
    CHECK(row.index_code != 0);  // 0 is unknown
    CHECK(codes.insert(row.index_code).second);
  }
  CHECK(format_row(Format::kUnknown) == nullptr);
}

TEST_CASE("registry: one row per format; names, spellings and extensions name one format each") {
  std::set<Format> formats;
  std::set<std::string_view> spellings, extensions;
  for (const FormatRow& row : format_rows()) {
    CAPTURE(row.name);
    CHECK(formats.insert(row.format).second);
    CHECK(format_name(row.format) == row.name);
    CHECK(bool(row.magic));
    CHECK(bool(row.open));
    CHECK(spellings.insert(row.name).second);
    for (std::string_view a : row.aliases) CHECK(spellings.insert(a).second);
    for (std::string_view e : row.extensions) {
      CHECK(e.size() > 1);
      CHECK(e[0] == '.');
      CHECK(extensions.insert(e).second);
    }
    if (row.convert_output) {  // convert names a folder output's files by the first extension
      CHECK(bool(row.create));
      CHECK(!row.extensions.empty());
    }
  }
  CHECK(formats.size() == 8);
  CHECK(format_name(Format::kUnknown) == "unknown");
}

TEST_CASE("registry: parse_format takes the writable formats' names and aliases, nothing else") {
  CHECK(parse_format("pt") == Format::kPt);
  CHECK(parse_format("ckpt") == Format::kPt);
  CHECK(parse_format("pt.gz") == Format::kPtGzip);
  CHECK(parse_format("ckpt.gz") == Format::kPtGzip);
  CHECK(parse_format("safetensors") == Format::kSafetensors);
  CHECK(parse_format("hdf5") == Format::kHdf5);
  CHECK(parse_format("h5") == Format::kHdf5);
  CHECK(parse_format("eks") == Format::kEks);
  CHECK(parse_format("torch-legacy") == std::nullopt);  // read only to refuse it
  CHECK(parse_format("deepspec") == std::nullopt);      // read only: DeepSpec writes it
  CHECK(parse_format("nemo") == std::nullopt);          // read only: NeMo writes it
  CHECK(parse_format("unknown") == std::nullopt);
  CHECK(parse_format("PT") == std::nullopt);
  CHECK(parse_format("pth") == std::nullopt);  // an extension, not a format name
  std::string spelled;
  for (const auto& [format, name] : format_spellings()) spelled += std::string(name) + " ";
  CHECK(spelled == "pt pt.gz safetensors hdf5 eks ckpt ckpt.gz h5 ");
}

TEST_CASE("registry: each format's head is detected as that format, whatever the rows' order") {
  struct Head {
    Format format;
    std::string bytes;
  };
  const Head kHeads[] = {
      {Format::kPt, std::string("PK\3\4\x14\0\0\0{\0\0\0\0\0\0\0", 16)},  // also a safetensors-like head
      {Format::kPtGzip, std::string("\x1f\x8b\x08\0\0\0\0\0{\0", 10)},
      {Format::kTorchLegacy, std::string("\x80\x02\x8a\x0a\0\0\0\0{", 9)},
      {Format::kSafetensors, std::string("\x20\0\0\0\0\0\0\0{\"a\":", 13)},
      {Format::kHdf5, std::string("\x89HDF\r\n\x1a\n\0\0\0\0", 12)},
      {Format::kEks, std::string("EKSHARD1\x01\0\0\0", 12)},
  };
  for (const Head& h : kHeads) {
    CAPTURE(format_name(h.format));
    const auto* p = reinterpret_cast<const std::uint8_t*>(h.bytes.data());
    CHECK(detect_format(p, h.bytes.size()) == h.format);
    CHECK(detect_format(p, 1) == Format::kUnknown);  // too short for every magic
  }
  const std::uint8_t text[] = "hello, world\n";
  CHECK(detect_format(text, sizeof text - 1) == Format::kUnknown);
  // safetensors: a header length of at least 2 and below 2^40.
  std::string st("\x01\0\0\0\0\0\0\0{", 9);
  CHECK(detect_format(reinterpret_cast<const std::uint8_t*>(st.data()), st.size()) == Format::kUnknown);
  st[5] = 1;
  CHECK(detect_format(reinterpret_cast<const std::uint8_t*>(st.data()), st.size()) == Format::kUnknown);
}

TEST_CASE("registry: format_list names rows in row order with the last separator before the last") {
  const auto all = [](const FormatRow&) { return true; };
  CHECK(format_list(&FormatRow::name, all, ", ", " or ") ==
        "pt, pt.gz, torch-legacy, safetensors, hdf5, eks, deepspec or nemo");
  const auto shards = [](const FormatRow& r) { return !r.one_record; };
  CHECK(format_list(&FormatRow::name, shards, ", ", " or ") == "hdf5, eks, deepspec or nemo");
  const auto named = [](const FormatRow& r) { return !r.noun.empty(); };
  CHECK(format_list(&FormatRow::noun, named, ", ", " or ") ==
        "a torch.save zip, .ckpt.gz, safetensors, HDF5, .eks shard, DeepSpec manifest.json or NeMo cache "
        "manifest.json");
  const auto none = [](const FormatRow&) { return false; };
  CHECK(format_list(&FormatRow::name, none, ", ", " or ").empty());
}
