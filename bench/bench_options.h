// `--name value` options of the C++ benchmarks: `opt` holds the accepted
// names with their defaults; an unknown name prints `usage` and fails.
#pragma once

#include <cstdio>
#include <map>
#include <string>

namespace megamoe::bench {

inline bool parse_options(int argc, char** argv, std::map<std::string, std::string>* opt, const std::string& usage) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || !opt->count(a.substr(2))) {
      std::fprintf(stderr, "usage: %s\n", usage.c_str());
      return false;
    }
    (*opt)[a.substr(2)] = argv[i + 1];
  }
  return true;
}

}  // namespace megamoe::bench
