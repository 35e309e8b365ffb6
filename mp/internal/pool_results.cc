#include "forksafe/mp/internal/pool_results.h"

#include "absl/strings/str_cat.h"
#include "forksafe/runtime/error.h"

namespace forksafe::mp::internal {

void ThrowBadResultCount(const JobState& job, size_t got) {
  throw runtime::Error(runtime::ErrorCode::kInternal,
                       absl::StrCat(job.what(), ": a worker returned ", got,
                                    " results for a chunk; the worker and the parent disagree"));
}

IteratorInput::IteratorInput(std::unique_ptr<LazyFeed> feed, ChunkReader read, size_t window)
    : feed_(std::move(feed)), read_(std::move(read)), window_(window) {}

IteratorInput& IteratorInput::operator=(IteratorInput&& o) noexcept {
  if (this != &o) {
    Seal();
    feed_ = std::move(o.feed_);
    read_ = std::move(o.read_);
    window_ = o.window_;
    added_ = o.added_;
    error_ = std::move(o.error_);
  }
  return *this;
}

void IteratorInput::TopUp(size_t consumed) {
  while (feed_ && added_ - consumed < window_) {
    std::optional<std::pair<Message, size_t>> c;
    try {
      c = read_();
      if (c) feed_->Submit(std::move(c->first), c->second);
    } catch (...) {
      error_ = std::current_exception();
      c.reset();
    }
    if (!c) {
      Seal();
      return;
    }
    ++added_;
  }
}

void IteratorInput::Seal() {
  if (!feed_) return;
  try {
    feed_->Seal();
  } catch (...) {
  }
  feed_.reset();
  read_ = nullptr;
}

}  // namespace forksafe::mp::internal
