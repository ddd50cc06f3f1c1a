// Byte strings by id: a growable buffer, an interning hash table, and the process's
// table of canonical layer heads. Keys are compared as bytes and hashed with
// bytes_hash (digest.hpp); ids follow first appearance, so nothing depends on hash order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dlbricks/digest.hpp"

namespace dlbricks {

/// A growable byte buffer for bytes written a few at a time (interned keys, compact
/// keys, canonical forms). Its appends are inline: a capacity check, then a copy that
/// the compiler turns into one store for a 4- or 8-byte integer. std::string::append
/// is an out-of-line call (and a memmove call) per append, and these buffers take
/// mostly 4- and 8-byte integers.
class ByteBuffer {
public:
    void clear() { size_ = 0; }
    std::size_t size() const { return size_; }
    const char* data() const { return data_.get(); }
    __attribute__((always_inline)) void append(const char* p, std::size_t n) {
        if (n == 0) return;  // (memcpy's pointers must be valid even for 0 bytes)
        if (__builtin_expect(n > capacity_ - size_, 0)) grow(n);
        std::memcpy(data_.get() + size_, p, n);
        size_ += n;
    }
    void push_back(char c) {
        if (size_ == capacity_) grow(1);
        data_[size_++] = c;
    }
    ByteBuffer& operator+=(std::string_view s) {
        append(s.data(), s.size());
        return *this;
    }

private:
    __attribute__((noinline)) void grow(std::size_t n) {
        const std::size_t capacity = std::max<std::size_t>({256, 2 * capacity_, size_ + n});
        std::unique_ptr<char[]> data(new char[capacity]);
        if (size_) std::memcpy(data.get(), data_.get(), size_);
        data_.swap(data);
        capacity_ = capacity;
    }
    std::unique_ptr<char[]> data_;
    std::size_t size_ = 0, capacity_ = 0;
};

/// Interns byte strings: ids 0, 1, 2... by first appearance. Keys live back to back in
/// one arena and the table is open addressing over (hash, id): models have tens of
/// thousands of names, and a node-based map would cost an allocation and a pointer
/// chase for each. Cost: O(key length) per call, amortised.
class BytesIndex {
public:
    /// The id of the key, inserting it if new; `inserted` tells which.
    std::int32_t intern(const char* p, std::size_t n, bool& inserted);
    /// Sizes the table for about `n` keys (avoids rehashing while they arrive).
    void reserve(std::size_t n);
    /// The id of the key, or -1.
    std::int32_t find(const char* p, std::size_t n) const;
    /// Whether `id` is the id of this key (any id may be asked; no hashing).
    bool holds(std::int64_t id, const char* p, std::size_t n) const {
        if (id < 0 || static_cast<std::uint64_t>(id) >= size()) return false;
        const std::string_view k = key(static_cast<std::int32_t>(id));
        return k.size() == n && bytes_equal(k.data(), p, n);
    }
    std::string_view key(std::int32_t id) const {
        const auto i = static_cast<std::size_t>(id);
        return std::string_view(arena_.data() + at_[i], static_cast<std::size_t>(at_[i + 1] - at_[i]));
    }
    std::size_t size() const { return at_.size() - 1; }

private:
    // One slot per table entry: the hash's high half to skip most mismatches without
    // touching the arena, and the id plus one (0: empty, so that a new table is zeroed
    // memory, not a loop storing -1 per slot). Ids keep their full hash for rehashing.
    struct Slot {
        std::uint32_t check;
        std::int32_t id1;
    };
    void rehash(std::size_t capacity);
    ByteBuffer arena_;
    std::vector<std::uint64_t> at_{0};  // key i is arena_[at_[i], at_[i+1])
    std::vector<std::uint64_t> hash_of_;  // per id
    std::vector<Slot> slots_;
};

/// Canonical layer heads (digest.py's _head: operator, version and attributes) by
/// (op key, op version, attribute bytes as written), shared by the scans of a process:
/// models repeat heads, and canonicalising one takes onnx's schemas (Python). A cache:
/// it empties itself when it would pass `max_entries` heads or `max_bytes` bytes.
class HeadTable {
public:
    static constexpr std::size_t kMaxEntries = 1 << 14, kMaxBytes = 64 << 20;  // the defaults
    explicit HeadTable(std::size_t max_entries = kMaxEntries, std::size_t max_bytes = kMaxBytes)
        : max_entries_(max_entries), max_bytes_(max_bytes) {}
    /// The head stored under `key`, or null. Shared: a scan keeps its heads alive even
    /// when the table empties itself before the scan is finished.
    std::shared_ptr<const std::string> find(std::string_view key) const;
    void add(std::string_view key, std::shared_ptr<const std::string> head);
    std::size_t size() const { return heads_.size(); }
    void clear();

private:
    std::size_t max_entries_, max_bytes_, bytes_ = 0;
    BytesIndex keys_;
    std::vector<std::shared_ptr<const std::string>> heads_;  // by key id
};

}  // namespace dlbricks
