#include "forksafe/runtime/internal/loaded_objects.h"

#include <elf.h>
#include <link.h>

#include <cstddef>
#include <cstring>

namespace forksafe::runtime::internal {

bool SegmentsHold(const dl_phdr_info& info, uintptr_t start, size_t size) {
  for (int i = 0; i < info.dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info.dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    const uintptr_t lo = info.dlpi_addr + ph.p_vaddr;  // wraps back into range with the bias
    if (start >= lo && start - lo <= ph.p_memsz && size <= ph.p_memsz - (start - lo)) {
      return true;
    }
  }
  return false;
}

struct LoadedObjectAccess {
  // Fills `o` from the object's PT_DYNAMIC segment; false when it has no dynamic symbols (or
  // its dynamic section points outside its own segments).
  static bool Fill(const dl_phdr_info& info, LoadedObject* o) {
    const ElfW(Phdr)* dynamic = nullptr;
    for (int i = 0; i < info.dlpi_phnum; ++i) {
      if (info.dlpi_phdr[i].p_type == PT_DYNAMIC) dynamic = &info.dlpi_phdr[i];
    }
    if (dynamic == nullptr) return false;
    const uintptr_t dyn_at = info.dlpi_addr + dynamic->p_vaddr;
    o->path_ = info.dlpi_name != nullptr ? info.dlpi_name : "";
    o->base_ = info.dlpi_addr;
    o->phdr_ = info.dlpi_phdr;
    o->phnum_ = info.dlpi_phnum;
    // An address of the dynamic section: relocated in place by glibc when the section is
    // writable and the bias is not 0, else still the link-time address (see the header). Read
    // the way that predicts, the other way when that lies in no segment; 0 when neither does.
    const bool relocated = info.dlpi_addr != 0 && (dynamic->p_flags & PF_W) != 0;
    auto at = [&](ElfW(Addr) p) -> uintptr_t {
      const uintptr_t as_is = p, from_bias = info.dlpi_addr + p;
      const uintptr_t first = relocated ? as_is : from_bias, second = relocated ? from_bias : as_is;
      if (SegmentsHold(info, first, 1)) return first;
      if (SegmentsHold(info, second, 1)) return second;
      return 0;
    };
    for (auto* dyn = reinterpret_cast<const ElfW(Dyn)*>(dyn_at);
         SegmentsHold(info, reinterpret_cast<uintptr_t>(dyn), sizeof *dyn) && dyn->d_tag != DT_NULL;
         ++dyn) {
      switch (dyn->d_tag) {
        case DT_SYMTAB: o->symtab_ = reinterpret_cast<const void*>(at(dyn->d_un.d_ptr)); break;
        case DT_STRTAB: o->strtab_ = reinterpret_cast<const char*>(at(dyn->d_un.d_ptr)); break;
        case DT_GNU_HASH:
          o->gnu_hash_ = reinterpret_cast<const uint32_t*>(at(dyn->d_un.d_ptr));
          break;
        case DT_HASH: o->sysv_hash_ = reinterpret_cast<const uint32_t*>(at(dyn->d_un.d_ptr)); break;
        case DT_VERSYM: o->versym_ = reinterpret_cast<const uint16_t*>(at(dyn->d_un.d_ptr)); break;
        case DT_FLAGS_1: o->no_delete_ = (dyn->d_un.d_val & DF_1_NODELETE) != 0; break;
        default: break;
      }
    }
    return o->symtab_ != nullptr && o->strtab_ != nullptr &&
           (o->gnu_hash_ != nullptr || o->sysv_hash_ != nullptr);
  }

  static bool Contains(const LoadedObject& o, uintptr_t address) {
    dl_phdr_info info{};
    info.dlpi_addr = o.base_;
    info.dlpi_phdr = static_cast<const ElfW(Phdr)*>(o.phdr_);
    info.dlpi_phnum = static_cast<ElfW(Half)>(o.phnum_);
    return SegmentsHold(info, address, 1);
  }
};

namespace {

// Whether symbol `index` is named `name`, defined here, a plain function or object, and the
// default version (a hidden version, bit 0x8000 of its versym entry, is an older alias).
const ElfW(Sym) * Match(const ElfW(Sym) * symtab, const char* strtab, const uint16_t* versym,
                        uint32_t index, const char* name) {
  const ElfW(Sym)& s = symtab[index];
  if (s.st_shndx == SHN_UNDEF || s.st_value == 0) return nullptr;
  const int type = ELF64_ST_TYPE(s.st_info);
  if (type != STT_FUNC && type != STT_OBJECT) return nullptr;  // not STT_GNU_IFUNC
  if (versym != nullptr && (versym[index] & 0x8000) != 0) return nullptr;
  if (std::strcmp(strtab + s.st_name, name) != 0) return nullptr;
  return &s;
}

}  // namespace

void* LoadedObject::Find(const char* symbol) const {
  const auto* symtab = static_cast<const ElfW(Sym)*>(symtab_);
  const ElfW(Sym)* found = nullptr;
  if (gnu_hash_ != nullptr) {
    uint32_t h = 5381;  // the GNU hash of the name (DJB's)
    for (const char* c = symbol; *c != '\0'; ++c) h = h * 33 + static_cast<unsigned char>(*c);
    const uint32_t nbuckets = gnu_hash_[0], symoffset = gnu_hash_[1];
    const uint32_t bloom_size = gnu_hash_[2], bloom_shift = gnu_hash_[3];
    if (nbuckets == 0 || bloom_size == 0) return nullptr;
    const auto* bloom = reinterpret_cast<const ElfW(Addr)*>(gnu_hash_ + 4);
    const uint32_t* buckets = reinterpret_cast<const uint32_t*>(bloom + bloom_size);
    const uint32_t* chain = buckets + nbuckets;
    constexpr uint32_t kBits = sizeof(ElfW(Addr)) * 8;
    const ElfW(Addr) word = bloom[(h / kBits) % bloom_size];
    const ElfW(Addr) mask =
        (ElfW(Addr){1} << (h % kBits)) | (ElfW(Addr){1} << ((h >> bloom_shift) % kBits));
    if ((word & mask) != mask) return nullptr;  // certainly not defined here
    uint32_t i = buckets[h % nbuckets];
    if (i < symoffset) return nullptr;
    for (;; ++i) {
      const uint32_t ch = chain[i - symoffset];
      if ((ch | 1) == (h | 1)) found = Match(symtab, strtab_, versym_, i, symbol);
      if (found != nullptr || (ch & 1) != 0) break;  // the low bit ends the bucket's chain
    }
  } else {
    uint32_t h = 0;  // the SysV ELF hash of the name
    for (const char* c = symbol; *c != '\0'; ++c) {
      h = (h << 4) + static_cast<unsigned char>(*c);
      const uint32_t g = h & 0xf0000000u;
      if (g != 0) h ^= g >> 24;
      h &= ~g;
    }
    const uint32_t nbucket = sysv_hash_[0];
    if (nbucket == 0) return nullptr;
    const uint32_t* bucket = sysv_hash_ + 2;
    const uint32_t* chain = bucket + nbucket;
    for (uint32_t i = bucket[h % nbucket]; i != STN_UNDEF && found == nullptr; i = chain[i]) {
      found = Match(symtab, strtab_, versym_, i, symbol);
    }
  }
  if (found == nullptr) return nullptr;
  const uintptr_t address = base_ + found->st_value;  // wraps back into range with the bias
  return LoadedObjectAccess::Contains(*this, address) ? reinterpret_cast<void*>(address) : nullptr;
}

bool LoadedObject::Contains(const void* address) const {
  return LoadedObjectAccess::Contains(*this, reinterpret_cast<uintptr_t>(address));
}

namespace {

struct Walk {
  bool (*visit)(const LoadedObject&, void*);
  void* context;
};

int VisitOne(dl_phdr_info* info, size_t, void* data) {
  auto* walk = static_cast<Walk*>(data);
  LoadedObject o;
  if (!LoadedObjectAccess::Fill(*info, &o)) return 0;
  return walk->visit(o, walk->context) ? 0 : 1;
}

int ReadStamp(dl_phdr_info* info, size_t size, void* data) {
  auto* stamp = static_cast<uint64_t*>(data);
  if (size >= offsetof(dl_phdr_info, dlpi_subs) + sizeof(info->dlpi_subs)) {
    *stamp = info->dlpi_adds + info->dlpi_subs;  // each only grows: the sum changes with either
  }
  return 1;  // the first object carries the counters: stop there
}

}  // namespace

void ForEachLoadedObject(bool (*visit)(const LoadedObject& object, void* context), void* context) {
  Walk walk{visit, context};
  dl_iterate_phdr(VisitOne, &walk);
}

uint64_t LoadedObjectsStamp() {
  uint64_t stamp = 0;
  dl_iterate_phdr(ReadStamp, &stamp);
  return stamp;
}

}  // namespace forksafe::runtime::internal
