// Tests for framework/train/run_log.h and framework/io/tfevents.h: CRC-32C against the standard check
// value, event records read back with both CRCs and a flipped byte caught, the JSON lines parser, lines
// that stay valid JSON (escaped keys, non-finite values as null), and RunLog's resume clean-up (records
// past the start step and a cut line dropped, the TensorBoard file replaced by one that replays
// exactly the kept records).
#include "framework/train/run_log.h"

#include "framework/io/tfevents.h"
#include "framework/io/tfevents.pb.h"
#include "tests/helpers/temp_dir.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <dirent.h>

#include <cmath>
#include <fstream>
#include <map>

namespace carry {
namespace {

using testing::make_temp_dir;
using testing::remove_tree;

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (auto* e = ::readdir(d))
      if (std::string(e->d_name).find("tfevents") != std::string::npos) out.push_back(dir + "/" + e->d_name);
    ::closedir(d);
  }
  return out;
}

// tag -> [(step, value)] of every scalar in an event file; checks the file-version event first.
std::map<std::string, std::vector<std::pair<int64_t, float>>> scalars_of(const std::string& file) {
  std::map<std::string, std::vector<std::pair<int64_t, float>>> out;
  auto records = read_event_records(file);
  EXPECT_FALSE(records.empty());
  for (size_t i = 0; i < records.size(); ++i) {
    tfevents::Event e;
    EXPECT_TRUE(e.ParseFromString(records[i]));
    if (i == 0) {
      EXPECT_EQ(e.file_version(), "brain.Event:2");
      continue;
    }
    for (auto& v : e.summary().value()) out[v.tag()].emplace_back(e.step(), v.simple_value());
  }
  return out;
}

TEST(TfEvents, Crc32cMatchesTheCheckValue) {
  // The CRC-32C check value (RFC 3720, B.4): "123456789" -> 0xE3069283.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  uint32_t zeros[8] = {};
  EXPECT_EQ(crc32c(zeros, 32), 0x8A9136AAu);  // 32 zero bytes (RFC 3720, B.4)
}

TEST(TfEvents, RecordsReadBackAndCorruptionIsCaught) {
  auto dir = make_temp_dir("carry_tfevents");
  const std::string file = dir + "/events.out.tfevents.1.test";
  {
    EventFileWriter w(file, 1000.5);
    w.add_scalars(1, 1001, {{"train/loss", 2.5}, {"train/lr", 1e-3}});
    w.add_scalars(2, 1002, {{"train/loss", 2.25}});
  }
  auto s = scalars_of(file);
  ASSERT_EQ(s["train/loss"].size(), 2u);
  EXPECT_EQ(s["train/loss"][1], std::make_pair(int64_t{2}, 2.25f));
  EXPECT_FLOAT_EQ(s["train/lr"][0].second, 1e-3f);
  // Flip one byte inside the second record's data.
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto first_len = static_cast<size_t>(static_cast<unsigned char>(bytes[0]));
  bytes[16 + first_len + 12 + 3] ^= 0x40;
  std::ofstream(file, std::ios::binary) << bytes;
  try {
    read_event_records(file);
    ADD_FAILURE() << "a flipped byte was not caught";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the data's CRC does not match"), std::string::npos) << e.what();
  }
  remove_tree(dir);
}

TEST(RunLogLines, ParseWhatIsWrittenAndRefuseTheRest) {
  RunLogRecord r;
  ASSERT_TRUE(parse_run_log_line(R"({"step":12,"time":1.7e9,"loss":null,"event":"resume","x":-3.5})", &r));
  ASSERT_EQ(r.size(), 5u);
  EXPECT_EQ(r[0].key, "step");
  EXPECT_EQ(r[0].number, 12);
  EXPECT_TRUE(std::isnan(r[2].number));
  EXPECT_TRUE(r[3].is_text);
  EXPECT_EQ(r[3].text, "resume");
  EXPECT_EQ(r[4].number, -3.5);
  EXPECT_FALSE(parse_run_log_line(R"({"step":12,"loss":3.)", &r));  // cut short
  EXPECT_FALSE(parse_run_log_line(R"({"step":12,"loss":})", &r));
  EXPECT_FALSE(parse_run_log_line("", &r));
}

// A key with a quote, a backslash and control characters, and non-finite values: the line is valid
// JSON (protobuf's parser reads it), the parser gets the key back, and NaN/inf are null.
TEST(RunLog, LinesAreValidJsonWhateverTheKeysHold) {
  auto dir = make_temp_dir("carry_run_log_json");
  const std::string path = dir + "/metrics.jsonl";
  const std::string key = "odd \"key\"\\\n\t\x01";
  {
    RunLog log(path, false, true);
    log.start(0, false, 100);
    log.record(1, 101.25, {{key, 0.1}, {"nan", std::nan("")}, {"inf", HUGE_VAL}, {"exact", 2.5533263185844586e-3}});
  }
  auto lines = lines_of(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1], "{\"step\":1,\"time\":101.250,\"odd \\\"key\\\"\\\\\\n\\t\\u0001\":0.1,\"nan\":null,\"inf\":null,"
                      "\"exact\":0.0025533263185844586}");
  for (auto& l : lines) {
    google::protobuf::Value v;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(l, &v).ok()) << l;
  }
  RunLogRecord r;
  ASSERT_TRUE(parse_run_log_line(lines[1], &r)) << lines[1];
  ASSERT_EQ(r.size(), 6u);
  EXPECT_EQ(r[2].key, key);
  EXPECT_EQ(r[2].number, 0.1);
  EXPECT_TRUE(std::isnan(r[3].number) && std::isnan(r[4].number));
  EXPECT_EQ(r[5].number, 2.5533263185844586e-3);
  remove_tree(dir);
}

TEST(RunLog, ResumeDropsRecordsPastTheStartAndTensorBoardAgrees) {
  auto dir = make_temp_dir("carry_run_log");
  const std::string path = dir + "/run/metrics.jsonl";
  {
    RunLog log(path, true, true);
    auto s = log.start(0, false, 100);
    EXPECT_EQ(s.dropped, 0);
    for (int step = 1; step <= 5; ++step) log.record(step, 100 + step, {{"elapsed_s", step * 2.0}, {"loss", 10.0 - step}});
    log.record(4, 104.5, {{"eval_loss", 6.5}});
  }
  {  // a write cut short by a crash
    std::ofstream out(path, std::ios::app);
    out << R"({"step":6,"time":106,"lo)";
  }
  ASSERT_EQ(event_files(dir + "/run").size(), 1u);
  {
    RunLog log(path, true, true);
    auto s = log.start(3, true, 200);
    EXPECT_EQ(s.dropped, 4);  // steps 4, 5, the eval at 4, the cut line
    EXPECT_EQ(s.elapsed_s, 6.0);
    log.record(4, 201, {{"elapsed_s", 7.0}, {"loss", 5.5}});
  }
  auto lines = lines_of(path);
  std::vector<double> steps;
  for (auto& l : lines) {
    RunLogRecord r;
    ASSERT_TRUE(parse_run_log_line(l, &r)) << l;
    if (r.size() > 2 && r[0].key == "step" && r[2].key == "elapsed_s") steps.push_back(r[0].number);
  }
  EXPECT_EQ(steps, (std::vector<double>{1, 2, 3, 4}));
  EXPECT_NE(lines.back().find("\"loss\":5.5"), std::string::npos) << lines.back();
  EXPECT_NE(lines[lines.size() - 2].find(R"({"event":"resume","step":3,"time":200.000,"dropped_records":4})"),
            std::string::npos)
      << lines[lines.size() - 2];
  // One event file, replaying steps 1..3 and then step 4 of the new invocation.
  auto files = event_files(dir + "/run");
  ASSERT_EQ(files.size(), 1u);
  auto s = scalars_of(files[0]);
  ASSERT_EQ(s["train/loss"].size(), 4u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s["train/loss"][i], std::make_pair(int64_t{i + 1}, static_cast<float>(9 - i)));
  EXPECT_EQ(s["train/loss"][3], std::make_pair(int64_t{4}, 5.5f));
  EXPECT_EQ(s.count("eval/loss"), 0u);
  EXPECT_EQ(s.count("train/elapsed_s"), 0u);
  // A new run (not resumed) starts the file afresh.
  {
    RunLog log(path, true, true);
    EXPECT_EQ(log.start(0, false, 300).dropped, static_cast<int64_t>(lines.size()));
  }
  EXPECT_EQ(lines_of(path).size(), 1u);
  remove_tree(dir);
}

}  // namespace
}  // namespace carry
