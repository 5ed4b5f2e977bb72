// Python binding of the storage engine: torchrec_bagpipe._C.{StoreCore, SpillWarning,
// store_load, store_checkpoint_info, store_initial_rows, store_initial_state}, wrapped by
// torchrec_bagpipe.ps.store.EmbeddingStore (which owns argument conversion from tensors).
//
// Thread safety: the GIL is released around every native batch op; the store serializes
// ops itself. The spill callback runs without the GIL and only records a message; the
// binding turns it into a Python warning after the op, with the GIL held.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "bindings/buffers.h"
#include "bindings/convert.h"
#include "bindings/registry.h"
#include "common/errors.h"
#include "store/checkpoint.h"
#include "store/embedding_store.h"

namespace bagpipe::bindings {
namespace {

using store::EmbeddingStore;
using store::InitSpec;
using store::OptimizerSpec;
using store::StoreOptions;

py::dict OptimizerDict(const OptimizerSpec& o) {
  py::dict d;
  d["kind"] = store::OptimizerKindName(o.kind);
  d["eps"] = o.eps;
  d["beta1"] = o.beta1;
  d["beta2"] = o.beta2;
  d["weight_decay"] = o.weight_decay;
  d["initial_accumulator_value"] = o.initial_accumulator_value;
  return d;
}

// An optional (n, cols) float32 output / input next to the rows: nullptr for None.
float* OptionalMutMat(const py::object& arr, const char* name, size_t n, int cols) {
  if (arr.is_none()) return nullptr;
  return MutMat<float>(arr.cast<py::array>(), name, static_cast<py::ssize_t>(n), cols).data;
}
const float* OptionalMat(const py::object& arr, const char* name, size_t n, int cols) {
  if (arr.is_none()) return nullptr;
  return Mat<float>(arr.cast<py::array>(), name, static_cast<py::ssize_t>(n), cols).data;
}

py::object& SpillWarningType() {
  static py::object type;
  return type;
}

py::dict InitDict(const InitSpec& init) {
  py::dict d;
  d["init"] = InitKindName(init.kind);
  d["init_bound"] = init.bound;
  d["init_value"] = init.value;
  d["seed"] = init.seed;
  d["bound_starts"] = init.bound_starts;
  d["bound_values"] = init.bound_values;
  return d;
}

// Owns one store plus the warning its spill callback left for the Python side.
store::ChainPolicy PolicyOf(bool incremental, int full_every, double chain_fraction) {
  store::ChainPolicy policy;
  policy.incremental = incremental;
  policy.full_every = full_every;
  policy.chain_fraction = chain_fraction;
  return policy;
}

py::dict ResultDict(const store::CheckpointResult& r) {
  py::dict d;
  d["incremental"] = r.incremental;
  d["links"] = r.links;
  d["rows"] = r.rows;
  d["deletions"] = r.deletions;
  d["bytes"] = r.bytes;
  d["base_bytes"] = r.base_bytes;
  d["chain_bytes"] = r.chain_bytes;
  return d;
}

// A store's checkpoint between begin_checkpoint and write (EmbeddingStore::PendingCheckpoint).
struct PendingHandle {
  std::unique_ptr<EmbeddingStore::PendingCheckpoint> pending;  // null once written or dropped
  EmbeddingStore::PendingCheckpoint& get() {
    if (!pending) throw ValueError("checkpoint: this pending checkpoint was written or dropped");
    return *pending;
  }
};

class StoreHandle {
 public:
  explicit StoreHandle(std::unique_ptr<EmbeddingStore> s) : store_(std::move(s)) {
    store_->SetSpillCallback([this](const std::string& msg) {
      std::lock_guard<std::mutex> lock(mu_);
      pending_warning_ = msg;
    });
  }
  EmbeddingStore& store() { return *store_; }

  // REQUIRES: GIL held. Raises the recorded spill warning, once.
  void FlushWarning() {
    std::optional<std::string> msg;
    {
      std::lock_guard<std::mutex> lock(mu_);
      msg.swap(pending_warning_);
    }
    if (msg && PyErr_WarnEx(SpillWarningType().ptr(), msg->c_str(), 2) != 0) {
      throw py::error_already_set();
    }
  }

 private:
  std::unique_ptr<EmbeddingStore> store_;
  std::mutex mu_;
  std::optional<std::string> pending_warning_;
};

using StoreClass = py::class_<StoreHandle>;

py::dict OptionsDict(const StoreOptions& o) {
  py::dict d = InitDict(o.init);
  d["dim"] = o.dim;
  d["num_shards"] = o.num_shards;
  d["num_threads"] = o.num_threads;
  d["key_bound"] = o.key_bound;
  d["page_rows"] = o.page_rows;
  d["memory_budget"] = o.memory_budget;
  d["spill_dir"] = o.spill_dir;
  d["high_watermark"] = o.high_watermark;
  d["low_watermark"] = o.low_watermark;
  d["optimizer"] = OptimizerDict(o.optimizer);
  return d;
}

// Construction and row reads and writes (weights, with optional optimizer state).
void BindStoreRows(StoreClass& cls) {
  cls.def(py::init([](const StoreOptions& options) {
            return std::make_unique<StoreHandle>(std::make_unique<store::EmbeddingStore>(options));
          }),
          py::arg("options"));
  cls.def("options", [](StoreHandle& h) { return OptionsDict(h.store().options()); });
  cls.def("state_dim", [](StoreHandle& h) { return h.store().state_dim(); });
  cls.def(
      "lookup",
      [](StoreHandle& h, const py::array& keys, const py::array& out, bool insert_missing,
         const py::object& state_out) {
        auto k = Vec<int64_t>(keys, "keys");
        auto o = MutMat<float>(out, "out", static_cast<py::ssize_t>(k.size), h.store().dim());
        float* st = OptionalMutMat(state_out, "state_out", k.size, h.store().state_dim());
        {
          py::gil_scoped_release nogil;
          h.store().Lookup(k.data, k.size, o.data, st, insert_missing);
        }
        h.FlushWarning();
      },
      py::arg("keys"), py::arg("out"), py::arg("insert_missing"),
      py::arg("state_out") = py::none());
  cls.def(
      "assign",
      [](StoreHandle& h, const py::array& keys, const py::array& rows, const py::object& state) {
        auto k = Vec<int64_t>(keys, "keys");
        auto r = Mat<float>(rows, "rows", static_cast<py::ssize_t>(k.size), h.store().dim());
        const float* st = OptionalMat(state, "state", k.size, h.store().state_dim());
        {
          py::gil_scoped_release nogil;
          h.store().Assign(k.data, k.size, r.data, st);
        }
        h.FlushWarning();
      },
      py::arg("keys"), py::arg("rows"), py::arg("state") = py::none());
}

// Optimizer steps and membership.
void BindStoreUpdates(StoreClass& cls) {
  cls.def(
      "apply_gradients",
      [](StoreHandle& h, const py::array& keys, const py::array& grads, float lr,
         int grad_divisor) {
        auto k = Vec<int64_t>(keys, "keys");
        auto g = Mat<float>(grads, "grads", static_cast<py::ssize_t>(k.size), h.store().dim());
        {
          py::gil_scoped_release nogil;
          h.store().ApplyGradients(k.data, k.size, g.data, lr, grad_divisor);
        }
        h.FlushWarning();
      },
      py::arg("keys"), py::arg("grads"), py::arg("lr"), py::arg("grad_divisor"));
  cls.def(
      "apply_sgd",
      [](StoreHandle& h, const py::array& keys, const py::array& grads, float lr,
         int grad_divisor) {
        auto k = Vec<int64_t>(keys, "keys");
        auto g = Mat<float>(grads, "grads", static_cast<py::ssize_t>(k.size), h.store().dim());
        {
          py::gil_scoped_release nogil;
          h.store().ApplySgd(k.data, k.size, g.data, lr, grad_divisor);
        }
        h.FlushWarning();
      },
      py::arg("keys"), py::arg("grads"), py::arg("lr"), py::arg("grad_divisor"));
  cls.def(
      "contains",
      [](StoreHandle& h, const py::array& keys, const py::array& out) {
        auto k = Vec<int64_t>(keys, "keys");
        auto info = CheckedBuffer<uint8_t>(out, "out", 1, true);
        if (static_cast<size_t>(info.shape[0]) != k.size) {
          throw ValueError("out must have " + std::to_string(k.size) + " elements");
        }
        py::gil_scoped_release nogil;
        h.store().Contains(k.data, k.size, static_cast<uint8_t*>(info.ptr));
      },
      py::arg("keys"), py::arg("out"));
  cls.def(
      "erase",
      [](StoreHandle& h, const py::array& keys) {
        auto k = Vec<int64_t>(keys, "keys");
        py::gil_scoped_release nogil;
        return h.store().Erase(k.data, k.size);
      },
      py::arg("keys"));
}

// Capacity, export, checkpoint and counters.
void BindStoreMaintenance(StoreClass& cls) {
  cls.def(
      "reserve",
      [](StoreHandle& h, int64_t n) {
        if (n < 0) throw ValueError("n must be >= 0, got " + std::to_string(n));
        py::gil_scoped_release nogil;
        h.store().Reserve(static_cast<size_t>(n));
      },
      py::arg("n"));
  cls.def("size", [](StoreHandle& h) { return h.store().Size(); });
  cls.def(
      "export_chunk",
      [](StoreHandle& h, int64_t cursor, const py::array& keys, const py::array& rows,
         const py::object& state) {
        auto k = CheckedBuffer<int64_t>(keys, "keys", 1, true);
        auto r = MutMat<float>(rows, "rows", k.shape[0], h.store().dim());
        float* st =
            OptionalMutMat(state, "state", static_cast<size_t>(k.shape[0]), h.store().state_dim());
        size_t n;
        {
          py::gil_scoped_release nogil;
          n = h.store().Export(&cursor, static_cast<size_t>(k.shape[0]),
                               static_cast<int64_t*>(k.ptr), r.data, st);
        }
        return py::make_tuple(n, cursor);
      },
      py::arg("cursor"), py::arg("keys"), py::arg("rows"), py::arg("state") = py::none());
  cls.def(
      "save",
      [](StoreHandle& h, const std::string& path, const std::map<std::string, std::string>& meta,
         bool weights_only) {
        py::gil_scoped_release nogil;
        h.store().Save(path, meta, weights_only);
      },
      py::arg("path"), py::arg("meta"), py::arg("weights_only"));
  cls.def(
      "checkpoint",
      [](StoreHandle& h, const std::string& path, int64_t step,
         const std::map<std::string, std::string>& meta, bool incremental, int full_every,
         double chain_fraction) {
        const store::ChainPolicy policy = PolicyOf(incremental, full_every, chain_fraction);
        store::CheckpointResult r;
        {
          py::gil_scoped_release nogil;
          r = h.store().Checkpoint(path, step, meta, policy);
        }
        return ResultDict(r);
      },
      py::arg("path"), py::arg("step"), py::arg("meta"), py::arg("incremental"),
      py::arg("full_every"), py::arg("chain_fraction"));
  cls.def(
      "begin_checkpoint",
      [](StoreHandle& h, const std::string& path, int64_t step,
         const std::map<std::string, std::string>& meta, bool incremental, int full_every,
         double chain_fraction) {
        const store::ChainPolicy policy = PolicyOf(incremental, full_every, chain_fraction);
        py::gil_scoped_release nogil;
        return PendingHandle{h.store().BeginCheckpoint(path, step, meta, policy)};
      },
      py::arg("path"), py::arg("step"), py::arg("meta"), py::arg("incremental"),
      py::arg("full_every"), py::arg("chain_fraction"),
      py::keep_alive<0, 1>());  // the store outlives its pending checkpoint
  cls.def("stats", [](StoreHandle& h) {
    store::StoreStats s = h.store().Stats();
    py::dict d;
    d["rows"] = s.rows;
    d["bytes_resident"] = s.bytes_resident;
    d["bytes_maps"] = s.bytes_maps;
    d["bytes_spilled"] = s.bytes_spilled;
    d["pages"] = s.pages;
    d["pages_spilled"] = s.pages_spilled;
    d["page_bytes"] = s.page_bytes;
    d["spill_count"] = s.spill_count;
    d["swap_outs"] = s.swap_outs;
    d["swap_ins"] = s.swap_ins;
    d["lookups"] = s.lookups;
    d["updates"] = s.updates;
    d["memory_budget"] = s.memory_budget;
    d["state_dim"] = s.state_dim;
    d["slot_bytes"] = s.slot_bytes;
    d["dirty_rows"] = s.dirty_rows;
    return d;
  });
}

void BindPendingCheckpoint(py::module_& m) {
  py::class_<PendingHandle>(m, "PendingCheckpoint")
      .def_property_readonly("step", [](PendingHandle& p) { return p.get().step(); })
      .def_property_readonly("incremental",
                             [](PendingHandle& p) { return p.get().incremental(); })
      .def("write",
           [](PendingHandle& p) {
             p.get();  // not written or dropped yet
             std::unique_ptr<EmbeddingStore::PendingCheckpoint> pending = std::move(p.pending);
             store::CheckpointResult r;
             {
               py::gil_scoped_release nogil;
               r = pending->Write();
               pending.reset();
             }
             return ResultDict(r);
           })
      .def("drop", [](PendingHandle& p) {
        py::gil_scoped_release nogil;
        p.pending.reset();
      });
}

// store_load and store_checkpoint_info: a checkpoint opened as a store, or only read.
void BindStoreCheckpoints(py::module_& m) {
  m.def(
      "store_load",
      [](const std::string& path, const store::LoadOverrides& overrides) {
        std::map<std::string, std::string> meta;
        std::unique_ptr<store::EmbeddingStore> s;
        {
          py::gil_scoped_release nogil;
          s = store::EmbeddingStore::Load(path, overrides, &meta);
        }
        auto handle = std::make_unique<StoreHandle>(std::move(s));
        handle->FlushWarning();
        return py::make_tuple(std::move(handle), meta);
      },
      py::arg("path"), py::arg("overrides"));

  m.def(
      "store_checkpoint_info",
      [](const std::string& path) {
        store::Manifest mf;
        {
          py::gil_scoped_release nogil;
          mf = store::CheckpointReader(path).manifest();
        }
        py::dict d = InitDict(mf.init);
        d["version"] = mf.version;
        d["contents"] = mf.weights_only ? "weights" : "full";
        d["dim"] = mf.dim;
        d["key_bound"] = mf.key_bound;
        d["num_shards"] = mf.num_shards;
        d["page_rows"] = mf.page_rows;
        d["optimizer"] = store::OptimizerKindName(mf.optimizer.kind);
        d["optimizer_spec"] = OptimizerDict(mf.optimizer);
        d["state_dim"] = mf.state_dim;
        // Rows stored at the last link (a chain's base holds mf.rows).
        d["rows"] = mf.chain.increments.empty() ? mf.rows : mf.chain.increments.back().total_rows;
        d["meta"] = mf.meta;
        // The chain's links, base first: step, rows written, data bytes, meta.
        py::list links;
        py::dict base;
        base["link"] = store::LinkName(mf.chain.id, 0);
        base["step"] = mf.chain.base_step;
        base["rows"] = mf.rows;
        base["bytes"] = store::SegmentBytes(mf.segments);
        base["meta"] = mf.chain.base_meta;
        links.append(base);
        for (const store::IncrementEntry& inc : mf.chain.increments) {
          py::dict l;
          l["link"] = store::LinkName(mf.chain.id, inc.index);
          l["parent"] = store::LinkName(mf.chain.id, inc.index - 1);
          l["step"] = inc.step;
          l["rows"] = inc.rows;
          l["deletions"] = inc.deletion_count;
          l["total_rows"] = inc.total_rows;
          l["bytes"] = store::IncrementBytes(inc);
          l["meta"] = inc.meta;
          links.append(l);
        }
        d["chain"] = links;
        return d;
      },
      py::arg("path"));
}

// store_initial_rows and store_initial_state: what never-written rows read, without a store.
void BindInitialValues(py::module_& m) {
  m.def(
      "store_initial_rows",
      [](const py::array& keys, const py::array& out, const InitSpec& init) {
        auto k = Vec<int64_t>(keys, "keys");
        auto info = CheckedBuffer<float>(out, "out", 2, true);
        if (static_cast<size_t>(info.shape[0]) != k.size) {
          throw ValueError("out must have " + std::to_string(k.size) + " rows");
        }
        const int dim = static_cast<int>(info.shape[1]);
        py::gil_scoped_release nogil;
        store::EmbeddingStore::InitialRows(init, dim, k.data, k.size,
                                           static_cast<float*>(info.ptr));
      },
      py::arg("keys"), py::arg("out"), py::arg("init"));

  m.def(
      "store_initial_state",
      [](const py::array& out, int dim, const OptimizerSpec& spec) {
        store::ValidateOptimizerSpec(spec);
        if (dim <= 0) throw ValueError("dim must be > 0, got " + std::to_string(dim));
        const int state_dim = store::StateDim(spec.kind, dim);
        auto info = CheckedBuffer<float>(out, "out", 2, true);
        if (info.shape[1] != state_dim) {
          throw ValueError("out must have " + std::to_string(state_dim) + " columns, got " +
                           std::to_string(info.shape[1]));
        }
        auto* data = static_cast<float*>(info.ptr);
        for (py::ssize_t i = 0; i < info.shape[0]; ++i) {
          store::InitialState(spec, dim, data + i * state_dim);
        }
      },
      py::arg("out"), py::arg("dim"), py::arg("optimizer"));
}

}  // namespace

BAGPIPE_BINDING(store) {
  SpillWarningType() = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "torchrec_bagpipe._C.SpillWarning", "Rows of an EmbeddingStore started to spill to disk.",
      PyExc_UserWarning, nullptr));
  m.attr("SpillWarning") = SpillWarningType();
  StoreClass core(m, "StoreCore");
  BindStoreRows(core);
  BindStoreUpdates(core);
  BindStoreMaintenance(core);
  BindStoreCheckpoints(m);
  BindPendingCheckpoint(m);
  BindInitialValues(m);
}

}  // namespace bagpipe::bindings
