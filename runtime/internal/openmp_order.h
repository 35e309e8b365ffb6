// runtime/internal/openmp_order.h: NOT FOR USERS. The hook by which forksafe's pools keep the
// at-fork registry ordered after the OpenMP runtimes that register their own at-fork handlers
// (runtime/openmp_fork.h, "LLVM libomp and Intel libiomp5").
#ifndef FORKSAFE_RUNTIME_INTERNAL_OPENMP_ORDER_H_
#define FORKSAFE_RUNTIME_INTERNAL_OPENMP_ORDER_H_

namespace forksafe::runtime::internal {

/// Called by a pool worker before each task: OrderForkHandlersAfterOpenMp(), at most once a
/// millisecond per thread (in between it reads the clock only). Never throws.
void OrderForkHandlersAfterOpenMpFromPool() noexcept;

}  // namespace forksafe::runtime::internal

#endif  // FORKSAFE_RUNTIME_INTERNAL_OPENMP_ORDER_H_
