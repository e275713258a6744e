// Filling declared defaults through protobuf reflection (see defaults.h).
#include "framework/config/defaults.h"

#include "framework/config/carry.pb.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

namespace carry::config_internal {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

void fill_defaults(Message& m) {
  auto* d = m.GetDescriptor();
  auto* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    auto* f = d->field(i);
    if (f->is_repeated()) {
      // Entries of a repeated message are filled too (data.token_files.sources), except mixer_options,
      // whose unset fields mean "inherit" (carry.proto).
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && f->message_type() != config::MixerOptions::descriptor())
        for (int j = 0; j < r->FieldSize(m, f); ++j) fill_defaults(*r->MutableRepeatedMessage(&m, f, j));
      continue;
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->real_containing_oneof() && !r->HasField(m, f)) continue;
      fill_defaults(*r->MutableMessage(&m, f));
      continue;
    }
    if (r->HasField(m, f) || !f->has_default_value()) continue;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32: r->SetInt32(&m, f, f->default_value_int32()); break;
      case FieldDescriptor::CPPTYPE_INT64: r->SetInt64(&m, f, f->default_value_int64()); break;
      case FieldDescriptor::CPPTYPE_UINT32: r->SetUInt32(&m, f, f->default_value_uint32()); break;
      case FieldDescriptor::CPPTYPE_UINT64: r->SetUInt64(&m, f, f->default_value_uint64()); break;
      case FieldDescriptor::CPPTYPE_DOUBLE: r->SetDouble(&m, f, f->default_value_double()); break;
      case FieldDescriptor::CPPTYPE_FLOAT: r->SetFloat(&m, f, f->default_value_float()); break;
      case FieldDescriptor::CPPTYPE_BOOL: r->SetBool(&m, f, f->default_value_bool()); break;
      case FieldDescriptor::CPPTYPE_ENUM: r->SetEnum(&m, f, f->default_value_enum()); break;
      case FieldDescriptor::CPPTYPE_STRING: r->SetString(&m, f, f->default_value_string()); break;
      case FieldDescriptor::CPPTYPE_MESSAGE: break;
    }
  }
}

}  // namespace carry::config_internal
