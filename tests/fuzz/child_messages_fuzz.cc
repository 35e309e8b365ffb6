// tests/fuzz/child_messages_fuzz.cc: what a child, the fork server, a parent and the shm manager
// decode from each other (mp/internal/child.h, mp/internal/shm_manager.h):
//   0: a run request (parent -> spawned child or fork server), DecodeRunRequest;
//   1: a report on a child's result channel ("hello", "failure", "exiting", "exit"),
//   DecodeChildReport; 2: the fork server's reply to a request (a pid or an error number),
//   DecodeForkServerReply; 3: a "track" request to the shm manager, DecodeTrackRequest.
// Input: one byte (low 2 bits: which; bit 2: the run request must carry a result channel, as the
// fork server requires), then the message bytes. The message carries three descriptor slots:
// /dev/null, an empty slot, /dev/null.
#include <fcntl.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/child.h"
#include "forksafe/mp/internal/shm_manager.h"
#include "forksafe/mp/process.h"
#include "tests/fuzz/fuzz_target.h"

namespace forksafe::fuzz {
namespace {

using runtime::Error;
using runtime::ErrorCode;
namespace in = mp::internal;

std::string Run(std::string_view input) {
  if (input.empty()) return "empty";
  const uint8_t control = static_cast<uint8_t>(input[0]);
  mp::Message msg = MessageWithSlots(std::string(input.substr(1)), {true, false, true});
  std::ostringstream o;
  try {
    switch (control & 3) {
      case 0: {
        in::RunRequest r = in::DecodeRunRequest(std::move(msg), (control & 4) != 0);
        o << "run " << r.entry << " name=" << r.name << " args=" << r.args.bytes.size() << "+"
          << r.args.fds.size() << " result=" << (r.result ? "yes" : "no")
          << " lifeline=" << (r.lifeline ? "yes" : "no");
        for (const auto& [k, v] : r.env) o << " env " << k << "=" << v;
        break;
      }
      case 1: {
        const in::ChildReport r = in::DecodeChildReport(msg);
        switch (r.kind) {
          case in::ChildReport::kHello: o << "hello"; break;
          case in::ChildReport::kFailure:
            o << "failure";
            if (r.failure) o << " " << r.failure->type << ": " << r.failure->message;
            break;
          case in::ChildReport::kExit:
            o << "exit";
            if (r.wait_status) o << " " << *r.wait_status;
            break;
          case in::ChildReport::kExiting:
            o << "exiting";
            if (r.exit_code) o << " " << *r.exit_code;
            break;
          case in::ChildReport::kOther: o << "other"; break;
        }
        break;
      }
      case 2: o << "pid " << in::DecodeForkServerReply(msg); break;
      default: {
        const std::optional<std::string> name = in::DecodeTrackRequest(msg);
        o << (name ? "track " + *name : std::string("ignored"));
        break;
      }
    }
  } catch (const Error& e) {
    const bool server_error = (control & 3) == 2 && (e.code() == ErrorCode::kInternal ||
                                                     e.code() == ErrorCode::kResourceExhausted);
    if (e.code() != ErrorCode::kInvalidArgument && !server_error) __builtin_trap();
    return ErrorText(e);
  }
  return o.str();
}

}  // namespace

std::string Describe(std::string_view input) { return Run(input); }

std::vector<Seed> Seeds() {
  std::vector<Seed> s;
  {
    // As EncodeRunRequest builds it: the arguments' descriptors first (slot 0), then result and
    // lifeline (slots 2 and 0 here).
    mp::Message args = mp::Encode(std::string("arg"));
    std::ostringstream os(std::ios::binary);
    {
      cereal::BinaryOutputArchive ar(os);
      ar(std::string("run"), std::string("MyEntry"), std::string("Process-1"), args.bytes,
         int32_t{2}, int32_t{0},
         std::vector<std::pair<std::string, std::string>>{{"RANK", "3"}, {"WORLD_SIZE", "4"}});
    }
    s.push_back({"run_request", std::string(1, '\x04') + os.str(),
                 "run MyEntry name=Process-1 args=11+3 result=yes lifeline=yes env RANK=3 env "
                 "WORLD_SIZE=4"});
    std::ostringstream spawn(std::ios::binary);
    {
      cereal::BinaryOutputArchive ar(spawn);
      ar(std::string("run"), std::string("E"), std::string(""), std::string(), int32_t{-1},
         int32_t{2}, std::vector<std::pair<std::string, std::string>>{});
    }
    s.push_back({"run_request_spawn", std::string(1, '\x00') + spawn.str(),
                 "run E name= args=0+3 result=no lifeline=yes"});
  }
  s.push_back({"report_hello", ControlByteInput(1, std::string("hello"), std::string()), "hello"});
  s.push_back(
      {"report_failure",
       ControlByteInput(1, std::string("failure"),
                        mp::Encode(mp::ChildFailure{"std::runtime_error", "boom", "#0 f"}).bytes),
       "failure std::runtime_error: boom"});
  s.push_back({"report_exit",
               ControlByteInput(1, std::string("exit"), mp::Encode(int32_t{256}).bytes),
               "exit 256"});
  s.push_back({"server_pid", ControlByteInput(2, int32_t{4242}), "pid 4242"});
  s.push_back({"server_enomem", ControlByteInput(2, int32_t{-12}), "error: resource_exhausted"});
  s.push_back({"track", ControlByteInput(3, std::string("track"), std::string("forksafe_12_ab")),
               "track forksafe_12_ab"});
  s.push_back({"track_bad_name",
               ControlByteInput(3, std::string("track"), std::string("forksafe_1/../x")),
               "ignored"});
  return s;
}

}  // namespace forksafe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)forksafe::fuzz::Run(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
