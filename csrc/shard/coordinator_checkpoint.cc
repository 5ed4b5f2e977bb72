// CommitCoordinator's checkpoints: explicit ones (Checkpoint), the periodic ones after a
// step is applied, and their background writer (CoordinatorOptions::checkpoint_background).
//
// Background writes: at the periodic point the backend's checkpoint begins under mu_ (the
// snapshot of the committed step: TableBackend::BeginCheckpointChain) and the writer thread
// writes it without mu_, while later steps are applied and reads are served. One write at a
// time: the next periodic point (or an explicit Checkpoint) waits for the previous write
// first. The writer reports (counters, log line, kNotifyCheckpoint) under mu_ after the
// write; whoever waits for a write reports it if the writer has not yet.
//
// Lock order: mu_, then ckpt_mu_. The writer never holds ckpt_mu_ while it takes mu_, and
// signals that its write is done before it takes mu_, so a waiter holding mu_ always wakes.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

#include "common/errors.h"
#include "shard/coordinator.h"

namespace bagpipe::shard {

using wire::MsgType;
using wire::Status;

namespace {

// A wait for the previous write logs a line this often (a write never times out: the
// checkpoint it makes is the job's restore point).
constexpr auto kWaitLogPeriod = std::chrono::seconds(30);

}  // namespace

std::map<std::string, std::string> CommitCoordinator::CheckpointMetaLocked() const {
  auto meta = options_.checkpoint_meta;
  meta["committed_step"] = std::to_string(committed_);
  meta["table"] = table_;
  return meta;
}

int64_t CommitCoordinator::Checkpoint(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  WaitForWriterLocked();
  CheckpointLocked(dir);
  return committed_;
}

void CommitCoordinator::CheckpointLocked(const std::string& dir) {
  const auto meta = CheckpointMetaLocked();
  if (!options_.checkpoint_dir.empty() && dir == options_.checkpoint_dir) {
    RecordChainLocked(committed_, backend_->CheckpointChain(dir, committed_, meta,
                                                            options_.checkpoint_chain));
    return;
  }
  backend_->Save(dir, meta);
  ++stats_.checkpoints;
  if (log_) {
    log_("table '" + table_ + "': full checkpoint at committed step " +
         std::to_string(committed_) + " written to " + dir);
  }
}

void CommitCoordinator::RecordChainLocked(int64_t step, const store::CheckpointResult& r) {
  ++stats_.checkpoints;
  stats_.incremental_checkpoints += r.incremental ? 1 : 0;
  stats_.checkpoint_bytes += static_cast<int64_t>(r.bytes);
  stats_.checkpoint_links = r.links;
  if (!log_) return;
  std::string kind = "full";
  if (r.incremental) {
    kind = "incremental (" + std::to_string(r.rows) + " rows, link " + std::to_string(r.links) +
           ")";
  }
  log_("table '" + table_ + "': " + kind + " checkpoint at committed step " +
       std::to_string(step) + " written to " + options_.checkpoint_dir);
}

void CommitCoordinator::PeriodicCheckpointLocked() {
  const int64_t step = committed_;
  std::string error;
  try {
    if (!options_.checkpoint_background) {
      CheckpointLocked(options_.checkpoint_dir);
    } else {
      WaitForWriterLocked();
      TableBackend::PendingWrite write = backend_->BeginCheckpointChain(
          options_.checkpoint_dir, step, CheckpointMetaLocked(), options_.checkpoint_chain);
      {
        std::lock_guard<std::mutex> lock(ckpt_mu_);
        ckpt_job_ = Job{step, std::move(write)};
        ckpt_busy_ = true;
      }
      ckpt_cv_.notify_all();
      return;  // reported by the writer
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  ReportCheckpointLocked(step, error);
}

void CommitCoordinator::ReportCheckpointLocked(int64_t step, const std::string& error) {
  // The update itself is applied; a failed checkpoint loses a restore point, which the
  // trainers are told about so a recovery point that lags is never silent.
  if (!error.empty() && log_) {
    log_("table '" + table_ + "': checkpoint of step " + std::to_string(step) +
         " failed: " + error);
  }
  wire::CheckpointNoteBody body{};
  body.session = params_.session;
  body.step = step;
  const size_t n = std::min(error.size(), wire::kMaxMessageBytes);
  body.text_len = static_cast<uint32_t>(n);
  const Status status = error.empty() ? Status::kOk : Status::kInternal;
  for (const auto& l : attached_) {
    if (!l) continue;
    l->Send(MsgType::kNotifyCheckpoint, status, 0, wire::kNoSlot, &body, sizeof(body), n,
            [&](uint8_t* dst) { std::memcpy(dst, error.data(), n); });
  }
}

void CommitCoordinator::ReapWriterLocked() {
  std::optional<Outcome> done;
  {
    std::lock_guard<std::mutex> lock(ckpt_mu_);
    done.swap(ckpt_done_);
  }
  if (!done) return;
  if (done->error.empty()) RecordChainLocked(done->step, done->result);
  ReportCheckpointLocked(done->step, done->error);
}

void CommitCoordinator::WaitForWriterLocked() {
  if (!writer_.joinable()) return;
  {
    std::unique_lock<std::mutex> lock(ckpt_mu_);
    while (!ckpt_cv_.wait_for(lock, kWaitLogPeriod, [&] { return !ckpt_busy_; })) {
      if (log_) {
        const int64_t step = ckpt_job_ ? ckpt_job_->step : ckpt_writing_;
        log_("table '" + table_ + "': still waiting for the checkpoint of step " +
             std::to_string(step) + " to be written");
      }
    }
  }
  ReapWriterLocked();
}

void CommitCoordinator::WriterLoop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(ckpt_mu_);
      ckpt_cv_.wait(lock, [&] { return ckpt_stop_ || ckpt_job_.has_value(); });
      if (!ckpt_job_) return;  // stopping, nothing queued
      job = std::move(*ckpt_job_);
      ckpt_job_.reset();
      ckpt_writing_ = job.step;
    }
    Outcome out;
    out.step = job.step;
    try {
      out.result = job.write();
    } catch (const std::exception& e) {
      out.error = e.what();
    }
    job.write = nullptr;  // drops an unwritten snapshot before the next can begin
    {
      std::lock_guard<std::mutex> lock(ckpt_mu_);
      ckpt_done_ = std::move(out);
      ckpt_busy_ = false;
    }
    ckpt_cv_.notify_all();
    std::lock_guard<std::mutex> lock(mu_);
    ReapWriterLocked();
  }
}

}  // namespace bagpipe::shard
