// acc::parse_json / acc::read_json_file: what nlohmann::json::parse accepts silently (a repeated
// key, unbounded nesting) is refused, and every error names what was read.
#include "acc/util/json.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "acc/util/error.hpp"

namespace acc {
namespace {

namespace fs = std::filesystem;

template <class Exc, class Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    FAIL() << "no error, expected one containing '" << needle << "'";
  } catch (const Exc& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "'" << e.what() << "' lacks '" << needle << "'";
  }
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "acc_json_test_XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name, const std::string& text) const {
    const std::string p = (path_ / name).string();
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

TEST(ParseJson, RefusesARepeatedKeyAtTopLevelNamingTheKey) {
  // nlohmann::json::parse keeps the last "n_layer" (4) and drops the first without a word.
  ASSERT_EQ(nlohmann::json::parse(R"({"n_layer": 2, "n_layer": 4})")["n_layer"], 4);
  expect_error<ValueError>(
      [] { parse_json(R"({"n_layer": 2, "n_layer": 4})", "--config 'a.json'"); },
      "--config 'a.json': duplicate key \"n_layer\" (JSON objects must not "
      "repeat a key)");
}

TEST(ParseJson, RefusesARepeatedKeyAtAnyDepthNamingWhere) {
  struct Case {
    const char* text;
    const char* needle;
  };
  const Case cases[] = {
      {R"([{"name": "grad_accum", "config": {"steps": 1, "steps": 2}}])",
       "strategy: duplicate key \"steps\" in /0/config"},
      {R"([{"name": "ddp"}, {"name": "amp", "name": "ddp"}])", "duplicate key \"name\" in /1 "},
      {R"({"a": [1, [2, {"x/y~": {"k": 1, "k": 1}}]]})", "duplicate key \"k\" in /a/1/1/x~1y~0"},
      {R"({"a": {}, "b": {"c": 1}, "a": 2})", "duplicate key \"a\" (JSON"},
  };
  for (const Case& c : cases) {
    EXPECT_NO_THROW(nlohmann::json::parse(c.text)) << c.text;  // the old readers took these
    expect_error<ValueError>([&] { parse_json(c.text, "strategy"); }, c.needle);
  }
}

TEST(ParseJson, TheSameKeyInDifferentObjectsIsFine) {
  for (const char* text : {R"([{"a": 1}, {"a": 2}])", R"({"a": {"a": {"a": 1}}, "b": {"a": 2}})",
                           R"({"a": [{"k": 1}, {"k": 2}], "k": 3})"}) {
    EXPECT_EQ(parse_json(text, "test"), nlohmann::json::parse(text)) << text;
  }
}

TEST(ParseJson, SyntaxErrorsNameWhatAndWhere) {
  struct Case {
    const char* text;
    const char* needle;
  };
  const Case cases[] = {
      {"{\n  \"a\": 1,\n}", "--config 'x.json': invalid JSON: parse error at line 3, column 1"},
      {"{} trailing",
       "invalid JSON: parse error at line 1, column 6: syntax error while parsing value - invalid "
       "literal; last read: '{} tra'; expected end of input"},
      {"", "invalid JSON: parse error at line 1, column 1"},
      {"[1, 2", "invalid JSON: parse error at line 1, column 6"},
      {"{\"a\": \"\xff\"}", "invalid JSON: parse error at line 1, column 8"},
      {"{\"a\": 01}", "invalid JSON"},
  };
  for (const Case& c : cases) {
    expect_error<ValueError>([&] { parse_json(c.text, "--config 'x.json'"); }, c.needle);
  }
}

TEST(ParseJson, RefusesNestingDeeperThanTheLimit) {
  const std::string ok(kMaxJsonDepth, '[');
  EXPECT_NO_THROW(parse_json(ok + std::string(kMaxJsonDepth, ']'), "test"));
  // nlohmann parses 1e6 levels, but dumping them (as an error message would) overflows the stack.
  const std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
  expect_error<ValueError>([&] { parse_json(deep, "--strategy"); },
                           "--strategy: JSON nested deeper than 128 levels at /0/0/0");
  expect_error<ValueError>([&] { parse_json("{\"a\": " + std::string(200, '[') + "}", "test"); },
                           "nested deeper than 128 levels at /a/0/");
}

TEST(ParseJson, KeepsNumbersExact) {
  const nlohmann::json j = parse_json(
      R"({"u": 18446744073709551615, "i": -9223372036854775808, "big": 9007199254740993,
          "f": 0.1, "e": 1e300})",
      "test");
  EXPECT_EQ(j["u"].get<uint64_t>(), UINT64_MAX);
  EXPECT_EQ(j["i"].get<int64_t>(), INT64_MIN);
  EXPECT_TRUE(j["big"].is_number_integer());
  EXPECT_EQ(j["big"].get<int64_t>(), 9007199254740993);  // 2^53 + 1: not representable as double
  EXPECT_EQ(j["f"].get<double>(), 0.1);
  EXPECT_EQ(j["e"].get<double>(), 1e300);
}

TEST(ReadJsonFile, ValidFilesReadAsNlohmannReadsThem) {
  std::vector<std::string> files;
  for (const char* dir : {"/examples/configs", "/tests/golden"}) {
    for (const auto& e : fs::directory_iterator(std::string(ACC_SOURCE_DIR) + dir)) {
      if (e.path().extension() == ".json") files.push_back(e.path().string());
    }
  }
  ASSERT_GE(files.size(), 6u);
  for (const auto& f : files) {
    std::ifstream in(f);
    EXPECT_EQ(read_json_file(f, "--config"), nlohmann::json::parse(in)) << f;
  }
}

TEST(ReadJsonFile, BadPathsNameThePath) {
  TempDir tmp;
  const std::string fifo = tmp.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  struct Case {
    std::string path;
    std::string needle;
  };
  const Case cases[] = {
      {tmp.path(), "--config '" + tmp.path() + "': is a directory, not a file"},
      {tmp.path() + "/", "--config '" + tmp.path() + "/': is a directory, not a file"},
      {tmp.path() + "/missing.json", "--config '" + tmp.path() + "/missing.json': no such file"},
      {tmp.path() + "/missing/a.json", "/missing/a.json': no such file"},
      {fifo, "--config '" + fifo + "': is not a regular file"},
      {"", "--config: the path is empty"},
  };
  for (const Case& c : cases) {
    expect_error<IoError>([&] { read_json_file(c.path, "--config"); }, c.needle);
  }
  // What the old reader said for a directory: no path, and not an acc::Error.
  std::ifstream in(tmp.path());
  nlohmann::json j;
  EXPECT_ANY_THROW(j = nlohmann::json::parse(in));
}

TEST(ReadJsonFile, ContentErrorsNameThePathAndPosition) {
  TempDir tmp;
  const std::string dup = tmp.file("dup.json", "{\n  \"n_layer\": 2,\n  \"n_layer\": 4\n}\n");
  expect_error<ValueError>([&] { read_json_file(dup, "--config"); },
                           "--config '" + dup + "': duplicate key \"n_layer\"");
  const std::string bad = tmp.file("bad.json", "{\n  \"n_layer\": 2,\n}\n");
  expect_error<ValueError>([&] { read_json_file(bad, "--config"); },
                           "--config '" + bad + "': invalid JSON: parse error at line 3, column 1");
  const std::string empty = tmp.file("empty.json", "");
  expect_error<ValueError>([&] { read_json_file(empty, "--config"); },
                           "--config '" + empty + "': invalid JSON");
}

}  // namespace
}  // namespace acc
