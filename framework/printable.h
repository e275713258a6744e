// Text from files and command lines shown back to a user: bytes that would act on a terminal or are
// not UTF-8 are written as \xNN, so that an error message about a binary or damaged file is one
// readable text, never raw bytes.
#pragma once

#include <cstddef>
#include <string>

namespace carry {

// The length of the valid UTF-8 sequence at s[i] (1 to 4), or 0 when there is none (overlong forms
// and surrogates are not valid).
size_t utf8_length(const std::string& s, size_t i);

// `s` with control bytes (all but tab, and newline when keep_newlines), DEL and bytes that are not
// UTF-8 written as \xNN.
std::string printable(const std::string& s, bool keep_newlines = true);

// "\xNN" for a byte.
std::string hex_escape(unsigned char c);

}  // namespace carry
