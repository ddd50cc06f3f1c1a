// The only file that sees pybind11. Arguments are checked and converted while the GIL
// is held; the work then runs without it (see each function's comment for why that is
// safe). Results are C++ vectors moved into numpy arrays without a copy.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dlbricks/corpus.hpp"
#include "dlbricks/digest.hpp"
#include "dlbricks/fpenv.hpp"
#include "dlbricks/graph.hpp"
#include "dlbricks/limits.hpp"
#include "dlbricks/onnx_scan.hpp"

namespace py = pybind11;
using namespace dlbricks;

namespace {

template <typename T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

// Hands a vector's buffer to numpy; the capsule frees it with the array.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape = {}) {
    auto* owned = new std::vector<T>(std::move(v));
    py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    if (shape.empty()) shape.push_back(static_cast<py::ssize_t>(owned->size()));
    return py::array_t<T>(shape, owned->data(), free_when_done);
}

py::array_t<std::uint8_t> digests_to_numpy(std::vector<Digest128>&& v) {
    std::vector<std::uint8_t> flat(v.size() * 16);
    for (std::size_t i = 0; i < v.size(); ++i) std::copy(v[i].bytes.begin(), v[i].bytes.end(), flat.begin() + 16 * i);
    return to_numpy(std::move(flat), {static_cast<py::ssize_t>(v.size()), 16});
}

void require_1d(const py::array& a, const char* what, py::ssize_t size = -1) {
    if (a.ndim() != 1) throw std::invalid_argument(std::string(what) + " must be one-dimensional");
    if (size >= 0 && a.shape(0) != size)
        throw std::invalid_argument(std::string(what) + " has " + std::to_string(a.shape(0)) + " entries, expected " +
                                    std::to_string(size));
}

const Digest128* digest_rows(const Array<std::uint8_t>& d, const char* what) {
    if (d.ndim() != 2 || d.shape(1) != 16)
        throw std::invalid_argument(std::string(what) + " must have shape (n, 16), one 16-byte digest per row");
    // Digest128 is 16 bytes with byte alignment, so rows of a C-contiguous uint8 array are digests.
    static_assert(sizeof(Digest128) == 16 && alignof(Digest128) == 1, "Digest128 layout");
    return reinterpret_cast<const Digest128*>(d.data());
}

// Edge arrays as a GraphView: checked lengths, optional slot arrays (None means all 0).
struct Edges {
    Array<std::int32_t> src, dst;
    std::optional<Array<std::int32_t>> src_slot, dst_slot;

    GraphView view(std::int64_t n_nodes) const {
        require_1d(src, "edge_src");
        require_1d(dst, "edge_dst", src.shape(0));
        if (src_slot) require_1d(*src_slot, "edge_src_slot", src.shape(0));
        if (dst_slot) require_1d(*dst_slot, "edge_dst_slot", src.shape(0));
        GraphView g;
        g.n_nodes = n_nodes;
        g.n_edges = src.shape(0);
        g.src = src.data();
        g.dst = dst.data();
        g.src_slot = src_slot ? src_slot->data() : nullptr;
        g.dst_slot = dst_slot ? dst_slot->data() : nullptr;
        return g;
    }
};

// A read-only view of a bytes-like object (bytes, mmap, memoryview). The caller's
// object stays referenced by the py::buffer argument for the whole call, so the
// pointer stays valid while the GIL is released.
struct Bytes {
    const std::uint8_t* data;
    std::size_t size;
};

Bytes view_bytes(const py::buffer& b, py::buffer_info& info) {
    info = b.request();
    if (info.ndim != 1 || info.itemsize != 1 || (info.ndim == 1 && info.strides[0] != 1))
        throw std::invalid_argument("expected a contiguous bytes-like object");
    return {static_cast<const std::uint8_t*>(info.ptr), static_cast<std::size_t>(info.size)};
}

py::object type_or_none(const ScanTensorType& t) {
    return py::make_tuple(t.elem_type, py::tuple(py::cast(t.shape)));
}

}  // namespace

namespace {

// The corpus arrays as a CorpusView, every length and offset checked. The view points
// into the arrays, which the caller keeps alive.
CorpusView corpus_view(const Array<std::int64_t>& node_offsets, const Array<std::int64_t>& edge_offsets,
                       const Array<std::uint8_t>& digests, const Edges& e) {
    require_1d(node_offsets, "node_offsets");
    if (node_offsets.shape(0) < 1) throw std::invalid_argument("node_offsets needs at least one entry");
    require_1d(edge_offsets, "edge_offsets", node_offsets.shape(0));
    const std::int64_t m = node_offsets.shape(0) - 1;
    CorpusView c;
    c.n_models = m;
    c.node_offsets = node_offsets.data();
    c.edge_offsets = edge_offsets.data();
    c.digests = digest_rows(digests, "digests");
    if (node_offsets.data()[m] != digests.shape(0))
        throw std::invalid_argument("node_offsets ends at " + std::to_string(node_offsets.data()[m]) +
                                    " but there are " + std::to_string(digests.shape(0)) + " digests");
    GraphView all = e.view(digests.shape(0));
    if (edge_offsets.data()[m] != all.n_edges)
        throw std::invalid_argument("edge_offsets ends at " + std::to_string(edge_offsets.data()[m]) +
                                    " but there are " + std::to_string(all.n_edges) + " edges");
    c.src = all.src;
    c.dst = all.dst;
    c.src_slot = all.src_slot;
    c.dst_slot = all.dst_slot;
    return c;
}

py::dict layers_to_dict(CorpusResult& r) {
    py::dict out;
    out["layer_ids"] = to_numpy(std::move(r.layer_ids));
    out["unique_layer_first"] = to_numpy(std::move(r.unique_layer_first));
    out["model_unique_layers"] = to_numpy(std::move(r.model_unique_layers));
    out["layer_repeats"] = to_numpy(std::move(r.layer_repeats));
    return out;
}

void add_sequences(py::dict& out, CorpusResult& r) {
    out["seq_model_offsets"] = to_numpy(std::move(r.seq_model_offsets));
    out["seq_offsets"] = to_numpy(std::move(r.seq_offsets));
    out["seq_members"] = to_numpy(std::move(r.seq_members));
    out["seq_ids"] = to_numpy(std::move(r.seq_ids));
    if (r.unique_seq_compact_offsets.empty()) {
        out["unique_seq_digests"] = digests_to_numpy(std::move(r.unique_seq_digests));
    } else {
        out["unique_seq_compact"] = to_numpy(std::move(r.unique_seq_compact));
        out["unique_seq_compact_offsets"] = to_numpy(std::move(r.unique_seq_compact_offsets));
    }
    out["unique_seq_first"] = to_numpy(std::move(r.unique_seq_first));
    out["model_unique_seqs"] = to_numpy(std::move(r.model_unique_seqs));
}

// The number of models that per-model `node_offsets` delimit over `n_layers` entries of
// the array called `layers` (they must run from 0 to its length).
std::int64_t models_of(const Array<std::int64_t>& node_offsets, py::ssize_t n_layers, const char* layers) {
    require_1d(node_offsets, "node_offsets");
    if (node_offsets.shape(0) < 1) throw std::invalid_argument("node_offsets needs at least one entry");
    const std::int64_t m = node_offsets.shape(0) - 1;
    if (node_offsets.data()[0] != 0 || node_offsets.data()[m] != n_layers)
        throw std::invalid_argument(std::string("node_offsets must run from 0 to len(") + layers + ")");
    return m;
}

// The number of keys that `offsets` (named `offsets_name`) delimit in the 1-d byte
// array `bytes` (`bytes_name`): they must be 1-d, at least [0], and end at its length.
std::int64_t keys_of(const Array<std::uint8_t>& bytes, const Array<std::int64_t>& offsets, const char* bytes_name,
                     const char* offsets_name) {
    require_1d(bytes, bytes_name);
    require_1d(offsets, offsets_name);
    if (offsets.shape(0) < 1) throw std::invalid_argument(std::string(offsets_name) + " needs at least one entry");
    const std::int64_t n = offsets.shape(0) - 1;
    if (offsets.data()[n] != bytes.shape(0))
        throw std::invalid_argument(std::string(offsets_name) + " must end at len(" + bytes_name + ")");
    return n;
}

// Checks compact sequence forms (dedup_corpus without digests) and the corpus' unique
// layer digests, then runs `convert` on them with the GIL released:
// convert(compact, offsets, n, layer_digests, n_layers), as the core's functions take them.
template <class Convert>
auto on_compact_forms(const Array<std::uint8_t>& compact, const Array<std::int64_t>& offsets,
                      const Array<std::uint8_t>& layer_digests, Convert convert) {
    const std::int64_t n = keys_of(compact, offsets, "compact", "offsets");
    const Digest128* layers = digest_rows(layer_digests, "layer_digests");
    py::gil_scoped_release release;
    return convert(compact.data(), offsets.data(), n, layers, static_cast<std::int64_t>(layer_digests.shape(0)));
}

// Both dedup entry points: one dict per G (the single-G one takes the first), all
// sharing the same layer arrays.
py::list dedup_to_dicts(Array<std::int64_t> node_offsets, Array<std::int64_t> edge_offsets, Array<std::uint8_t> digests,
                        Array<std::int32_t> edge_src, Array<std::int32_t> edge_dst,
                        std::optional<Array<std::int32_t>> edge_src_slot,
                        std::optional<Array<std::int32_t>> edge_dst_slot, const std::vector<int>& Gs,
                        bool with_digests) {
    Edges e{std::move(edge_src), std::move(edge_dst), std::move(edge_src_slot), std::move(edge_dst_slot)};
    const CorpusView c = corpus_view(node_offsets, edge_offsets, digests, e);
    std::vector<CorpusResult> rs;
    {
        py::gil_scoped_release release;
        rs = dedup_corpus(c, Gs, with_digests);
    }
    const py::dict layers = layers_to_dict(rs[0]);
    py::list out;
    for (CorpusResult& r : rs) {
        py::dict d;
        for (auto item : layers) d[item.first] = item.second;
        add_sequences(d, r);
        out.append(d);
    }
    return out;
}

}  // namespace


PYBIND11_MODULE(_core, m) {
    m.doc() = "dlbricks C++ core: graph hashing, topological sort, DLBricks split, corpus dedup.";
    m.attr("SEQUENCE_DIGEST_VERSION") = kSequenceDigestVersion;
    // The limits both loaders apply (limits.hpp): Python reads them from here.
    m.attr("MAX_ELEMENTS") = kMaxElements;
    m.attr("INLINE_BYTES") = kInlineBytes;
    m.attr("PARAM_MAX_ELEMENTS") = kParamMaxElements;
    m.attr("INT_PARAM_MAX_ELEMENTS") = kIntParamMax;
    // numpy's C API is looked up here, at import, as numpy extensions do (import_array):
    // otherwise the first call that takes or returns an array pays for pybind11's lookup
    // (NumpyVersion's regular expression, the multiarray capsule), more than most calls'
    // own work.
    (void)py::dtype::of<std::int64_t>();

    m.def(
        "digest128",
        [](py::bytes data) {
            std::string s = data;  // copied while holding the GIL
            Digest128 d;
            {
                py::gil_scoped_release release;
                d = digest128(s.data(), s.size());
            }
            return py::bytes(reinterpret_cast<const char*>(d.bytes.data()), 16);
        },
        py::arg("data"), "BLAKE2b with a 16-byte digest (equals hashlib.blake2b(data, digest_size=16)).");

    // Array arguments below are owned by this call frame (forcecast copies belong to
    // it too), so their buffers stay alive and unmoved while the GIL is released.
    m.def(
        "topo_order",
        [](std::int64_t n_nodes, Array<std::int32_t> edge_src, Array<std::int32_t> edge_dst) {
            Edges e{std::move(edge_src), std::move(edge_dst), std::nullopt, std::nullopt};
            GraphView g = e.view(n_nodes);
            std::vector<std::int32_t> order;
            {
                py::gil_scoped_release release;
                order = topo_order(g, build_adjacency(g));
            }
            return to_numpy(std::move(order));
        },
        py::arg("n_nodes"), py::arg("edge_src"), py::arg("edge_dst"));

    m.def(
        "split_sequences",
        [](Array<std::uint8_t> digests, Array<std::int32_t> edge_src, Array<std::int32_t> edge_dst,
           std::optional<Array<std::int32_t>> edge_src_slot, std::optional<Array<std::int32_t>> edge_dst_slot, int G) {
            const Digest128* rows = digest_rows(digests, "digests");
            Edges e{std::move(edge_src), std::move(edge_dst), std::move(edge_src_slot), std::move(edge_dst_slot)};
            GraphView g = e.view(digests.shape(0));
            g.digests = rows;
            Split s;
            {
                py::gil_scoped_release release;
                s = split_sequences(g, G);
            }
            return py::make_tuple(to_numpy(std::move(s.offsets)), to_numpy(std::move(s.members)),
                                  digests_to_numpy(std::move(s.digests)));
        },
        py::arg("digests"), py::arg("edge_src"), py::arg("edge_dst"), py::arg("edge_src_slot") = py::none(),
        py::arg("edge_dst_slot") = py::none(), py::arg("G"));

    m.def(
        "critical_path",
        [](Array<double> weights, Array<std::int32_t> edge_src, Array<std::int32_t> edge_dst) {
            require_1d(weights, "weights");
            Edges e{std::move(edge_src), std::move(edge_dst), std::nullopt, std::nullopt};
            GraphView g = e.view(weights.shape(0));
            CriticalPath cp;
            {
                py::gil_scoped_release release;
                cp = critical_path(g, weights.data());
            }
            return py::make_tuple(cp.length, to_numpy(std::move(cp.path)));
        },
        py::arg("weights"), py::arg("edge_src"), py::arg("edge_dst"));

    m.def(
        "dedup_corpus",
        [](Array<std::int64_t> node_offsets, Array<std::int64_t> edge_offsets, Array<std::uint8_t> digests,
           Array<std::int32_t> edge_src, Array<std::int32_t> edge_dst, std::optional<Array<std::int32_t>> edge_src_slot,
           std::optional<Array<std::int32_t>> edge_dst_slot, int G, bool with_digests) {
            const py::list one = dedup_to_dicts(std::move(node_offsets), std::move(edge_offsets), std::move(digests),
                                                std::move(edge_src), std::move(edge_dst), std::move(edge_src_slot),
                                                std::move(edge_dst_slot), {G}, with_digests);
            return py::dict(one[0]);
        },
        py::arg("node_offsets"), py::arg("edge_offsets"), py::arg("digests"), py::arg("edge_src"), py::arg("edge_dst"),
        py::arg("edge_src_slot") = py::none(), py::arg("edge_dst_slot") = py::none(), py::arg("G"),
        py::arg("sequence_digests") = true);

    m.def("dedup_corpus_many", &dedup_to_dicts, py::arg("node_offsets"), py::arg("edge_offsets"), py::arg("digests"),
          py::arg("edge_src"), py::arg("edge_dst"), py::arg("edge_src_slot") = py::none(),
          py::arg("edge_dst_slot") = py::none(), py::arg("Gs"), py::arg("sequence_digests") = true);

    m.def(
        "sequence_digests",
        [](Array<std::uint8_t> keys, Array<std::int64_t> key_offsets) {
            const std::int64_t n = keys_of(keys, key_offsets, "keys", "key_offsets");
            std::vector<Digest128> out;
            {
                py::gil_scoped_release release;
                out = sequence_digests(keys.data(), key_offsets.data(), n);
            }
            return digests_to_numpy(std::move(out));
        },
        py::arg("keys"), py::arg("key_offsets"),
        "Sequence digests of canonical keys (expand_sequence_keys makes them).");

    m.def(
        "compact_sequence_digests",
        [](Array<std::uint8_t> compact, Array<std::int64_t> offsets, Array<std::uint8_t> layer_digests) {
            return digests_to_numpy(on_compact_forms(compact, offsets, layer_digests, compact_sequence_digests));
        },
        py::arg("compact"), py::arg("offsets"), py::arg("layer_digests"),
        "Sequence digests straight from the compact forms dedup_corpus(..., sequence_digests=False) returns.");

    m.def(
        "expand_sequence_keys",
        [](Array<std::uint8_t> compact, Array<std::int64_t> offsets, Array<std::uint8_t> layer_digests) {
            auto out = on_compact_forms(compact, offsets, layer_digests, expand_sequence_keys);
            return py::make_tuple(to_numpy(std::move(out.first)), to_numpy(std::move(out.second)));
        },
        py::arg("compact"), py::arg("offsets"), py::arg("layer_digests"),
        "Canonical keys (digest inputs) and their offsets from the compact forms that "
        "dedup_corpus(..., sequence_digests=False) returns; layer_digests: the corpus' unique layers.");

    m.def(
        "repeated_kinds",
        [](Array<std::int64_t> node_offsets, Array<std::uint8_t> repeated, Array<std::int32_t> kind_codes) {
            require_1d(repeated, "repeated");
            require_1d(kind_codes, "kind_codes");
            const std::int64_t m = models_of(node_offsets, repeated.shape(0), "repeated");
            if (kind_codes.shape(0) != repeated.shape(0))
                throw std::invalid_argument("kind_codes and repeated differ in length");
            RepeatedKinds r;
            {
                py::gil_scoped_release release;
                r = repeated_kinds(m, node_offsets.data(), repeated.data(), kind_codes.data());
            }
            return py::make_tuple(to_numpy(std::move(r.offsets)), to_numpy(std::move(r.kinds)),
                                  to_numpy(std::move(r.counts)));
        },
        py::arg("node_offsets"), py::arg("repeated"), py::arg("kind_codes"),
        "Per model, its repeated layers' kinds and counts, most common first (ties: first repeat first).");

    m.def(
        "jaccard_matrix",
        [](Array<std::int64_t> node_offsets, Array<std::int32_t> layer_ids) {
            require_1d(layer_ids, "layer_ids");
            const std::int64_t m = models_of(node_offsets, layer_ids.shape(0), "layer_ids");
            std::vector<double> out;
            {
                py::gil_scoped_release release;
                out = jaccard_matrix(m, node_offsets.data(), layer_ids.data());
            }
            return to_numpy(std::move(out), {static_cast<py::ssize_t>(m), static_cast<py::ssize_t>(m)});
        },
        py::arg("node_offsets"), py::arg("layer_ids"));

    // The fast loader (see onnx_scan.hpp). WireError -> ValueError; the Python loader
    // treats either as "use the full path".
    m.def(
        "canonical_attributes",
        [](py::buffer data, std::optional<std::unordered_map<std::string, std::string>> defaults) -> py::object {
            py::buffer_info info;
            Bytes b = view_bytes(data, info);
            std::optional<std::string> out = canonical_attributes(b.data, b.size, defaults ? &*defaults : nullptr);
            if (!out) return py::none();
            return py::bytes(*out);
        },
        py::arg("attribute_fields"), py::arg("defaults"),
        "The attributes part of a layer head from a node's serialized attribute fields, or None "
        "when an attribute is not plain (Python canonicalises those).");

    m.def(
        "canonical_attribute_body",
        [](py::buffer data) -> py::object {
            py::buffer_info info;
            Bytes b = view_bytes(data, info);
            std::optional<std::string> out = canonical_attribute_body(b.data, b.size);
            if (!out) return py::none();
            return py::bytes(*out);
        },
        py::arg("attribute"),
        "The canonical body (type, reference flag, value) of one serialized AttributeProto, or "
        "None when it is not plain (Python canonicalises those).");

    m.def(
        "disable_fastbins",
        []() {
#if defined(__GLIBC__) && defined(M_MXFAST)
            return mallopt(M_MXFAST, 0) == 1;
#else
            return false;
#endif
        },
        "Turns glibc's fastbins off for the process (mallopt(M_MXFAST, 0)); False where the C "
        "library is not glibc or refuses.");

    // The calling thread's flush-to-zero mode: these run on the caller's thread (and
    // must: the mode is per thread), holding the GIL for two instructions.
    m.def("flush_denormals", &flush_denormals,
          "Whether this thread flushes subnormals to zero (x86-64: MXCSR FTZ and DAZ; aarch64: "
          "FPCR.FZ); None where the CPU is not supported.");
    m.def("set_flush_denormals", &set_flush_denormals, py::arg("on"),
          "Sets or clears this thread's flush-to-zero mode; returns the previous state as "
          "flush_denormals() reads it, or None (nothing changed) where the CPU is not supported.");

    py::register_exception<WireError>(m, "WireError", PyExc_ValueError);
    py::class_<HeadTable>(m, "HeadTable")
        .def(py::init<std::size_t, std::size_t>(), py::arg("max_entries") = HeadTable::kMaxEntries,
             py::arg("max_bytes") = HeadTable::kMaxBytes)
        .def("__len__", &HeadTable::size)
        .def("clear", &HeadTable::clear);
    py::class_<OnnxScan>(m, "OnnxScan")
        .def(py::init([](py::buffer data) {
                 py::buffer_info info;
                 Bytes b = view_bytes(data, info);
                 py::gil_scoped_release release;
                 return std::make_unique<OnnxScan>(b.data, b.size);
             }),
             py::arg("data"))
        .def_readonly("fallback", &OnnxScan::fallback)
        .def_readonly("ir_version", &OnnxScan::ir_version)
        .def_readonly("opsets", &OnnxScan::opsets)
        .def_readonly("op_keys", &OnnxScan::op_keys)
        .def_readonly("head_node", &OnnxScan::head_node)
        .def_readonly("output_names", &OnnxScan::output_names)
        .def_readonly("head_op_key", &OnnxScan::head_op_key)
        .def_property_readonly("inputs",
                               [](const OnnxScan& s) {
                                   // (name, elem_type, [(kind, value, param)]) per activation input.
                                   py::list out;
                                   for (const auto& in : s.inputs) {
                                       py::list dims;
                                       for (const auto& d : in.type.dims) dims.append(py::make_tuple(d.kind, d.value, d.param));
                                       out.append(py::make_tuple(in.name, in.type.elem_type, dims));
                                   }
                                   return out;
                               })
        .def(
            "resolve_heads",
            [](OnnxScan& s, py::buffer data, HeadTable& table, std::vector<std::int64_t> op_versions) {
                // (head id, op key, attribute fields) of each head the table lacks: the
                // attribute fields parse as a NodeProto holding just those attributes.
                py::buffer_info info;
                Bytes b = view_bytes(data, info);
                const std::vector<std::int32_t> missing = s.resolve_heads(b.data, b.size, table, op_versions);
                py::list out;
                for (std::int32_t h : missing) {
                    const auto node = static_cast<std::size_t>(s.head_node[static_cast<std::size_t>(h)]);
                    out.append(py::make_tuple(h, s.head_op_key[static_cast<std::size_t>(h)],
                                              py::bytes(s.node_attributes(b.data, node))));
                }
                return out;
            },
            py::arg("data"), py::arg("table"), py::arg("op_versions"))
        .def(
            "set_head",
            [](OnnxScan& s, std::int32_t head, py::bytes canonical, HeadTable& table) {
                s.set_head(head, std::string(canonical), table);
            },
            py::arg("head"), py::arg("canonical"), py::arg("table"))
        .def(
            "set_plain_heads",
            [](OnnxScan& s, py::buffer data, std::vector<std::int32_t> heads, std::vector<std::string> prefixes,
               std::vector<std::optional<std::unordered_map<std::string, std::string>>> defaults, HeadTable& table) {
                py::buffer_info info;
                Bytes b = view_bytes(data, info);
                std::vector<const std::unordered_map<std::string, std::string>*> by_op;
                by_op.reserve(defaults.size());
                for (const auto& d : defaults) by_op.push_back(d ? &*d : nullptr);
                return s.set_plain_heads(b.data, b.size, heads, prefixes, by_op, table);
            },
            py::arg("data"), py::arg("heads"), py::arg("prefixes"), py::arg("defaults"), py::arg("table"),
            "set_head for each of `heads` whose attributes are all plain (prefix of its op key, then "
            "canonical_attributes with that op key's defaults); returns the heads left.")
        .def(
            "light_model",
            [](const OnnxScan& s, py::buffer data, std::vector<std::vector<std::int64_t>> shapes) {
                py::buffer_info info;
                Bytes b = view_bytes(data, info);
                // Written once, straight into a bytes object of the exact size (building a
                // std::string and copying it into Python copied the model twice more).
                std::string owned;
                std::vector<std::string_view> pieces;
                {
                    py::gil_scoped_release release;
                    pieces = s.light_model_pieces(b.data, b.size, shapes, owned);
                }
                std::size_t total = 0;
                for (const std::string_view p : pieces) total += p.size();
                auto out = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, static_cast<py::ssize_t>(total)));
                if (!out) throw py::error_already_set();
                char* at = PyBytes_AS_STRING(out.ptr());
                {
                    py::gil_scoped_release release;  // nobody else can see `out` yet
                    for (const std::string_view p : pieces) {
                        std::memcpy(at, p.data(), p.size());
                        at += p.size();
                    }
                }
                return out;
            },
            py::arg("data"), py::arg("input_shapes"))
        .def(
            "finish",
            [](const OnnxScan& s, py::buffer data, py::buffer inferred, std::vector<std::vector<std::int64_t>> shapes,
               std::unordered_map<std::string, std::int64_t> dim_subst) {
                py::buffer_info info, inferred_info;
                Bytes b = view_bytes(data, info);
                Bytes inf = view_bytes(inferred, inferred_info);  // a view: no copy
                ScanResult r;
                {
                    py::gil_scoped_release release;
                    r = s.finish(b.data, b.size, inf.data, inf.size, shapes, dim_subst);
                }
                py::dict out;
                out["fallback"] = r.fallback;
                if (!r.fallback.empty()) return out;
                py::list outputs;
                for (const auto& t : r.output_types) outputs.append(type_or_none(t));
                out["output_types"] = outputs;
                out["layer_op_keys"] = to_numpy(std::move(r.layer_op_keys));
                // One bytes object for all names: decoded only if someone asks for them.
                out["layer_names"] = py::bytes(r.layer_names);
                out["layer_name_ends"] = to_numpy(std::move(r.layer_name_ends));
                out["digests"] = digests_to_numpy(std::move(r.digests));
                out["edge_src"] = to_numpy(std::move(r.edge_src));
                out["edge_src_slot"] = to_numpy(std::move(r.edge_src_slot));
                out["edge_dst"] = to_numpy(std::move(r.edge_dst));
                out["edge_dst_slot"] = to_numpy(std::move(r.edge_dst_slot));
                return out;
            },
            py::arg("data"), py::arg("inferred"), py::arg("input_shapes"), py::arg("dim_subst"));
}
