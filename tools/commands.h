// Entry points of the subcommands, one tools/cmd_NAME.cpp each. Listed in the table in
// tools/main.cpp.
#pragma once

namespace eaglekit::tools {

int run_inspect(int argc, char** argv);
int run_convert(int argc, char** argv);
int run_synth(int argc, char** argv);
int run_index(int argc, char** argv);
int run_validate(int argc, char** argv);
int run_validate_base(int argc, char** argv);  // eaglekit-torch: validate with --base
int run_stats(int argc, char** argv);
int run_pack(int argc, char** argv);
int run_verify(int argc, char** argv);
int run_collate(int argc, char** argv);
int run_loader_bench(int argc, char** argv);
int run_launch(int argc, char** argv);
int run_vocab(int argc, char** argv);
int run_train(int argc, char** argv);
int run_evaluate(int argc, char** argv);
int run_export(int argc, char** argv);
int run_report(int argc, char** argv);

}  // namespace eaglekit::tools
