// A CPU allocator for torch that keeps freed large blocks for reuse (engine/allocator.py).
//
// torch's default CPU allocator hands every block to malloc and back on free. glibc maps a block above its mmap
// threshold (at most 32 MiB) afresh and unmaps it on free, and trims the heap's top above twice that, so a
// block of a few megabytes and more is page-faulted in, a page at a time, every time an operator makes it. A
// prefill step of 2048 tokens makes such blocks in every layer (qwen2.5-0.5b: gate/up 80 MB, SiLU 40 MB).
//
// Blocks of at least `min_bytes` are rounded up to a size class (a multiple of an eighth of the largest power of
// two they reach) and, when freed, kept in a list of free blocks, newest last; a request takes the newest free
// block of its class, else a new one from c10::alloc_cpu. Beyond `max_cached_bytes` of free blocks the oldest
// are returned (c10::free_cpu); a block of more than half that is returned at once. Smaller blocks go to the
// allocator that was installed before, as they did. The blocks' contents are not touched: as malloc's, a new
// tensor's memory holds whatever was there.

#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Block {
  size_t bytes;
  void* ptr;
};

class BlockCache final : public c10::Allocator {
 public:
  BlockCache(c10::Allocator* previous, size_t min_bytes, size_t max_cached_bytes)
      : previous_(previous), min_bytes_(min_bytes), max_cached_bytes_(max_cached_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) {
      return previous_->allocate(n);
    }
    const size_t bytes = size_class(n);
    void* ptr = take(bytes);
    if (ptr == nullptr) {
      ptr = c10::alloc_cpu(bytes);  // outside the lock; throws on failure, as the default allocator does
      std::lock_guard<std::mutex> guard(mutex_);
      live_[ptr] = bytes;
      live_bytes_ += bytes;
    }
    return {ptr, ptr, &BlockCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  // The newest free block of this size class, moved to the live ones (nullptr, counted a miss, when none is free).
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> guard(mutex_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->bytes == bytes) {
        void* ptr = it->ptr;
        free_.erase(std::next(it).base());
        cached_bytes_ -= bytes;
        live_[ptr] = bytes;
        live_bytes_ += bytes;
        ++hits_;
        return ptr;
      }
    }
    ++misses_;
    return nullptr;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &BlockCache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Frees a block of this cache, or (raw_deallocate of a small block) hands it to the previous allocator.
  static void release(void* ptr) {
    BlockCache* self = instance_;
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> guard(self->mutex_);
      auto found = self->live_.find(ptr);
      if (found == self->live_.end()) {
        // Not ours: a small block that raw_allocate took from the previous allocator.
        c10::DeleterFnPtr previous = self->previous_->raw_deleter();
        TORCH_CHECK(previous != nullptr, "cpu block cache: cannot free a block it does not know");
        previous(ptr);
        return;
      }
      const size_t bytes = found->second;
      self->live_.erase(found);
      self->live_bytes_ -= bytes;
      if (bytes > self->max_cached_bytes_ / 2) {  // a KV cache, a weight: not a step's temporary
        evicted.push_back({bytes, ptr});
      } else {
        self->free_.push_back({bytes, ptr});
        self->cached_bytes_ += bytes;
        while (self->cached_bytes_ > self->max_cached_bytes_) {
          evicted.push_back(self->free_.front());
          self->cached_bytes_ -= self->free_.front().bytes;
          self->free_.pop_front();
          ++self->evictions_;
        }
      }
    }
    for (const Block& block : evicted) {
      c10::free_cpu(block.ptr);
    }
  }

  // Returns every free block to the system.
  void empty() {
    std::list<Block> blocks;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      blocks.swap(free_);
      cached_bytes_ = 0;
    }
    for (const Block& block : blocks) {
      c10::free_cpu(block.ptr);
    }
  }

  std::unordered_map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> guard(mutex_);
    return {
        {"hits", hits_},
        {"misses", misses_},
        {"evictions", evictions_},
        {"cached_bytes", static_cast<int64_t>(cached_bytes_)},
        {"cached_blocks", static_cast<int64_t>(free_.size())},
        {"live_bytes", static_cast<int64_t>(live_bytes_)},
        {"live_blocks", static_cast<int64_t>(live_.size())},
        {"min_bytes", static_cast<int64_t>(min_bytes_)},
        {"max_cached_bytes", static_cast<int64_t>(max_cached_bytes_)},
    };
  }

  // Rounds up to a multiple of an eighth of the largest power of two <= n (at most 12.5% more), at least 4 KiB.
  static size_t size_class(size_t n) {
    size_t power = 1;
    while (power <= n / 2) {
      power <<= 1;
    }
    size_t step = power >> 3;
    if (step < 4096) {
      step = 4096;
    }
    return (n + step - 1) / step * step;
  }

  static BlockCache* instance_;

 private:
  c10::Allocator* previous_;
  const size_t min_bytes_;
  const size_t max_cached_bytes_;
  std::mutex mutex_;
  std::list<Block> free_;  // oldest first
  std::unordered_map<void*, size_t> live_;
  size_t cached_bytes_ = 0;
  size_t live_bytes_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  int64_t evictions_ = 0;
};

BlockCache* BlockCache::instance_ = nullptr;
std::mutex install_mutex;

// Installs the cache as torch's CPU allocator, once per process (it is never freed: tensors made through it may
// outlive everything). A second call keeps the first one's settings and returns false.
bool install(int64_t min_bytes, int64_t max_cached_bytes) {
  TORCH_CHECK(min_bytes >= 4096, "min_bytes: must be at least 4096, got ", min_bytes);
  TORCH_CHECK(max_cached_bytes >= 0, "max_cached_bytes: must be >= 0, got ", max_cached_bytes);
  std::lock_guard<std::mutex> guard(install_mutex);
  if (BlockCache::instance_ != nullptr) {
    return false;
  }
  BlockCache::instance_ = new BlockCache(
      c10::GetCPUAllocator(), static_cast<size_t>(min_bytes), static_cast<size_t>(max_cached_bytes));
  c10::SetCPUAllocator(BlockCache::instance_, /*priority=*/2);
  return true;
}

bool installed() { return BlockCache::instance_ != nullptr && c10::GetCPUAllocator() == BlockCache::instance_; }

std::unordered_map<std::string, int64_t> stats() {
  TORCH_CHECK(BlockCache::instance_ != nullptr, "cpu block cache: not installed");
  return BlockCache::instance_->stats();
}

void empty() {
  TORCH_CHECK(BlockCache::instance_ != nullptr, "cpu block cache: not installed");
  BlockCache::instance_->empty();
}

int64_t size_class(int64_t n) { return static_cast<int64_t>(BlockCache::size_class(static_cast<size_t>(n))); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "install the block cache as torch's CPU allocator");
  m.def("installed", &installed, "whether torch's CPU allocator is this cache");
  m.def("stats", &stats, "hits, misses, evictions and bytes of the cache");
  m.def("empty", &empty, "return every free block to the system");
  m.def("size_class", &size_class, "the bytes a block of n bytes takes");
}
