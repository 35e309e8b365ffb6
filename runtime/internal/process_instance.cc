#include "forksafe/runtime/internal/process_instance.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/auxv.h>
#include <unistd.h>

#include <climits>
#include <cstring>

#include "forksafe/version.h"

extern "C" {
// This copy's table. Defined hidden, so that this copy's own code always reaches its own table (a
// reference through the exported name could bind to another copy's: ELF interposition), and
// exported under the public name by the alias below.
__attribute__((visibility("hidden"), used)) forksafe_instance_v1 forksafe_process_instance_v1_self = {
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

namespace forksafe::runtime::internal {
namespace {

char g_object[PATH_MAX] = "";  // the file of the object holding this copy
const forksafe_instance_v1* g_primary = nullptr;

// This copy's object: its link map (nullptr when it cannot be told).
link_map* ThisObject() {
  Dl_info info{};
  link_map* map = nullptr;
  if (dladdr1(reinterpret_cast<void*>(&ThisObject), &info, reinterpret_cast<void**>(&map),
              RTLD_DL_LINKMAP) == 0) {
    return nullptr;
  }
  return map;
}

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

struct Search {
  const forksafe_instance_v1* self;
  uintptr_t vdso;  // the vDSO's ELF header (0 if none): it has no symbols to look up
  bool first;      // the first object dl_iterate_phdr visits is the program
  const forksafe_instance_v1* primary;
};

bool Contains(const dl_phdr_info* info, uintptr_t address) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (address >= start && address < start + ph.p_memsz) return true;
  }
  return false;
}

// A table of another copy that this copy can nest in: same magic and ABI, elected primary.
const forksafe_instance_v1* Primary(void* symbol, const forksafe_instance_v1* self) {
  const auto* t = static_cast<const forksafe_instance_v1*>(symbol);
  if (t == nullptr || t == self) return nullptr;
  if (t->magic != FORKSAFE_INSTANCE_MAGIC || t->abi_version != FORKSAFE_INSTANCE_ABI ||
      t->struct_size < sizeof(forksafe_instance_v1)) {
    return nullptr;
  }
  if (__atomic_load_n(&t->role, __ATOMIC_ACQUIRE) != FORKSAFE_ROLE_PRIMARY) return nullptr;
  return t;
}

// An address of the dynamic section: glibc has already relocated most of them in place (then
// they lie past the object's base), but not in every object (the vDSO, some architectures).
uintptr_t DynamicAddress(const dl_phdr_info* info, ElfW(Addr) value) {
  return value < info->dlpi_addr ? info->dlpi_addr + value : value;
}

uint32_t GnuHash(const char* name) {
  uint32_t h = 5381;
  for (const unsigned char* c = reinterpret_cast<const unsigned char*>(name); *c != 0; ++c) {
    h = h * 33 + *c;
  }
  return h;
}

uint32_t SysvHash(const char* name) {
  uint32_t h = 0;
  for (const unsigned char* c = reinterpret_cast<const unsigned char*>(name); *c != 0; ++c) {
    h = (h << 4) + *c;
    const uint32_t g = h & 0xf0000000u;
    if (g != 0) h ^= g >> 24;
    h &= ~g;
  }
  return h;
}

// The address of the data symbol `name` that the object defines and exports, from its dynamic
// symbol table (its hash table: DT_GNU_HASH, else DT_HASH); 0 when it has none. Read straight
// from memory, not through dlopen/dlsym: at program start-up a dlopen(RTLD_NOLOAD) made from a
// constructor runs the constructors of objects not initialized yet, out of order.
uintptr_t FindDefinedSymbol(const dl_phdr_info* info, const char* name) {
  const ElfW(Dyn)* dyn = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
      dyn = reinterpret_cast<const ElfW(Dyn)*>(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    }
  }
  if (dyn == nullptr) return 0;
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  const uint32_t* gnu_hash = nullptr;
  const uint32_t* sysv_hash = nullptr;
  for (; dyn->d_tag != DT_NULL; ++dyn) {
    const uintptr_t at = DynamicAddress(info, dyn->d_un.d_ptr);
    switch (dyn->d_tag) {
      case DT_SYMTAB: symtab = reinterpret_cast<const ElfW(Sym)*>(at); break;
      case DT_STRTAB: strtab = reinterpret_cast<const char*>(at); break;
      case DT_GNU_HASH: gnu_hash = reinterpret_cast<const uint32_t*>(at); break;
      case DT_HASH: sysv_hash = reinterpret_cast<const uint32_t*>(at); break;
      default: break;
    }
  }
  if (symtab == nullptr || strtab == nullptr) return 0;
  auto match = [&](uint32_t index) -> uintptr_t {
    const ElfW(Sym)& sym = symtab[index];
    if (sym.st_shndx == SHN_UNDEF || (sym.st_info & 0xf) != STT_OBJECT ||
        strcmp(strtab + sym.st_name, name) != 0) {
      return 0;
    }
    return info->dlpi_addr + sym.st_value;
  };
  if (gnu_hash != nullptr) {
    const uint32_t nbuckets = gnu_hash[0], symoffset = gnu_hash[1], bloom_words = gnu_hash[2];
    if (nbuckets == 0) return 0;
    const auto* buckets = reinterpret_cast<const uint32_t*>(
        reinterpret_cast<const ElfW(Addr)*>(gnu_hash + 4) + bloom_words);
    const uint32_t* chain = buckets + nbuckets;
    const uint32_t h = GnuHash(name);
    for (uint32_t i = buckets[h % nbuckets]; i >= symoffset && i != 0; ++i) {
      const uint32_t link = chain[i - symoffset];
      if ((link | 1) == (h | 1)) {
        if (const uintptr_t found = match(i)) return found;
      }
      if ((link & 1) != 0) break;  // the end of this bucket's chain
    }
    return 0;
  }
  if (sysv_hash != nullptr) {
    const uint32_t nbucket = sysv_hash[0];
    if (nbucket == 0) return 0;
    const uint32_t* bucket = sysv_hash + 2;
    const uint32_t* chain = bucket + nbucket;
    for (uint32_t i = bucket[SysvHash(name) % nbucket]; i != STN_UNDEF; i = chain[i]) {
      if (const uintptr_t found = match(i)) return found;
    }
  }
  return 0;
}

// For each loaded object (the program first): its table, if it exports one that this copy can
// nest in.
int Visit(dl_phdr_info* info, size_t, void* data) {
  auto* s = static_cast<Search*>(data);
  const bool program = s->first;
  s->first = false;
  const char* name = info->dlpi_name;
  if (!program && (name == nullptr || name[0] == '\0')) return 0;
  if (s->vdso != 0 && Contains(info, s->vdso)) return 0;
  const uintptr_t table = FindDefinedSymbol(info, "forksafe_process_instance_v1");
  s->primary = Primary(reinterpret_cast<void*>(table), s->self);
  return s->primary != nullptr ? 1 : 0;  // nonzero stops the walk
}

}  // namespace

forksafe_instance_v1& ThisInstance() { return forksafe_process_instance_v1_self; }

const forksafe_instance_v1* ElectProcessInstance() {
  static const forksafe_instance_v1* const primary = [] {
    forksafe_instance_v1& self = ThisInstance();
    FindThisObjectsFile();
    self.object = g_object;
    Search s{&self, static_cast<uintptr_t>(getauxval(AT_SYSINFO_EHDR)), true, nullptr};
    dl_iterate_phdr(&Visit, &s);
    g_primary = s.primary;
    __atomic_store_n(&self.role, s.primary != nullptr ? FORKSAFE_ROLE_NESTED : FORKSAFE_ROLE_PRIMARY,
                     __ATOMIC_RELEASE);
    return s.primary;
  }();
  return primary;
}

void MarkSeparate() {
  g_primary = nullptr;
  __atomic_store_n(&ThisInstance().role, FORKSAFE_ROLE_SEPARATE, __ATOMIC_RELEASE);
}

const forksafe_instance_v1* PrimaryInstance() { return g_primary; }

void PinThisCopy() {
  static bool pinned = false;  // only called at load time, under the loader's lock
  if (pinned) return;
  pinned = true;
  link_map* map = ThisObject();
  if (map == nullptr || map->l_name == nullptr || map->l_name[0] == '\0') return;  // the program
  void* handle = dlopen(map->l_name, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
  if (handle != nullptr) dlclose(handle);  // the object stays: RTLD_NODELETE sticks to it
}

}  // namespace forksafe::runtime::internal
