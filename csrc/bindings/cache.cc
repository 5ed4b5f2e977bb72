// Python bindings of the BagPipe cache metadata and step planner (torchrec_bagpipe._C).
//
// Every call borrows its input arrays (1-D, C-contiguous numpy; torch CPU tensors cross as
// tensor.numpy(), zero-copy) and returns compact numpy arrays that own their memory. The
// metadata's batch calls write straight into numpy arrays allocated here (sized for every
// key, shrunk in place to the count), so nothing is copied on the way out.
//
// GIL: a metadata call on at least kReleaseGilKeys keys releases the GIL around the native
// work (a fraction of a millisecond and up: the other Python threads of the trainer run
// meanwhile); smaller calls keep it, since giving the GIL away for a few microseconds makes
// the caller queue to get it back (up to the interpreter's switch interval) for nothing.
// Planning whole steps (add_step, add_steps) always releases it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "bindings/buffers.h"
#include "bindings/eviction_options.h"
#include "bindings/registry.h"
#include "cache/cache_metadata.h"
#include "cache/step_planner.h"
#include "cache/unique_keys.h"
#include "common/errors.h"

namespace py = pybind11;

namespace bagpipe::bindings {
namespace {

using cache::CacheMetadata;
using cache::RankPlan;
using cache::StepPlanner;
using MetadataClass = py::class_<CacheMetadata>;
using PlannerClass = py::class_<StepPlanner>;

template <typename T>
py::array_t<T> ToArray(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({static_cast<py::ssize_t>(heap->size())},
                        {static_cast<py::ssize_t>(sizeof(T))}, heap->data(), owner);
}

template <typename T>
py::array_t<T> CopyArray(const std::vector<T>& v) {
  return ToArray(std::vector<T>(v));
}

// Metadata calls on at least this many keys release the GIL (see the file comment).
constexpr size_t kReleaseGilKeys = 16384;

// Runs fn() with the GIL released when n keys make it worth it.
template <typename Fn>
auto MaybeWithoutGil(size_t n, Fn&& fn) {
  if (n < kReleaseGilKeys) return fn();
  py::gil_scoped_release release;
  return fn();
}

py::array_t<int64_t> NewIndexArray(size_t n) {
  return py::array_t<int64_t>(static_cast<py::ssize_t>(n));
}

// Shrinks a fresh array (one reference: ours) to its first k entries in place.
py::array_t<int64_t> Shrunk(py::array_t<int64_t> a, int64_t k) {
  if (k != a.size()) a.resize({static_cast<py::ssize_t>(k)}, false);
  return a;
}

void SameLength(size_t n, size_t m, const char* a, const char* b) {
  if (n != m) {
    throw ValueError(std::string(b) + " must have the length of " + a + " (" + std::to_string(n) +
                     "), got " + std::to_string(m));
  }
}

struct Triple {
  ConstVec<int64_t> keys, versions, next_uses;
};

// Checks three equally long int64 arrays.
Triple CheckTriple(const py::array& keys, const py::array& versions, const py::array& next_uses) {
  Triple t{Vec<int64_t>(keys, "keys"), Vec<int64_t>(versions, "versions"),
           Vec<int64_t>(next_uses, "next_uses")};
  SameLength(t.keys.size, t.versions.size, "keys", "versions");
  SameLength(t.keys.size, t.next_uses.size, "keys", "next_uses");
  return t;
}

py::tuple QueryCall(CacheMetadata& c, const py::array& keys, const py::array& versions,
                    const py::array& next_uses) {
  const Triple t = CheckTriple(keys, versions, next_uses);
  const size_t n = t.keys.size;
  auto hit_pos = NewIndexArray(n);
  auto hit_slots = NewIndexArray(n);
  auto miss_pos = NewIndexArray(n);
  const cache::QueryOut out{hit_pos.mutable_data(), hit_slots.mutable_data(),
                            miss_pos.mutable_data()};
  const auto r = MaybeWithoutGil(
      n, [&] { return c.QueryInto(t.keys.data, t.versions.data, t.next_uses.data, n, out); });
  return py::make_tuple(Shrunk(std::move(hit_pos), r.hits), Shrunk(std::move(hit_slots), r.hits),
                        Shrunk(std::move(miss_pos), r.misses), r.stale);
}

py::tuple AdmitCall(CacheMetadata& c, const py::array& keys, const py::array& versions,
                    const py::array& next_uses) {
  const Triple t = CheckTriple(keys, versions, next_uses);
  const size_t n = t.keys.size;
  auto pos = NewIndexArray(n);
  auto slots = NewIndexArray(n);
  auto evicted = NewIndexArray(n);
  auto bypassed = NewIndexArray(n);
  const cache::AdmitOut out{pos.mutable_data(), slots.mutable_data(), evicted.mutable_data(),
                            bypassed.mutable_data()};
  const auto r = MaybeWithoutGil(
      n, [&] { return c.AdmitInto(t.keys.data, t.versions.data, t.next_uses.data, n, out); });
  return py::make_tuple(Shrunk(std::move(pos), r.placed), Shrunk(std::move(slots), r.placed),
                        Shrunk(std::move(evicted), r.evicted),
                        Shrunk(std::move(bypassed), r.bypassed));
}

py::dict StatsDict(const cache::MetadataStats& s) {
  py::dict d;
  d["capacity_rows"] = s.capacity_rows;
  d["resident"] = s.resident;
  d["pinned"] = s.pinned;
  d["admitted"] = s.admitted;
  d["bypassed"] = s.bypassed;
  d["evictions"] = s.evictions;
  d["invalidations"] = s.invalidations;
  d["stale"] = s.stale;
  d["memory_bytes"] = s.memory_bytes;
  return d;
}

py::dict PlanDict(const RankPlan& p) {
  py::dict d;
  d["step"] = p.step;
  d["unique"] = CopyArray(p.unique);
  d["inverse"] = CopyArray(p.inverse);
  d["dep"] = CopyArray(p.dep);
  d["next_use"] = CopyArray(p.next_use);
  d["prev_use"] = CopyArray(p.prev_use);
  d["shared"] = CopyArray(p.shared);
  d["union_pos"] = CopyArray(p.union_pos);
  d["others"] = CopyArray(p.others);
  d["union_keys"] = CopyArray(p.union_keys);
  d["s_now"] = CopyArray(p.s_now);
  d["evicted"] = CopyArray(p.evicted);
  d["own_pos"] = CopyArray(p.own_pos);
  d["own_inverse"] = CopyArray(p.own_inverse);
  d["global_ids"] = p.global_ids;
  d["union_size"] = p.union_size;
  return d;
}

// Construction, its properties and moving to a step.
void BindMetadataState(MetadataClass& cls) {
  cls.def(py::init([](int64_t capacity_units, const std::string& policy, int64_t key_bound) {
            return new CacheMetadata(capacity_units, cache::ParseEvictionPolicy(policy),
                                     key_bound);
          }),
          py::arg("capacity_units"), py::arg("policy") = "oracle",
          py::arg("key_bound") = cache::kUnboundedKeys,
          "key_bound: every key lies in [0, key_bound) (the table's rows; -1: unbounded); "
          "a small bound indexes keys directly (see direct_index), a key outside it is a "
          "ValueError");
  cls.def_property_readonly("key_bound", &CacheMetadata::key_bound);
  cls.def_property_readonly("direct_index", &CacheMetadata::direct_index,
                            "whether keys index the slots directly (else a hash map)");
  cls.def_property_readonly("capacity_rows", &CacheMetadata::capacity_rows);
  cls.def_property_readonly("policy", [](const CacheMetadata& c) {
    return c.policy() == cache::EvictionPolicy::kLru ? "lru" : "oracle";
  });
  cls.def_property_readonly("current_step", &CacheMetadata::current_step);
  cls.def("__len__", &CacheMetadata::size);
  cls.def(
      "advance",
      [](CacheMetadata& c, int64_t step) {
        // Expiring a step's pins touches every row the step pinned.
        MaybeWithoutGil(static_cast<size_t>(c.pin_entries()), [&] { c.Advance(step); });
      },
      py::arg("step"), "Moves to `step`: expired pins are released, stale next uses cleared.");
}

// The batch calls of a step (GIL released from kReleaseGilKeys keys on).
void BindMetadataBatches(MetadataClass& cls) {
  cls.def("query", &QueryCall, py::arg("keys"), py::arg("versions"), py::arg("next_uses"),
          "-> (hit_pos, hit_slots, miss_pos, stale)");
  cls.def("admit", &AdmitCall, py::arg("keys"), py::arg("versions"), py::arg("next_uses"),
          "-> (pos, slots, evicted_keys, bypassed): pos[i] is the source row of slots[i]");
  cls.def(
      "lookup",
      [](const CacheMetadata& c, const py::array& keys) {
        auto v = Vec<int64_t>(keys, "keys");
        auto out = NewIndexArray(v.size);
        int64_t* o = out.mutable_data();
        MaybeWithoutGil(v.size, [&] { c.Lookup(v.data, v.size, o); });
        return out;
      },
      py::arg("keys"), "-> slot of each key, else -1");
  cls.def(
      "resident",
      [](const CacheMetadata& c, const py::array& keys, const py::array& versions) {
        auto k = Vec<int64_t>(keys, "keys");
        auto v = Vec<int64_t>(versions, "versions");
        SameLength(k.size, v.size, "keys", "versions");
        auto out = NewIndexArray(k.size);
        int64_t* o = out.mutable_data();
        MaybeWithoutGil(k.size, [&] { c.Resident(k.data, v.data, k.size, o); });
        return out;
      },
      py::arg("keys"), py::arg("versions"),
      "-> slot of each key if resident at that version, else -1 (no state change)");
  cls.def(
      "count_unknown_next_uses",
      [](const CacheMetadata& c, const py::array& keys) {
        auto k = Vec<int64_t>(keys, "keys");
        int64_t n = 0;
        MaybeWithoutGil(k.size, [&] { n = c.CountUnknownNextUses(k.data, k.size); });
        return n;
      },
      py::arg("keys"),
      "-> how many of the keys are resident with no known next use (no state change)");
  cls.def(
      "set_version",
      [](CacheMetadata& c, const py::array& slots, int64_t version) {
        auto v = Vec<int64_t>(slots, "slots");
        MaybeWithoutGil(v.size, [&] { c.SetVersion(v.data, v.size, version); });
      },
      py::arg("slots"), py::arg("version"));
  cls.def(
      "pin",
      [](CacheMetadata& c, const py::array& slots, int64_t pin_step) {
        auto v = Vec<int64_t>(slots, "slots");
        MaybeWithoutGil(v.size, [&] { c.Pin(v.data, v.size, pin_step); });
      },
      py::arg("slots"), py::arg("pin_step"));
  cls.def(
      "note_uses",
      [](CacheMetadata& c, const py::array& keys, int64_t step) {
        auto v = Vec<int64_t>(keys, "keys");
        MaybeWithoutGil(v.size, [&] { c.NoteUses(v.data, v.size, step); });
      },
      py::arg("keys"), py::arg("step"));
  cls.def(
      "invalidate",
      [](CacheMetadata& c, const py::array& keys) {
        auto v = Vec<int64_t>(keys, "keys");
        return ToArray(MaybeWithoutGil(v.size, [&] { return c.Invalidate(v.data, v.size); }));
      },
      py::arg("keys"), "-> slots freed");
}

// Clearing, counters and what tests and debugging look at.
void BindMetadataInspection(MetadataClass& cls) {
  cls.def("clear", &CacheMetadata::Clear);
  cls.def("stats", [](const CacheMetadata& c) { return StatsDict(c.Stats()); });
  cls.def(
      "slot",
      [](const CacheMetadata& c, int64_t slot) {
        auto s = c.Slot(slot);
        const char* state = s.state == cache::SlotState::kFree ? "free" : "ready";
        return py::make_tuple(s.key, state, s.version,
                              s.next_use == cache::kNever ? -1 : s.next_use, s.pin_step);
      },
      py::arg("slot"), "-> (key, state, version, next_use (-1: none), pin_step)");
  cls.def("victim_order", [](const CacheMetadata& c) { return ToArray(c.VictimOrder()); });
  cls.def(
      "resident_slots",
      [](const CacheMetadata& c) {
        std::vector<int64_t> keys, slots;
        c.ResidentSlots(&keys, &slots);
        return py::make_tuple(ToArray(std::move(keys)), ToArray(std::move(slots)));
      },
      "-> (keys, slots): every resident slot, ascending, with its key");
}

// Construction and what the planner holds.
void BindPlannerState(PlannerClass& cls) {
  cls.def(
      py::init([](int world_size, int rank, int64_t lookahead, int64_t num_keys, bool collective,
                  const py::object& eviction, bool replicated) {
        cache::PlannerOptions o;
        o.eviction = EvictionOptionsFrom(eviction);
        o.world_size = world_size;
        o.rank = rank;
        o.lookahead = lookahead;
        o.num_keys = num_keys;
        o.collective = collective;
        o.replicated = replicated;
        return new StepPlanner(o);
      }),
      py::arg("world_size"), py::arg("rank"), py::arg("lookahead"), py::arg("num_keys"),
      py::arg("collective") = false, py::arg("eviction") = py::none(),
      py::arg("replicated") = false);
  cls.def_property_readonly("num_steps", &StepPlanner::num_steps);
  cls.def("eviction_stats", [](const StepPlanner& p) {
    const cache::EvictionRule& r = p.eviction();
    py::dict d;
    d["live_rows"] = r.live();
    d["created_rows"] = r.created();
    d["evicted_rows"] = r.evicted();
    d["eviction_rounds"] = r.rounds();
    return d;
  }, "The virtual table's eviction rule: live, created and evicted rows, rounds run");
  cls.def_property_readonly("first_retained", &StepPlanner::first_retained);
  cls.def_property_readonly("distinct_keys", &StepPlanner::distinct_keys);
  cls.def("memory_bytes", &StepPlanner::MemoryBytes);
}

// Adding steps (GIL released), their plans and releasing them.
void BindPlannerSteps(PlannerClass& cls) {
  cls.def(
      "add_step",
      [](StepPlanner& p, const py::array& keys, const py::array& offsets, int64_t global_ids) {
        auto k = Vec<int64_t>(keys, "keys");
        auto o = Vec<int64_t>(offsets, "offsets");
        const size_t w = static_cast<size_t>(p.options().world_size);
        if (o.size != w + 1) {
          throw ValueError("offsets must have world_size + 1 = " + std::to_string(w + 1) +
                           " entries, got " + std::to_string(o.size));
        }
        if (o.data[w] != static_cast<int64_t>(k.size) || o.data[0] != 0) {
          throw ValueError("offsets must run from 0 to len(keys) = " + std::to_string(k.size));
        }
        py::gil_scoped_release release;
        return p.AddStep(k.data, o.data, global_ids);
      },
      py::arg("keys"), py::arg("offsets"), py::arg("global_ids") = -1,
      "Adds the next step; rank q's keys are keys[offsets[q]:offsets[q+1]] (another rank's "
      "may be its distinct keys only; global_ids then gives the step's id count, "
      "duplicates included; -1: len(keys)). -> step");
  cls.def(
      "add_steps",
      [](StepPlanner& p, const py::array& keys, const py::array& offsets) {
        auto k = Vec<int64_t>(keys, "keys");
        auto o = Vec<int64_t>(offsets, "offsets");
        const size_t w = static_cast<size_t>(p.options().world_size);
        if (o.size < 1 || (o.size - 1) % w != 0) {
          throw ValueError("offsets must have steps * world_size + 1 entries, got " +
                           std::to_string(o.size));
        }
        if (o.data[0] != 0 || o.data[o.size - 1] != static_cast<int64_t>(k.size)) {
          throw ValueError("offsets must run from 0 to len(keys) = " + std::to_string(k.size));
        }
        const size_t steps = (o.size - 1) / w;
        py::gil_scoped_release release;
        std::vector<int64_t> local(w + 1);
        for (size_t s = 0; s < steps; ++s) {
          const int64_t base = o.data[s * w];
          for (size_t q = 0; q <= w; ++q) local[q] = o.data[s * w + q] - base;
          p.AddStep(k.data + base, local.data());
        }
        return steps;
      },
      py::arg("keys"), py::arg("offsets"),
      "Adds several steps: offsets[s*W + q] is where step s, rank q starts. -> steps added");
  cls.def(
      "plan", [](const StepPlanner& p, int64_t step) { return PlanDict(p.Plan(step)); },
      py::arg("step"), "-> dict of numpy arrays (copies) for `step`");
  cls.def("release", &StepPlanner::Release, py::arg("upto"), "Drops the plans of steps < upto.");
}

// unique_keys: distinct keys in first-occurrence order.
void BindUniqueKeys(py::module_& m) {
  m.def(
      "unique_keys",
      [](const py::array& keys, bool return_inverse) -> py::object {
        auto k = Vec<int64_t>(keys, "keys");
        std::vector<int64_t> out;
        if (!return_inverse) {
          cache::UniqueKeys(k.data, k.size, &out);
          return ToArray(std::move(out));
        }
        std::vector<int64_t> inverse(k.size);
        cache::UniqueKeys(k.data, k.size, &out, inverse.data());
        return py::make_tuple(ToArray(std::move(out)), ToArray(std::move(inverse)));
      },
      py::arg("keys"), py::arg("return_inverse") = false,
      "Distinct keys in first-occurrence order (-> unique, or (unique, inverse)).");
}

}  // namespace

BAGPIPE_BINDING(cache) {
  MetadataClass metadata(m, "BagPipeCacheMetadata", R"doc(
Metadata of one rank's bounded embedding cache: key -> slot, per-slot version (the step whose
commit the cached values reflect), pins, and the eviction order (lru or oracle).
Capacity is in units of 64 rows. Not thread-safe: the owner serializes calls.
)doc");
  BindMetadataState(metadata);
  BindMetadataBatches(metadata);
  BindMetadataInspection(metadata);
  PlannerClass planner(m, "StepPlanner", R"doc(
Global facts of every step's accesses seen from one rank: unique keys + inverse, dependency
steps, next/previous reads inside the lookahead window, keys other ranks touch, and (collective
aggregation) the global union with its S_now rows. Not thread-safe.
)doc");
  BindPlannerState(planner);
  BindPlannerSteps(planner);
  BindUniqueKeys(m);
}

}  // namespace bagpipe::bindings
