// tests/fuzz/pool_messages_fuzz.cc: the messages between a Pool and its workers
// (mp/internal/pool_messages.h): a task as a worker decodes it (DecodePoolTask), and a reply as
// the parent decodes it (DecodePoolReply, then the ChildFailure of "init_failed" and "error").
// Input: one byte (bit 0: task or reply), then the message bytes. The message carries two
// descriptor slots (/dev/null, empty), which the payload takes.
#include <fcntl.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

#include "forksafe/mp/codec.h"
#include "forksafe/mp/internal/pool_messages.h"
#include "forksafe/mp/process.h"
#include "tests/fuzz/fuzz_target.h"

namespace forksafe::fuzz {
namespace {

using runtime::Error;
using runtime::ErrorCode;
namespace in = mp::internal;

std::string Run(std::string_view input) {
  if (input.empty()) return "empty";
  const bool task = (static_cast<uint8_t>(input[0]) & 1) == 0;
  mp::Message msg = MessageWithSlots(std::string(input.substr(1)), {true, false});
  std::ostringstream o;
  try {
    if (task) {
      const in::PoolTask t = in::DecodePoolTask(std::move(msg));
      o << t.kind << " " << t.id << " fn(" << t.fn.kind << "," << t.fn.local_id << "," << t.fn.entry
        << "," << t.fn.runner_key << ") " << t.payload.bytes.size() << "+" << t.payload.fds.size();
    } else {
      in::PoolReply r = in::DecodePoolReply(std::move(msg));
      o << r.kind << " " << r.id << " " << r.payload.bytes.size() << "+" << r.payload.fds.size();
      if (r.kind == "init_failed" || r.kind == "error") {
        const mp::ChildFailure f = mp::DecodeAs<mp::ChildFailure>(r.payload);
        o << " " << f.type << ": " << f.message;
      }
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) __builtin_trap();
    return ErrorText(e);
  }
  return o.str();
}

}  // namespace

std::string Describe(std::string_view input) { return Run(input); }

std::vector<Seed> Seeds() {
  in::TaskFn local;
  local.kind = in::TaskFn::kLocal;
  local.local_id = 3;
  in::TaskFn entry;
  entry.kind = in::TaskFn::kEntry;
  entry.fn = 0x1234;
  entry.entry = "Square";
  entry.runner_key = "runner";
  return {
      {"task_local",
       ControlByteInput(0, std::string("task"), uint64_t{7}, local, mp::Encode(int64_t{5}).bytes),
       "task 7 fn(1,3,,) 8+2"},
      {"task_entry",
       ControlByteInput(0, std::string("task"), uint64_t{8}, entry, std::string("ab")),
       "task 8 fn(3,0,Square,runner) 2+2"},
      {"exit", ControlByteInput(0, std::string("exit"), uint64_t{0}, in::TaskFn(), std::string()),
       "exit 0 fn(0,0,,) 0+2"},
      {"reply_ready", ControlByteInput(1, std::string("ready"), uint64_t{4242}, std::string()),
       "ready 4242 0+2"},
      {"reply_done",
       ControlByteInput(1, std::string("done"), uint64_t{7}, mp::Encode(int64_t{25}).bytes),
       "done 7 8+2"},
      {"reply_error",
       ControlByteInput(1, std::string("error"), uint64_t{7},
                        mp::Encode(mp::ChildFailure{"std::logic_error", "bad", ""}).bytes),
       "error 7 43+2 std::logic_error: bad"},
  };
}

}  // namespace forksafe::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)forksafe::fuzz::Run(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
