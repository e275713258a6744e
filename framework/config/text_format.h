// Reading a config as textproto, internal to framework/config: files read as text (size-limited,
// UTF-8, no control bytes), protobuf's parse errors as "file:line:column: message" with the line and a
// caret under the column, unknown fields and enum values completed with the valid ones, and where each
// field was written (for validation errors that point at it). Protobuf's text tokenizer counts columns
// in bytes with tabs advancing to the next multiple of 8; errors here give 1-based character columns.
#pragma once

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>

#include <memory>
#include <string>
#include <vector>

namespace carry::config_internal {

// A config file's text. Throws ConfigError when it cannot be read, is a directory or is too large.
std::string read_text_file(const std::string& path);

// A place in a file.
struct Location {
  int line = -1;      // 1-based; -1 = unknown
  int column = -1;    // 1-based characters
};

// Protobuf's 0-based line and column (bytes, tabs to multiples of 8) in `text` as a Location.
Location to_location(const std::string& text, int line0, int column0);

std::vector<std::string> field_names(const google::protobuf::Descriptor* d);
std::vector<std::string> enum_names(const google::protobuf::EnumDescriptor* e);

// Protobuf's messages for an unknown field or enum value, completed with what is valid there.
std::string explain(const std::string& message);

// Protobuf's parse errors, as reported.
class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  struct Item {
    int line, column;
    std::string message;
  };
  std::vector<Item> errors;
  void AddError(int line, google::protobuf::io::ColumnNumber column, const std::string& message) override {
    errors.push_back({line, column, message});
  }
};

// A parsed file: its text and where each field was written.
struct Source {
  std::string name;
  std::string text;
  std::unique_ptr<google::protobuf::TextFormat::ParseInfoTree> tree =
      std::make_unique<google::protobuf::TextFormat::ParseInfoTree>();
};

// Parses source.text into `message` (unknown fields are errors), recording where each field was
// written in source.tree. Throws ConfigError with every parse error located and explained.
void parse_into(Source& source, google::protobuf::Message& message);

}  // namespace carry::config_internal
