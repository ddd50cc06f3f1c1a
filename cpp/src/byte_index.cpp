// See byte_index.hpp.
#include "dlbricks/byte_index.hpp"

namespace dlbricks {

void BytesIndex::rehash(std::size_t capacity) {
    std::vector<Slot> slots(capacity);
    const std::size_t mask = capacity - 1;
    for (std::size_t id = 0; id < hash_of_.size(); ++id) {
        std::size_t j = hash_of_[id] & mask;
        while (slots[j].id1 != 0) j = (j + 1) & mask;
        slots[j] = Slot{static_cast<std::uint32_t>(hash_of_[id] >> 32), static_cast<std::int32_t>(id) + 1};
    }
    slots_.swap(slots);
}

void BytesIndex::reserve(std::size_t n) {
    std::size_t capacity = 256;
    while (capacity < 2 * n) capacity *= 2;
    if (capacity > slots_.size()) rehash(capacity);
    at_.reserve(n + 1);
    hash_of_.reserve(n);
}

std::int32_t BytesIndex::intern(const char* p, std::size_t n, bool& inserted) {
    if (2 * (size() + 1) > slots_.size()) rehash(slots_.empty() ? 256 : 2 * slots_.size());  // at most half full
    const std::uint64_t h = bytes_hash(p, n);
    const auto check = static_cast<std::uint32_t>(h >> 32);
    const std::size_t mask = slots_.size() - 1;
    std::size_t j = h & mask;
    for (; slots_[j].id1 != 0; j = (j + 1) & mask) {
        if (slots_[j].check != check) continue;
        const std::int32_t id = slots_[j].id1 - 1;
        const std::string_view have = key(id);
        if (have.size() == n && bytes_equal(have.data(), p, n)) {
            inserted = false;
            return id;
        }
    }
    const auto id = static_cast<std::int32_t>(size());
    arena_.append(p, n);
    at_.push_back(arena_.size());
    hash_of_.push_back(h);
    slots_[j] = Slot{check, id + 1};
    inserted = true;
    return id;
}

std::int32_t BytesIndex::find(const char* p, std::size_t n) const {
    if (slots_.empty()) return -1;
    const std::uint64_t h = bytes_hash(p, n);
    const auto check = static_cast<std::uint32_t>(h >> 32);
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t j = h & mask; slots_[j].id1 != 0; j = (j + 1) & mask) {
        if (slots_[j].check != check) continue;
        const std::int32_t id = slots_[j].id1 - 1;
        const std::string_view have = key(id);
        if (have.size() == n && bytes_equal(have.data(), p, n)) return id;
    }
    return -1;
}

std::shared_ptr<const std::string> HeadTable::find(std::string_view key) const {
    const std::int32_t id = keys_.find(key.data(), key.size());
    return id < 0 ? nullptr : heads_[static_cast<std::size_t>(id)];
}

void HeadTable::add(std::string_view key, std::shared_ptr<const std::string> head) {
    const std::size_t more = key.size() + head->size();
    if (more > max_bytes_) return;  // not worth keeping
    if (heads_.size() >= max_entries_ || bytes_ + more > max_bytes_) clear();
    bool inserted;
    const std::int32_t id = keys_.intern(key.data(), key.size(), inserted);
    if (!inserted) {  // the same key always canonicalises to the same head
        heads_[static_cast<std::size_t>(id)] = std::move(head);
        return;
    }
    heads_.push_back(std::move(head));
    bytes_ += more;
}

void HeadTable::clear() {
    keys_ = BytesIndex();
    heads_.clear();
    bytes_ = 0;
}

}  // namespace dlbricks
