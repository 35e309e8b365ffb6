// runtime/internal/loaded_objects.h: NOT FOR USERS. Finds symbols that the objects loaded in
// this process (the program, its shared libraries, and those dlopen'ed later, RTLD_LOCAL ones
// included) define, without the dynamic loader's main lock.
//
// What it offers
//   ForEachLoadedObject walks the loaded objects with dl_iterate_phdr and hands each to a
//   visitor as a LoadedObject, whose Find() looks a symbol up in that object's own dynamic symbol
//   table (GNU or SysV hash), the way the loader would for a symbol the object defines.
//   LoadedObjectsStamp() tells whether objects were loaded or unloaded since a previous call, so
//   that a caller can keep what it found.
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

#include <cstdint>

namespace forksafe::runtime::internal {

/// One loaded object, as seen during ForEachLoadedObject.
class LoadedObject {
 public:
  /// The path it was loaded from ("" for the program itself).
  const char* path() const { return path_; }
  /// The address of `symbol` when this object defines it (default version), else nullptr.
  void* Find(const char* symbol) const;

 private:
  friend struct LoadedObjectAccess;
  const char* path_ = "";
  uintptr_t base_ = 0;
  const void* symtab_ = nullptr;     // ElfW(Sym)[]
  const char* strtab_ = nullptr;
  const uint32_t* gnu_hash_ = nullptr;
  const uint32_t* sysv_hash_ = nullptr;
  const uint16_t* versym_ = nullptr;
};

/// Calls `visit(object, context)` for each loaded object, in load order, until it returns
/// false. See the hazards above for what `visit` may do.
void ForEachLoadedObject(bool (*visit)(const LoadedObject& object, void* context),
                         void* context);

/// A number that changes whenever an object is loaded or unloaded (glibc's dlpi_adds plus
/// dlpi_subs), or 0 when the C library does not say (then assume that anything changed). Reads
/// it with one short dl_iterate_phdr call.
uint64_t LoadedObjectsStamp();

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_LOADED_OBJECTS_H_
