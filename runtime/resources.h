// runtime/resources.h: releasing what forksafe caches, so that a process (or a leak check) can
// see what is really in use.
//
// What it offers
//   ReleaseCachedResources() empties every cache the library keeps only to go faster: today the
//   shared-memory arena of mp/sharing (segments this process created whose blocks are all free
//   everywhere, and the most recently imported segments it keeps mapped). Each freed segment
//   gives back its mapping and its descriptor (and, for the file_system strategy, its /dev/shm
//   name). Memory that a live tensor or a reference in flight still uses stays. Resources the
//   library keeps for the life of the process — the children's lifeline pipe, the fork server
//   and the shm manager with their sockets — are not caches and stay as well; the leak check of
//   the tests learns about them from runtime/internal/kept_resources.h.
//
// Guarantees
//   - Thread safety: may be called from any thread at any time, concurrently with allocation,
//     sharing and receiving of tensors; each cache is emptied under its own lock.
//   - Fork: in a forked child it empties the child's own caches; the parent's are untouched.
//   - Later use simply fills the caches again (the next tensor maps or creates a segment anew).
#ifndef FORKSAFE_RUNTIME_RESOURCES_H_
#define FORKSAFE_RUNTIME_RESOURCES_H_

namespace forksafe::runtime {

/// Empties every cache the library keeps for speed (see above). Never throws.
void ReleaseCachedResources();

}  // namespace forksafe::runtime

#endif  // FORKSAFE_RUNTIME_RESOURCES_H_
