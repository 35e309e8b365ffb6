// runtime/internal/loaded_objects.h: NOT FOR USERS. Finds symbols that the objects loaded in
// this process (the program, its shared libraries, and those dlopen'ed later, RTLD_LOCAL ones
// included) define, without the dynamic loader's main lock.
//
// What it offers
//   ForEachLoadedObject walks the loaded objects with dl_iterate_phdr and hands each to a
//   visitor as a LoadedObject, whose Find() looks a symbol up in that object's own dynamic symbol
//   table (GNU or SysV hash), the way the loader would for a symbol the object defines.
//   LoadedObjectsStamp() tells whether objects were loaded or unloaded since a previous call, so
//   that a caller can keep what it found. LoadedObject::Contains() tells whether an address lies
//   in the object (in one of its PT_LOAD segments), and SegmentsHold() does the same for a
//   dl_iterate_phdr caller of its own.
//
// Why not dlsym (the reason this exists)
//   glibc's dlsym and dlopen take the loader's lock (dl_load_lock), which dlopen holds while it
//   runs the constructors of what it loads. A constructor that registers an at-fork handler waits
//   while another thread's fork is being prepared (runtime/at_fork.h), so a prepare callback that
//   called dlsym or dlopen(RTLD_NOLOAD) would wait for that constructor, which waits for the
//   prepare: a deadlock. dl_iterate_phdr takes only dl_load_write_lock, which the loader holds
//   for an instant while it adds or removes an object, never while it runs a constructor.
//
// Guarantees
//   - No allocation, no lock other than dl_iterate_phdr's; usable in a fork's prepare callback.
//   - Find() returns the default version of a function or object the object defines (never an
//     undefined import, never a GNU indirect function, never a hidden older version).
//   - Where an object's memory is, is told by its PT_LOAD segments only (dlpi_addr + p_vaddr ..
//     + p_memsz), never by comparing with dlpi_addr: dlpi_addr is the load bias (where the
//     object is minus where it was linked to be), not the start of its mappings. A non-PIE
//     program has bias 0; an object linked at a non-zero address (prelinked, or -Ttext-segment)
//     and loaded elsewhere has a bias that wraps around (0xc000...). The same rule reads the
//     dynamic section's addresses, which glibc relocates in place when that section is writable
//     and the bias is not 0, and not in a read-only one (the vDSO; C libraries that never
//     relocate it): an address is read the way that rule predicts (as it is, or as an offset
//     from the bias), the other way when that one lies in no segment, and when neither lies in
//     one the object shows no symbols: nothing outside its segments is ever read.
//
// Hazards
//   - The visitor runs with dl_load_write_lock held: it must not call anything that may load,
//     unload or unwind (a C++ exception's unwinder may walk the objects too), and must not wait
//     for another thread. Copy the addresses out, and call the functions after the walk.
//   - An address found stays valid only while its object stays loaded: a thread that dlclose()s
//     that object meanwhile invalidates it.
//   - A program linked statically (no dynamic symbol table) shows no symbols.
#ifndef FORKSAFE_RUNTIME_INTERNAL_LOADED_OBJECTS_H_
#define FORKSAFE_RUNTIME_INTERNAL_LOADED_OBJECTS_H_

#include <link.h>

#include <cstddef>
#include <cstdint>

namespace forksafe::runtime::internal {

/// One loaded object, as seen during ForEachLoadedObject.
class LoadedObject {
 public:
  /// The path it was loaded from ("" for the program itself).
  const char* path() const { return path_; }
  /// The address of `symbol` when this object defines it (default version), else nullptr.
  void* Find(const char* symbol) const;
  /// Whether `address` lies in one of the object's loaded (PT_LOAD) segments.
  bool Contains(const void* address) const;
  /// Whether the object was linked with -z nodelete (DF_1_NODELETE): dlclose never unmaps it,
  /// so its code stays callable after the walk that found it.
  bool no_delete() const { return no_delete_; }

 private:
  friend struct LoadedObjectAccess;
  const char* path_ = "";
  uintptr_t base_ = 0;          // the load bias (dlpi_addr)
  const void* phdr_ = nullptr;  // ElfW(Phdr)[phnum_]
  int phnum_ = 0;
  const void* symtab_ = nullptr;  // ElfW(Sym)[]
  const char* strtab_ = nullptr;
  const uint32_t* gnu_hash_ = nullptr;
  const uint32_t* sysv_hash_ = nullptr;
  const uint16_t* versym_ = nullptr;
  bool no_delete_ = false;
};

/// Calls `visit(object, context)` for each loaded object, in load order, until it returns
/// false. See the hazards above for what `visit` may do.
void ForEachLoadedObject(bool (*visit)(const LoadedObject& object, void* context), void* context);

/// Whether [start, start + size) lies inside one PT_LOAD segment of `info`'s object (for a
/// dl_iterate_phdr callback of its own; the same test as LoadedObject::Contains).
bool SegmentsHold(const dl_phdr_info& info, uintptr_t start, size_t size);

/// A number that changes whenever an object is loaded or unloaded (glibc's dlpi_adds plus
/// dlpi_subs), or 0 when the C library does not say (then assume that anything changed). Reads
/// it with one short dl_iterate_phdr call.
uint64_t LoadedObjectsStamp();

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_LOADED_OBJECTS_H_
