// mp/internal/shm_manager.h: NOT FOR USERS. The manager daemon of the file_system strategy.
//
// A process that creates named shared segments ("/forksafe_<pid>_<random>") starts, on first use,
// a manager: this same executable, spawned with --forksafe-shm-manager (InitMain runs it), talking
// over an inherited socketpair that no other process can reach. The creator tells it each name it
// creates. When the creator exits or is killed (the socket reaches end-of-file), the manager
// removes each segment of it once the lifetime rule below says it is dead: its shared count is
// zero, or every reference left is in flight in queues that no process holds, or no process maps
// it and no queue that a process holds has a message referring to it (judged from a scan of
// /proc taken after a snapshot of the segment's counts, ScanProc and RefSnapshot below); then it
// exits. On start, a manager also sweeps segments whose creator is dead and that nobody maps,
// by the same rule: what a killed manager (or a crash before the manager started) left behind in
// an earlier run. The manager does nothing, the
// sweep included, before its creator presented the secret it handed the manager on a private pipe
// (mp/internal/server_auth.h, which also states the threat model); a connection without it is
// closed unread and the manager exits. Names carry 128 bits from getrandom(). The creator's pid is
// only meaningful in its own pid namespace, and /dev/shm is often shared by several (containers,
// the sandboxes of a test runner): the sweep removes only segments whose header says they were
// made in the sweeper's pid namespace, and leaves every other entry alone.
//
// Lifetime rule of a named segment (what keeps it, what frees it):
//   - A cached segment (many blocks) lives while its creator lives (the creator's arena reuses
//     its blocks), and after that while any reference to one of its blocks can still be used: a
//     process maps it, or a message that refers to it sits unread in a Queue that some process
//     still holds (an in-flight reference, counted in the segment header's carrier table under
//     the queue's identity, see SegmentHeader). A tensor in a queue is a reference like any other.
//   - A dedicated segment (one block: over 16 MiB, or the cache off; kSegmentDedicated) lives
//     while any reference to its block can be used, whether its creator lives or not: whichever
//     process drops its count to zero unlinks it at once (the creator, a reader, in any order).
//   - A segment is unlinked when its count of references reaches zero (a cached one: by its
//     creator when it gives its cache back, or by the manager after the creator's death), or when
//     the only references left are dead ones: held by processes that died (nobody maps it) or in
//     flight in queues that no process holds any more (messages never read). The creator does
//     this for its own segments, dedicated ones included (SharedArena::EmptyCache), the manager
//     after the creator's death, and the sweep for what a killed manager left.
//   - The name is told to the manager BEFORE the segment is created, so a creator SIGKILLed at
//     any moment while creating it (even before its manager started) leaves nothing behind.
//   Messages on a Pipe or passed as Process arguments carry no carrier: their references count,
//   but once the creator is dead only a mapping keeps such a segment (see docs/reliability.md).
//
// Hazard: "a process holds the queue" is what /proc shows: a process that maps the queue's ring
// (a memfd "forksafe:queue") or has a descriptor of it (/proc/<pid>/fd). A queue that exists at
// that moment only in transit (inside a message on a Pipe or in another Queue, not yet received,
// with no process keeping a handle of its own) is invisible, so the segments that only its
// unread messages reference count as dead and are freed: keep a handle of a queue while sending
// it. A process of this user whose /proc entries cannot be read makes the scan incomplete, and
// nothing is judged dead from it (processes of other users are not looked at).

#ifndef FORKSAFE_MP_INTERNAL_SHM_MANAGER_H_
#define FORKSAFE_MP_INTERNAL_SHM_MANAGER_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <set>
#include <string>

#include "forksafe/mp/codec.h"

namespace forksafe::mp::internal {

inline constexpr const char* kShmManagerFlag = "--forksafe-shm-manager";

/// A queue that holds in-flight references to a segment's blocks, and how many, in one word so
/// that processes update it with compare-and-swap alone (nothing to wedge when one dies): the
/// carrier's identity (a queue segment's inode, CarrierKey()) in the high 40 bits, the count in
/// the low 24. A slot whose count is 0 is free.
using InFlightCarrier = std::atomic<uint64_t>;
inline constexpr uint64_t CarrierKey(uint64_t id) { return id & ((uint64_t{1} << 40) - 1); }
inline constexpr int kMaxCarriers = 64;
inline constexpr uint64_t kSegmentMagic = 0x66736172656e6131ull;  // "fsarena1"
/// SegmentHeader::flags: the segment holds one block and is never reused by its creator, so
/// whichever process drops its count to zero unlinks its name (mp/internal/shared_arena.h).
inline constexpr uint32_t kSegmentDedicated = 1;

/// The start of every arena segment (file_descriptor and file_system alike), in its first page.
/// The first 40 bytes are read by tools and tests: keep their layout.
struct SegmentHeader {
  uint64_t magic;
  uint64_t size;
  uint64_t id;
  int32_t creator;
  std::atomic<int32_t> live_refs;  // sum of the blocks' counts, in-flight references included
  uint64_t pid_ns;                 // the creator's pid namespace (PidNamespaceId(), for the sweep)
  std::atomic<int32_t> carrier_overflow;   // in-flight references whose carrier found no slot
  uint32_t flags;                          // kSegmentDedicated
  InFlightCarrier carriers[kMaxCarriers];  // in-flight references by the queue that holds them
  // The creator's start time (ProcessStartTicks); 0: unknown (a segment of an older forksafe).
  // A scan of /proc judges the segment only if every unreadable process is older (ScanJudges).
  uint64_t creator_start;
};
static_assert(sizeof(SegmentHeader) <= 4096, "the segment header fits in its first page");

/// Counts one in-flight reference to a block of `h` held by carrier `carrier` (0: none).
void AddCarrierRef(SegmentHeader* h, uint64_t carrier);
/// Gives one back (an import adopted it, or the message was never sent). Never goes below 0.
void DropCarrierRef(SegmentHeader* h, uint64_t carrier);

/// What one pass over /proc found: the /dev/shm names ("forksafe_...") that some process maps,
/// and the carriers (queues) that some process holds, by mapping the queue's memfd or by a
/// descriptor of it. A process of this user whose entries cannot be read (not dumpable: PID 1 of
/// many containers and VMs, setuid programs, PR_SET_DUMPABLE 0) holds what nobody can know:
/// `newest_unreadable` is the start time of the newest such process (0: none), and `complete` is
/// false when one's start time is unknown too. Zombies hold nothing and are not counted.
struct ProcScan {
  std::set<std::string> mapped_names;
  std::set<uint64_t> live_carriers;
  uint64_t newest_unreadable = 0;
  bool complete = true;
};
/// Scans /proc (see ProcScan).
ProcScan ScanProc();
/// Whether `scan` may judge a segment whose creator started at `creator_start`
/// (SegmentHeader::creator_start): it is complete, and every unreadable process of this user is
/// older than the creator. One older than a segment's creator is taken to hold none of its
/// segments (it could hold one only by receiving a handle, and still unmapped: a mapping outlives
/// the name). Judged per segment, from the creator's own start time written at creation: before,
/// the manager took its parent's start time, which was PID 1's when the creator died before the
/// manager looked, and a sweep took none, so one unreadable process anywhere on the machine (PID 1
/// of this VM, for root) kept every dead creator's segments, and their managers, for good.
bool ScanJudges(const ProcScan& scan, uint64_t creator_start);
/// Process `pid`'s start time in clock ticks since boot (/proc/<pid>/stat); 0 when unknown.
uint64_t ProcessStartTicks(pid_t pid);
/// This process's start time (ProcessStartTicks(getpid()), read once per process).
uint64_t SelfStartTicks();

/// A copy of a segment header's counts. Judging a segment from a scan of /proc needs a snapshot
/// taken BEFORE the scan: a reader that adopts its reference (taking it off its carrier) maps the
/// segment first, so it shows in the scan or in the snapshot's carriers, never in neither.
struct RefSnapshot {
  int32_t live_refs = 0;
  int32_t overflow = 0;
  uint64_t carriers[kMaxCarriers] = {};
};
RefSnapshot SnapshotRefs(const SegmentHeader* h);

/// Whether a reference to the segment may still be used although no process maps it: the
/// snapshot has an in-flight reference in a queue that is still held (listed in `live`).
/// References whose carrier is unknown (a Pipe, a Process argument, no free slot) do not count.
bool HeldInFlight(const RefSnapshot& before, const std::set<uint64_t>& live);

/// Whether every reference counted in `h` NOW is one the snapshot found in flight in a dead
/// carrier (not in `live`, a scan taken after the snapshot): the segment can go although its
/// count is not zero (messages never read). Such references are frozen: nobody can get from, or
/// put into, a queue that no process holds.
bool OnlyDeadCarriersHold(const SegmentHeader* h, const RefSnapshot& before,
                          const std::set<uint64_t>& live);

/// The manager program installed with the library: tools/install.sh puts it in
/// <libdir>/forksafe/, the Python package beside its libforksafe.so.0 (mp/shm_manager_main.cc).
inline constexpr const char* kShmManagerProgram = "forksafe-shm-manager";

/// Which program this process starts as its shm manager, in this order:
///   1. $FORKSAFE_SHM_MANAGER, when set and not empty: that executable;
///   2. this program, when it called InitMain (returned as ""): /proc/self/exe serves the flag;
///   3. forksafe-shm-manager beside the file that holds this code (libforksafe.so's folder or its
///      forksafe/ subfolder; the program's own folder when forksafe is linked into it).
/// nullopt when there is none; `*why_none` then says why and what to do. A Python interpreter
/// (or a C++ program that skipped InitMain) must never be spawned with the flag: it would take
/// it for an option of its own, or run its main() again.
std::optional<std::string> ShmManagerExecutable(std::string* why_none);

/// Tells this process's manager (started on first use) about a new named segment.
/// Never throws: without a manager (none found, or it could not start or died), the creator
/// still unlinks its segments when it frees them; the first failure is reported on stderr once,
/// and no manager is tried again in this process.
void ShmManagerTrack(const std::string& name);

/// The manager's pid (0 when none was started by this process).
pid_t ShmManagerPid();

/// Removes segments of dead creators of this pid namespace that no process maps. Returns how many
/// were removed.
int SweepOrphanedSegments();

/// An identity of this process's pid namespace (the inode of /proc/self/ns/pid; 0 if unknown).
/// Segments record their creator's, so that a sweep in another namespace leaves them alone.
uint64_t PidNamespaceId();

/// Decodes a message from the creator, Encode(kind, name): the segment name to remember for a
/// well-formed "track" request ("forksafe_..." without '/' or NUL, at most 255 bytes), nullopt
/// for anything else it must ignore. Error(kInvalidArgument) for a malformed message.
std::optional<std::string> DecodeTrackRequest(Message& msg);

/// The manager's main loop on descriptor `fd` (never returns).
[[noreturn]] void RunShmManager(int fd);

}  // namespace forksafe::mp::internal

#endif  // FORKSAFE_MP_INTERNAL_SHM_MANAGER_H_
