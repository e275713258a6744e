// Filling the defaults a schema declares ([default = ...] in carry.proto and cluster.proto), internal
// to framework/config: a loaded config has every such field set, so the resolved config is explicit.
#pragma once

#include <google/protobuf/message.h>

namespace carry::config_internal {

// Sets every unset singular field that declares a default, recursing into singular sub-messages
// (creating them) except unselected oneof members. Lists are left as written; entries of a repeated
// message are filled too, except MixerOptions (whose unset fields mean "inherit").
void fill_defaults(google::protobuf::Message& m);

}  // namespace carry::config_internal
