// CommandArgs (framework/cli/command_args.h), the argument reader of every `carry` subcommand:
// "--flag value" and "--flag=value" alike, repeated flags, flags with several values, switches that
// refuse a value, values that start with '-', and the one-line UsageError of each mistake.
#include "framework/cli/command_args.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace carry {
namespace {

// CommandArgs over {"cmd", args...}; the strings live as long as the Argv.
struct Argv {
  std::vector<std::string> strings;
  std::vector<char*> ptrs;
  explicit Argv(std::vector<std::string> args) : strings(std::move(args)) {
    strings.insert(strings.begin(), "cmd");
    for (auto& s : strings) ptrs.push_back(s.data());
  }
  CommandArgs args() { return CommandArgs(static_cast<int>(ptrs.size()), ptrs.data()); }
};

// The message of the UsageError that f throws ("" when none).
template <class F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(CommandArgs, FlagValueAndFlagEqualsValueReadTheSame) {
  for (auto form : {std::vector<std::string>{"--out", "DIR", "--n", "7", "POS"},
                    std::vector<std::string>{"--out=DIR", "--n=7", "POS"}}) {
    Argv argv(form);
    CommandArgs args = argv.args();
    std::string out, pos;
    int64_t n = 0;
    for (std::string f; args.next(f);) {
      if (f == "--out") out = args.value(f);
      else if (f == "--n") n = args.integer(f, 1);
      else pos = f;
    }
    EXPECT_EQ(out, "DIR");
    EXPECT_EQ(n, 7);
    EXPECT_EQ(pos, "POS");
  }
}

TEST(CommandArgs, RepeatedFlagsAndValuesWithEqualsOrDashes) {
  Argv argv({"--set", "a=1", "--set=b=2", "--set", "c.d=x=y", "--window", "-3", "--name=--odd", "--empty="});
  CommandArgs args = argv.args();
  std::vector<std::string> sets;
  std::string window, name, empty = "unset";
  for (std::string f; args.next(f);) {
    if (f == "--set") sets.push_back(args.value(f));
    else if (f == "--window") window = args.value(f);
    else if (f == "--name") name = args.value(f);
    else if (f == "--empty") empty = args.value(f);
    else FAIL() << "unexpected " << f;
  }
  EXPECT_EQ(sets, (std::vector<std::string>{"a=1", "b=2", "c.d=x=y"}));
  EXPECT_EQ(window, "-3");
  EXPECT_EQ(name, "--odd");
  EXPECT_EQ(empty, "");
}

TEST(CommandArgs, SeveralValuesUpToTheNextFlag) {
  Argv argv({"--input", "a", "b", "-c", "--output", "o", "--input=d", "e", "--x"});
  CommandArgs args = argv.args();
  std::vector<std::string> inputs, flags;
  for (std::string f; args.next(f);) {
    flags.push_back(f);
    if (f == "--input") {
      for (auto& v : args.values()) inputs.push_back(v);
    } else if (f == "--output") {
      EXPECT_EQ(args.value(f), "o");
    }
  }
  EXPECT_EQ(inputs, (std::vector<std::string>{"a", "b", "-c", "d", "e"}));
  EXPECT_EQ(flags, (std::vector<std::string>{"--input", "--output", "--input", "--x"}));
  Argv none({"--input", "--output", "o"});
  CommandArgs args2 = none.args();
  std::string f;
  ASSERT_TRUE(args2.next(f));
  EXPECT_TRUE(args2.values().empty());
}

TEST(CommandArgs, ListsOfNamesAndIntegers) {
  Argv argv({"--families=gla,deltanet", "--T", "16,32", "--bad=16,x"});
  CommandArgs args = argv.args();
  std::string f;
  ASSERT_TRUE(args.next(f));
  EXPECT_EQ(args.list(f), (std::vector<std::string>{"gla", "deltanet"}));
  ASSERT_TRUE(args.next(f));
  EXPECT_EQ(args.integers(f, 1), (std::vector<int64_t>{16, 32}));
  ASSERT_TRUE(args.next(f));
  EXPECT_EQ(usage_error([&] { args.integers(f, 1); }),
            "--bad needs a comma-separated list of integers >= 1, got '16,x'");
  EXPECT_EQ(split_list("a,,b"), (std::vector<std::string>{"a", "", "b"}));
  EXPECT_TRUE(split_list("").empty());
}

TEST(CommandArgs, NumbersAndTheirErrors) {
  auto first = [](std::vector<std::string> a, auto read) {
    Argv argv(std::move(a));
    CommandArgs args = argv.args();
    std::string f;
    EXPECT_TRUE(args.next(f));
    return usage_error([&] { read(args, f); });
  };
  auto integer = [](int64_t min) { return [min](CommandArgs& a, const std::string& f) { a.integer(f, min); }; };
  auto number = [](CommandArgs& a, const std::string& f) { a.number(f); };
  auto positive = [](CommandArgs& a, const std::string& f) { a.positive_number(f); };
  EXPECT_EQ(first({"--n=abc"}, integer(1)), "--n needs an integer >= 1, got 'abc'");
  EXPECT_EQ(first({"--n", "0"}, integer(1)), "--n needs an integer >= 1, got '0'");
  EXPECT_EQ(first({"--n", "3.5"}, integer(0)), "--n needs an integer >= 0, got '3.5'");
  EXPECT_EQ(first({"--n="}, integer(0)), "--n needs an integer >= 0, got ''");
  EXPECT_EQ(first({"--n", "99999999999999999999"}, integer(0)),
            "--n needs an integer >= 0, got '99999999999999999999'");
  EXPECT_EQ(first({"--n", "-2"}, integer(-5)), "");
  EXPECT_EQ(first({"--x", "inf"}, number), "--x needs a finite number, got 'inf'");
  EXPECT_EQ(first({"--x=-0.5"}, number), "");
  EXPECT_EQ(first({"--x=-0.5"}, positive), "--x needs a positive number, got '-0.5'");
  EXPECT_EQ(first({"--x", "0"}, positive), "--x needs a positive number, got '0'");
  EXPECT_EQ(first({"--x", "2.5"}, positive), "");
}

TEST(CommandArgs, MissingValueAndSwitchWithValue) {
  Argv missing({"POS", "--out"});
  CommandArgs args = missing.args();
  std::string f;
  ASSERT_TRUE(args.next(f));
  ASSERT_TRUE(args.next(f));
  EXPECT_EQ(usage_error([&] { args.value(f); }), "--out needs a value");

  // A switch is not read with value(): its "=value" is refused by the next next(), at the end too.
  for (auto form : {std::vector<std::string>{"--cpu=yes", "POS"}, std::vector<std::string>{"POS", "--cpu=yes"}}) {
    Argv sw(form);
    CommandArgs a = sw.args();
    EXPECT_EQ(usage_error([&] {
                for (std::string x; a.next(x);) {
                }
              }),
              "--cpu takes no value, got '--cpu=yes'");
  }
  // A positional argument with '=' is one argument.
  Argv pos({"a=b"});
  CommandArgs p = pos.args();
  ASSERT_TRUE(p.next(f));
  EXPECT_EQ(f, "a=b");
  EXPECT_FALSE(p.next(f));
}

TEST(CommandArgs, HelpAndHas) {
  EXPECT_TRUE(Argv({"x", "--help"}).args().help());
  EXPECT_TRUE(Argv({"-h"}).args().help());
  EXPECT_FALSE(Argv({"--helpful"}).args().help());
  EXPECT_TRUE(Argv({"--sp-mode=tree"}).args().has("--sp-mode"));
  EXPECT_TRUE(Argv({"--sp-mode", "tree"}).args().has("--sp-mode"));
  EXPECT_FALSE(Argv({"--sp-modes", "tree"}).args().has("--sp-mode"));
}

}  // namespace
}  // namespace carry
