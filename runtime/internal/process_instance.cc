#include "forksafe/runtime/internal/process_instance.h"

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>

#include "forksafe/runtime/internal/loaded_objects.h"
#include "forksafe/version.h"

extern "C" {
// This copy's table. Defined hidden, so that this copy's own code always reaches its own table (a
// reference through the exported name could bind to another copy's: ELF interposition), and
// exported under the public name by the alias below.
__attribute__((visibility("hidden"), used))
forksafe_instance_v1 forksafe_process_instance_v1_self = {
    FORKSAFE_INSTANCE_MAGIC,
    FORKSAFE_INSTANCE_ABI,
    sizeof(forksafe_instance_v1),
    FORKSAFE_VERSION_STRING,
    FORKSAFE_ROLE_UNDECIDED,
    "",
    &forksafe::runtime::internal::NestInThisCopy,
    &forksafe::runtime::internal::ReportEventFromNestedCopy,
};
extern forksafe_instance_v1 forksafe_process_instance_v1
    __attribute__((alias("forksafe_process_instance_v1_self"), visibility("default")));
}  // extern "C"

// The table's place, also published in an ELF note (found through the object's PT_NOTE program
// header, which no version script can hide): name "forksafe", type FORKSAFE_INSTANCE_NOTE_TYPE,
// and as descriptor the table's address minus the descriptor's own, resolved when the object is
// linked (the table is hidden: no dynamic relocation). The linker never discards a note section.
#define FORKSAFE_STR2(x) #x
#define FORKSAFE_STR(x) FORKSAFE_STR2(x)
asm(".pushsection .note.forksafe,\"a\",@note\n"
    ".balign 4\n"
    ".long 9\n"  // n_namesz: "forksafe" and its NUL
    ".long 8\n"  // n_descsz
    ".long " FORKSAFE_STR(FORKSAFE_INSTANCE_NOTE_TYPE) "\n"
    ".asciz \"forksafe\"\n"
    ".balign 4\n"
    ".quad forksafe_process_instance_v1_self - .\n"
    ".popsection\n");

namespace forksafe::runtime::internal {
namespace {

char g_object[PATH_MAX] = "";  // the file of the object holding this copy
const forksafe_instance_v1* g_primary = nullptr;
const char* g_refuse_nesting_for_test = nullptr;

// The link map of the object that holds `address` (nullptr when it cannot be told).
link_map* ObjectHolding(const void* address) {
  Dl_info info{};
  link_map* map = nullptr;
  if (dladdr1(address, &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) == 0) {
    return nullptr;
  }
  return map;
}

// This copy's object: its link map (nullptr when it cannot be told).
link_map* ThisObject() { return ObjectHolding(reinterpret_cast<const void*>(&ThisObject)); }

void FindThisObjectsFile() {
  link_map* map = ThisObject();
  if (map != nullptr && map->l_name != nullptr && map->l_name[0] != '\0') {
    strncpy(g_object, map->l_name, sizeof(g_object) - 1);
    return;
  }
  // The program itself (its link map has an empty name).
  const ssize_t n = readlink("/proc/self/exe", g_object, sizeof(g_object) - 1);
  g_object[n > 0 ? n : 0] = '\0';
}

// A table of another copy that this copy can nest in: same magic and ABI, elected primary.
const forksafe_instance_v1* Primary(const void* symbol, const forksafe_instance_v1* self) {
  const auto* t = static_cast<const forksafe_instance_v1*>(symbol);
  if (t == nullptr || t == self) return nullptr;
  if (t->magic != FORKSAFE_INSTANCE_MAGIC || t->abi_version != FORKSAFE_INSTANCE_ABI ||
      t->struct_size < sizeof(forksafe_instance_v1)) {
    return nullptr;
  }
  if (__atomic_load_n(&t->role, __ATOMIC_ACQUIRE) != FORKSAFE_ROLE_PRIMARY) return nullptr;
  return t;
}

struct Election {
  forksafe_instance_v1* self;
  const forksafe_instance_v1* primary;
  bool done;
};

// For each loaded object (load order): its table, if it exports one that this copy can nest in.
bool LookForPrimary(const LoadedObject& object, void* context) {
  auto* e = static_cast<Election*>(context);
  e->primary = Primary(object.Find("forksafe_process_instance_v1"), e->self);
  return e->primary == nullptr;  // go on until one is found
}

// For each loaded object (load order): the tables its notes point at (copies whose symbol is
// hidden), until one this copy can nest in is found. Runs under dl_load_write_lock as well.
int LookForPrimaryInNotes(dl_phdr_info* info, size_t, void* context) {
  auto* e = static_cast<Election*>(context);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_NOTE) continue;
    const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (!SegmentsHold(*info, start, ph.p_memsz)) continue;
    const size_t align = ph.p_align == 8 ? 8 : 4;
    auto up = [align](size_t n) { return (n + align - 1) & ~(align - 1); };
    for (uintptr_t at = start; at + sizeof(ElfW(Nhdr)) <= start + ph.p_memsz;) {
      ElfW(Nhdr) n;
      memcpy(&n, reinterpret_cast<const void*>(at), sizeof n);
      const uintptr_t name = at + sizeof n;
      const uintptr_t desc = name + up(n.n_namesz);
      const uintptr_t next = desc + up(n.n_descsz);
      if (next > start + ph.p_memsz || next <= at) break;
      if (n.n_type == FORKSAFE_INSTANCE_NOTE_TYPE && n.n_namesz == 9 && n.n_descsz == 8 &&
          memcmp(reinterpret_cast<const void*>(name), "forksafe", 9) == 0) {
        int64_t offset = 0;
        memcpy(&offset, reinterpret_cast<const void*>(desc), sizeof offset);
        const uintptr_t table = desc + static_cast<uintptr_t>(offset);
        if (SegmentsHold(*info, table, sizeof(forksafe_instance_v1))) {
          e->primary = Primary(reinterpret_cast<const void*>(table), e->self);
          if (e->primary != nullptr) return 1;  // stop the walk
        }
      }
      at = next;
    }
  }
  return 0;
}

// Runs once, as the callback of an outer dl_iterate_phdr: glibc's dl_load_write_lock (recursive,
// process-wide) is held from the lookup to the role's store, so no other copy's election can
// run in between. Allocates nothing, calls nothing that loads or unwinds.
int ElectUnderLoaderWriteLock(dl_phdr_info*, size_t, void* context) {
  auto* e = static_cast<Election*>(context);
  ForEachLoadedObject(&LookForPrimary, e);
  if (e->primary == nullptr) dl_iterate_phdr(&LookForPrimaryInNotes, e);  // hidden symbols
  __atomic_store_n(&e->self->role,
                   e->primary != nullptr ? FORKSAFE_ROLE_NESTED : FORKSAFE_ROLE_PRIMARY,
                   __ATOMIC_RELEASE);
  e->done = true;
  return 1;  // one call is enough
}

}  // namespace

forksafe_instance_v1& ThisInstance() { return forksafe_process_instance_v1_self; }

const forksafe_instance_v1* ElectProcessInstance() {
  static const forksafe_instance_v1* const primary = [] {
    forksafe_instance_v1& self = ThisInstance();
    FindThisObjectsFile();  // dladdr takes the loader's main lock: before the walk
    self.object = g_object;
    Election e{&self, nullptr, false};
    dl_iterate_phdr(&ElectUnderLoaderWriteLock, &e);
    if (!e.done) ElectUnderLoaderWriteLock(nullptr, 0, &e);  // no object listed: cannot happen
    g_primary = e.primary;
    return e.primary;
  }();
  return primary;
}

void MarkSeparate() {
  g_primary = nullptr;
  __atomic_store_n(&ThisInstance().role, FORKSAFE_ROLE_SEPARATE, __ATOMIC_RELEASE);
}

const forksafe_instance_v1* PrimaryInstance() { return g_primary; }

bool PinThisCopy() {
  // Called at load time (the nested copy's constructor) or from a nested copy's `nest`, which
  // runs in that copy's constructor: the dynamic loader serializes those for dlopen'ed objects,
  // and the primary's slots are claimed atomically; the flag only saves a second dlopen.
  static std::atomic<int> pinned{0};  // 0 not yet, 1 pinned, 2 failed
  int state = pinned.load(std::memory_order_acquire);
  if (state != 0) return state == 1;
  link_map* map = ThisObject();
  bool ok = false;
  if (map == nullptr) {
    ok = false;  // its object cannot be told: cannot be pinned
  } else if (map->l_name == nullptr || map->l_name[0] == '\0') {
    ok = true;  // the program: never unloaded
  } else {
    // Our own object, whose constructors have started: glibc runs none here (see the header).
    void* handle = dlopen(map->l_name, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
    ok = handle != nullptr;
    if (handle != nullptr) dlclose(handle);  // the object stays: RTLD_NODELETE sticks to it
  }
  pinned.store(ok ? 1 : 2, std::memory_order_release);
  return ok;
}

void RefuseNestingForTest(const char* reason) {
  __atomic_store_n(&g_refuse_nesting_for_test, reason, __ATOMIC_RELEASE);
}
const char* NestingRefusedForTest() {
  return __atomic_load_n(&g_refuse_nesting_for_test, __ATOMIC_ACQUIRE);
}

namespace {

// A shared object that links forksafe statically with default visibility, loaded where another
// copy's C++ symbols are in the global scope, calls that copy's AtForkRegistry::Get() (and the
// rest) through its PLT: it never elects and runs a mix of both copies' code. Say so, once, at
// load time; there is no caller to throw to. Hidden, so that it is this copy's own check.
__attribute__((constructor, visibility("hidden"))) void CheckThisCopyIsNotInterposed() {
  const forksafe_instance_v1* reached = InterposableCopyIdentity();  // through the PLT
  if (reached == &ThisInstance()) return;
  link_map* there = ObjectHolding(reached);
  FindThisObjectsFile();
  const char* other = there == nullptr                                       ? "another object"
                      : there->l_name != nullptr && there->l_name[0] != '\0' ? there->l_name
                                                                             : "the program";
  fprintf(stderr,
          "forksafe: the copy of forksafe linked into %s calls the forksafe functions of %s "
          "(ELF symbol interposition: that copy's C++ symbols are in the process's global "
          "scope), so the two copies share neither one registry nor separate ones and their fork "
          "handling is undefined. Link %s against libforksafe.so instead of a static copy, or "
          "build its copy with -fvisibility=hidden or link it with -Wl,-Bsymbolic-functions; see "
          "forksafe/runtime/at_fork.h, \"One registry per process\"\n",
          g_object, other, g_object);
}

}  // namespace

}  // namespace forksafe::runtime::internal
