// The NCCL backend of the Communicator interface: one GPU a rank, the NCCL id made on rank 0 and
// broadcast over MPI. Built only with CUDA (CARRY_WITH_CUDA) and nccl.h; otherwise the factory says
// so. NCCL itself is loaded at run time (dlopen of libnccl.so.2, normally the copy libtorch_cuda
// already loaded), so no link flag is needed and one process never holds two NCCLs.
//
// Streams: every operation runs on the communicator's own CUDA stream (a high-priority stream from
// c10's pool), ordered after the caller's current stream by an event (what the caller enqueued
// before, e.g. the tensors' computation, comes first), and the caller's stream waits for it by
// another event (what the caller enqueues after sees the data). Every buffer the NCCL stream
// touches is recorded on it (CUDACachingAllocator::recordStream), so the allocator never hands its
// memory out while NCCL may still use it.
//
// Host-asynchronous: an operation returns once it is enqueued, and the caller's stream waits for it
// on the GPU, so the host goes on queueing work (PyTorch's ProcessGroupNCCL does the same). A send
// alone sends a copy and does not hold the caller's stream back, so a rank that runs ahead in the
// ordered chain never waits for the rank it sends to.
//
// Neighbour links (CommOptions::copy_engine_neighbours): a message of at most kLinkMaxMessage bytes
// between ranks r and r ± 1 of one host skips NCCL. The sender's copy stream copies it (a DMA copy
// over NVLink, no SM) into a ring in the receiver's memory, mapped by CUDA IPC, and writes the
// receiver's `arrived` flag; the receiver's stream waits for the flag (cuStreamWaitValue32: no SM
// either), copies the message out and writes the sender's `consumed` flag, which the sender waits for
// before it reuses that part of the ring. Both sides place the k-th message the same way (the sizes of
// the messages before it), flags only grow, and nothing waits on the host. NCCL's point-to-point
// kernels instead sit on SMs from the moment their stream reaches them until the peer's side arrives,
// which in the ordered chain is a walk later.
//
// Timeouts: the communicator is nonblocking (ncclConfig_t::blocking = 0), so no NCCL call blocks the
// host. A watchdog thread polls each enqueued operation's completion event and NCCL's async error
// against the timeout. On a failure it aborts the NCCL communicator (ncclCommAbort, so no stream
// waits forever on a dead peer) and handles it as CommOptions say: MPI_Abort at once, or a CommError
// thrown by this rank's next call on the communicator (or by synchronize()).
#include "parallel/process_group.h"
#include "layers/core/knobs.h"

#include "layers/core/nvtx.h"

#include <c10/util/Exception.h>

#if defined(CARRY_WITH_CUDA) && defined(__has_include)
#if __has_include(<nccl.h>) && __has_include(<c10/cuda/CUDAStream.h>)
#define CARRY_HAVE_NCCL 1
#endif
#endif

#ifdef CARRY_HAVE_NCCL

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#if __has_include(<cudaTypedefs.h>)
#include "parallel/stream_ops.h"
#define CARRY_HAVE_LINKS 1
#endif

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

namespace carry::parallel {

namespace {

// How run() waits for a nonblocking communicator to finish enqueuing: CARRY_NCCL_POLL=yield (the
// default) or sleep (20 us sleeps from the first poll), for A/B timings. Read once.
bool poll_by_yield() {
  static const bool yield = [] {
    const char* e = knob_value("CARRY_NCCL_POLL");
    const std::string v = e ? e : "";
    TORCH_CHECK(v.empty() || v == "yield" || v == "sleep", "CARRY_NCCL_POLL: expected 'yield' (the default) or 'sleep', got '",
                v, "'");
    return v != "sleep";
  }();
  return yield;
}

// NCCL entry points, resolved from the loaded libnccl.
struct NcclApi {
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclCommFinalize) CommFinalize;
  decltype(&ncclCommDestroy) CommDestroy;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclSend) Send;
  decltype(&ncclRecv) Recv;
  decltype(&ncclAllGather) AllGather;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclReduceScatter) ReduceScatter;
  decltype(&ncclBroadcast) Broadcast;
  decltype(&ncclGroupStart) GroupStart;
  decltype(&ncclGroupEnd) GroupEnd;
};

const NcclApi& nccl() {
  static NcclApi api = [] {
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!h) h = dlopen("libnccl.so", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(h, "NCCL backend: cannot load libnccl.so.2 (", dlerror(), ")");
    NcclApi a{};
    auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      TORCH_CHECK(f, "NCCL backend: libnccl has no ", name, " (NCCL 2.14 or later is needed)");
    };
    sym(a.GetUniqueId, "ncclGetUniqueId");
    sym(a.CommInitRankConfig, "ncclCommInitRankConfig");
    sym(a.CommGetAsyncError, "ncclCommGetAsyncError");
    sym(a.CommFinalize, "ncclCommFinalize");
    sym(a.CommDestroy, "ncclCommDestroy");
    sym(a.CommAbort, "ncclCommAbort");
    sym(a.GetErrorString, "ncclGetErrorString");
    sym(a.Send, "ncclSend");
    sym(a.Recv, "ncclRecv");
    sym(a.AllGather, "ncclAllGather");
    sym(a.AllReduce, "ncclAllReduce");
    sym(a.ReduceScatter, "ncclReduceScatter");
    sym(a.Broadcast, "ncclBroadcast");
    sym(a.GroupStart, "ncclGroupStart");
    sym(a.GroupEnd, "ncclGroupEnd");
    return a;
  }();
  return api;
}

ncclDataType_t nccl_type_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return ncclFloat64;
    case at::kFloat:
      return ncclFloat32;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kLong:
      return ncclInt64;
    case at::kInt:
      return ncclInt32;
    case at::kChar:
      return ncclInt8;
    case at::kByte:
      return ncclUint8;
    default:
      TORCH_CHECK(false, "all_reduce_sum: dtype ", t, " is not supported by the NCCL backend");
  }
}

// A CUDA event (without timing unless asked), destroyed on every path out.
class CudaEvent {
 public:
  explicit CudaEvent(bool timing = false) {
    cudaError_t e = cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming);
    TORCH_CHECK(e == cudaSuccess, "NCCL backend: cudaEventCreate failed: ", cudaGetErrorString(e));
  }
  ~CudaEvent() { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Neighbour links (see the top of the file): each rank's block for a neighbour is the ring its
// messages land in, then two flags on their own 128-byte lines.
constexpr int64_t kLinkRing = int64_t{32} << 20;
constexpr int64_t kLinkMaxMessage = kLinkRing / 4;
constexpr int64_t kLinkFlagBytes = 256, kArrived = 0, kConsumed = 128;

struct CopyLink {
  void* base = nullptr;       // this rank's block: the ring for the peer's messages, then the flags
  void* peer_base = nullptr;  // the peer's block, mapped here
#ifdef CARRY_HAVE_LINKS
  std::optional<c10::cuda::CUDAStream> copy;  // where this rank's sends to the peer run
#endif
  uint32_t sent = 0, received = 0;              // messages so far, each way
  int64_t send_head = 0, recv_head = 0;         // where the next message starts, in bytes over all laps
  std::deque<std::pair<uint32_t, int64_t>> in_ring;  // sent messages that may still fill the peer's ring: number, start

  // Where a message of `bytes` starts (over all laps; the ring offset is start % kLinkRing): the next
  // 256-byte boundary, or the next lap when it would cross the ring's end. Both sides call it in the
  // same order with the same sizes.
  static int64_t place(int64_t& head, int64_t bytes) {
    const int64_t size = (bytes + 255) / 256 * 256, off = head % kLinkRing;
    if (off + size > kLinkRing) head += kLinkRing - off;
    const int64_t start = head;
    head += size;
    return start;
  }
  static uint64_t flag(void* block, int64_t which) {
    return reinterpret_cast<uint64_t>(static_cast<char*>(block) + kLinkRing + which);
  }
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, int device, std::vector<int> world_ranks,
                   CommOptions opt, std::shared_ptr<Communicator> host)
      : host_(std::move(host)),
        comm_(comm),
        rank_(rank),
        size_(size),
        device_(device),
        world_ranks_(std::move(world_ranks)),
        opt_(std::move(opt)),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true,
                                             static_cast<c10::DeviceIndex>(device))),
        watchdog_([this] { watch(); }) {}

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    close_links();
    if (!failure_.empty() || comm_ == nullptr) return;
    // Finalize (flushes outstanding work), bounded by the timeout; abort if it does not finish.
    ncclResult_t r = nccl().CommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) {
      auto start = std::chrono::steady_clock::now();
      ncclResult_t st = ncclInProgress;
      while (nccl().CommGetAsyncError(comm_, &st) == ncclSuccess && st == ncclInProgress &&
             elapsed(start) < timeout_s())
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (st == ncclSuccess) {
        nccl().CommDestroy(comm_);
        return;
      }
    }
    nccl().CommAbort(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank_of(int r) const override { return world_ranks_.at(r); }
  std::string backend() const override { return "nccl"; }
  at::Device device() const override { return at::Device(at::kCUDA, device_); }
  const CommOptions& options() const override { return opt_; }

  void send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag) override {
    NvtxRange range("send_recv " + opt_.name);
    // Host tensors (the lengths and headers of packed messages: the tree scan's summaries) go over the
    // MPI communicator on the host. Through NCCL they were copied to the GPU and back, and the copy
    // back waited for everything the caller's stream had queued: the host stopped running ahead of the
    // GPU at every such message (a kernels-only trace of GLA 125M's tree scan at sp = 2: a quarter of
    // the step idle).
    if ((dst < 0 || out.device().is_cpu()) && (src < 0 || in.device().is_cpu())) {
      if (dst >= 0) check_peer(dst, "send");
      if (src >= 0) check_peer(src, "recv");
      host_->send_recv(out, dst, in, src, tag);
      return;
    }
    if (dst >= 0) check_peer(dst, "send");
    if (src >= 0) check_peer(src, "recv");
    // Small messages to and from a linked neighbour go by the copy engines; what is left, by NCCL.
    const bool direct = src < 0 || (in.device() == device() && in.is_contiguous());
    if (dst >= 0 && linked(dst, out.nbytes())) {
      link_send(dst, on_device(out).clone(), describe("send", out.nbytes(), tag, "to", dst));
      dst = -1;
    }
    if (src >= 0 && linked(src, in.nbytes())) {
      Tensor rbuf = direct ? in : at::empty(in.sizes(), in.options().device(device()));
      link_recv(src, rbuf, describe("recv", rbuf.nbytes(), tag, "from", src));
      if (!direct) in.copy_(rbuf);
      src = -1;
    }
    std::string op;
    std::vector<int> peers;
    Tensor sbuf, rbuf;
    if (dst >= 0) {
      // A send alone goes from a copy (see the top of the file); with a receive the caller waits anyway.
      sbuf = src < 0 ? on_device(out).clone() : on_device(out);
      op = describe("send", sbuf.nbytes(), tag, "to", dst);
      peers.push_back(dst);
    }
    if (src >= 0) {
      rbuf = direct ? in : at::empty(in.sizes(), in.options().device(device()));
      op += std::string(op.empty() ? "" : " and ") +
            describe("recv", rbuf.nbytes(), tag, "from", src);
      if (src != dst) peers.push_back(src);
    }
    if (peers.empty()) return;
    run(op, peers, {sbuf, rbuf}, /*caller_waits=*/src >= 0, [&](cudaStream_t s) {
      ncclResult_t r = nccl().GroupStart();
      if (r != ncclSuccess) return r;
      // Zero-byte messages are skipped on both sides (both know the size).
      if (dst >= 0 && sbuf.nbytes() > 0) {
        r = nccl().Send(sbuf.data_ptr(), sbuf.nbytes(), ncclUint8, dst, comm_, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      if (src >= 0 && rbuf.nbytes() > 0) {
        r = nccl().Recv(rbuf.data_ptr(), rbuf.nbytes(), ncclUint8, src, comm_, s);
        if (r != ncclSuccess && r != ncclInProgress) return r;
      }
      return nccl().GroupEnd();
    });
    if (src >= 0 && !direct) in.copy_(rbuf);
  }

  std::vector<Tensor> all_gather(const Tensor& t) override {
    NvtxRange range("all_gather " + opt_.name);
    if (t.device().is_cpu()) return host_->all_gather(t);  // on the host, as send_recv's host tensors
    Tensor buf = on_device(t);
    auto sizes = t.sizes().vec();
    sizes.insert(sizes.begin(), size_);
    Tensor out = at::empty(sizes, buf.options());
    run(describe("all_gather", buf.nbytes(), -1, "", -1), all_peers(), {buf, out}, /*caller_waits=*/true,
        [&](cudaStream_t s) {
          return nccl().AllGather(buf.data_ptr(), out.data_ptr(), buf.nbytes(), ncclUint8, comm_,
                                  s);
        });
    if (t.device() != device()) out = out.to(t.device());
    return out.unbind(0);
  }

  void all_reduce_sum(Tensor& t) override {
    NvtxRange range("all_reduce_sum " + opt_.name);
    // In place when t is this GPU's and contiguous (the caller's stream waits for the result anyway).
    const bool in_place = t.device() == device() && t.is_contiguous();
    Tensor buf = in_place ? t : on_device(t).clone();
    auto type = nccl_type_of(buf.scalar_type());
    run(describe("all_reduce_sum", buf.nbytes(), -1, "", -1), all_peers(), {buf}, /*caller_waits=*/true,
        [&](cudaStream_t s) {
          return nccl().AllReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), type, ncclSum, comm_,
                                  s);
        });
    if (!in_place) t.copy_(buf);
  }

  // In place on this GPU's buffers (NCCL's in-place forms: this rank's piece is at rank · n of the buffer);
  // anything else takes the base forms.
  void reduce_scatter_sum(Tensor& flat) override {
    if (flat.device() != device() || !flat.is_contiguous() || flat.dim() != 1 || flat.numel() % size_ != 0)
      return Communicator::reduce_scatter_sum(flat);
    NvtxRange range("reduce_scatter_sum " + opt_.name);
    const int64_t n = flat.numel() / size_;
    auto type = nccl_type_of(flat.scalar_type());
    run(describe("reduce_scatter_sum", flat.nbytes(), -1, "", -1), all_peers(), {flat}, /*caller_waits=*/true,
        [&](cudaStream_t s) {
          return nccl().ReduceScatter(flat.data_ptr(), static_cast<char*>(flat.data_ptr()) + rank_ * n * flat.element_size(),
                                      n, type, ncclSum, comm_, s);
        });
  }

  void all_gather_pieces(Tensor& flat) override {
    if (flat.device() != device() || !flat.is_contiguous() || flat.dim() != 1 || flat.numel() % size_ != 0)
      return Communicator::all_gather_pieces(flat);
    NvtxRange range("all_gather_pieces " + opt_.name);
    const int64_t bytes = flat.nbytes() / size_;
    run(describe("all_gather_pieces", flat.nbytes(), -1, "", -1), all_peers(), {flat}, /*caller_waits=*/true,
        [&](cudaStream_t s) {
          return nccl().AllGather(static_cast<char*>(flat.data_ptr()) + rank_ * bytes, flat.data_ptr(), bytes,
                                  ncclUint8, comm_, s);
        });
  }

  void broadcast(Tensor& t, int root) override {
    NvtxRange range("broadcast " + opt_.name);
    check_peer(root, "broadcast");
    Tensor buf = on_device(t).clone();
    run(describe("broadcast", buf.nbytes(), -1, "from root", root), all_peers(), {buf}, /*caller_waits=*/true,
        [&](cudaStream_t s) {
          return nccl().Broadcast(buf.data_ptr(), buf.data_ptr(), buf.nbytes(), ncclUint8, root,
                                  comm_, s);
        });
    t.copy_(buf);
  }

  void set_wait_timing(bool on) override { timing_.store(on); }
  std::map<std::string, double> take_waits_by_kind() override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, double> out;
    for (auto& [kind, ms] : waited_by_kind_ms_) out[kind] = ms / 1000.0;
    waited_by_kind_ms_.clear();
    return out;
  }
  std::vector<std::pair<std::string, double>> take_wait_sequence() override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<std::string, double>> out(wait_sequence_.begin(), wait_sequence_.end());
    wait_sequence_.clear();
    return out;
  }
  double take_waited_seconds() override {
    std::lock_guard<std::mutex> lock(mutex_);
    const double s = waited_ms_ / 1000.0;
    waited_ms_ = 0;
    return s;
  }
  HostCalls take_host_calls() override {
    std::lock_guard<std::mutex> lock(mutex_);
    HostCalls h = host_calls_;
    host_calls_ = {};
    return h;
  }

  void synchronize() override {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return pending_.empty() || !failure_.empty(); });
    if (!failure_.empty()) {
      const std::string msg = failure_;
      lock.unlock();
      fail(msg);
    }
  }

  void barrier() override {
    NvtxRange range("barrier " + opt_.name);
    Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device()));
    run("barrier", all_peers(), {one}, /*caller_waits=*/true, [&](cudaStream_t s) {
      return nccl().AllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm_, s);
    });
  }

 private:
  static double elapsed(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  double timeout_s() const {
    return opt_.timeout_s > 0 ? opt_.timeout_s : default_comm_timeout_s();
  }

  Tensor on_device(const Tensor& t) const { return t.to(device()).contiguous(); }

  std::vector<int> all_peers() const {
    std::vector<int> p;
    for (int i = 0; i < size_; ++i)
      if (i != rank_) p.push_back(i);
    return p;
  }

  std::string describe(const char* op, int64_t bytes, int tag, const char* dir, int peer) const {
    std::string s = std::string(op) + " of " + std::to_string(bytes) + " bytes";
    if (tag >= 0) s += " (tag " + std::to_string(tag) + "; NCCL ignores tags, order decides)";
    if (peer >= 0) s += std::string(" ") + dir + " rank " + std::to_string(peer);
    return s;
  }

  void check_peer(int peer, const char* op) const {
    TORCH_CHECK(peer >= 0 && peer < size_, op, ": peer rank ", peer,
                " is not a rank of communicator '", opt_.name, "' (ranks 0..", size_ - 1,
                ", this is rank ", rank_, ")");
  }

  // An enqueued operation the watchdog follows until its event completes.
  struct Work {
    std::shared_ptr<CudaEvent> done;
    std::shared_ptr<CudaEvent> ready;  // with wait timing, for an operation the caller waits for
    std::string op;
    std::vector<int> peers;
    std::vector<std::string> context;  // the CommContext lines where it was started
    std::chrono::steady_clock::time_point start;
  };

  // Runs one operation on our NCCL stream, after the work already on the caller's current stream,
  // and hands its completion to the watchdog; with `caller_waits` the caller's stream waits for it on
  // the GPU. `buffers`: the tensors the operation reads or writes (undefined entries skipped).
  template <class Enqueue>
  void run(const std::string& op, const std::vector<int>& peers,
           std::initializer_list<Tensor> buffers, bool caller_waits, Enqueue enqueue) {
    const auto entered = std::chrono::steady_clock::now();
    check_not_failed(op);
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t caller =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    const cudaStream_t stream = stream_.stream();
    auto cuda_check = [&](cudaError_t e, const char* what) {
      if (e != cudaSuccess)
        fail(detail::comm_error_message(*this, op, peers,
                                        std::string(what) + ": " + cudaGetErrorString(e)));
    };
    // The NCCL stream starts after what the caller has enqueued (the buffers' contents).
    const bool timed = caller_waits && timing_.load();
    auto ready = std::make_shared<CudaEvent>(timed);
    auto done = std::make_shared<CudaEvent>(timed);
    cuda_check(cudaEventRecord(ready->get(), caller), "cudaEventRecord on the caller's stream");
    cuda_check(cudaStreamWaitEvent(stream, ready->get(), 0), "cudaStreamWaitEvent");
    for (const Tensor& t : buffers)
      if (t.defined() && t.is_cuda() && t.storage().data_ptr().get() != nullptr)
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    auto start = std::chrono::steady_clock::now();
    // One thread at a time in the communicator's calls (see api_mutex_).
    std::unique_lock<std::mutex> api(api_mutex_);
    ncclResult_t r = enqueue(stream);
    if (r != ncclSuccess && r != ncclInProgress) nccl_fail(op, peers, r);
    // A nonblocking communicator may still be enqueuing (host work, not the GPU's: NCCL finishes a
    // group on a thread of its own). Polled by yielding the core for the first millisecond (a sleep
    // of 20 us takes about 60 on Linux and comes once or twice a message), then by sleeping.
    const bool yield = poll_by_yield();
    for (;;) {
      ncclResult_t st = ncclSuccess;
      nccl().CommGetAsyncError(comm_, &st);
      if (st == ncclSuccess) break;
      if (st != ncclInProgress) nccl_fail(op, peers, st);
      const double waited = elapsed(start);
      if (waited > timeout_s()) time_out(op, peers);
      if (yield && waited < 1e-3) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    api.unlock();
    cuda_check(cudaEventRecord(done->get(), stream), "cudaEventRecord on the NCCL stream");
    // What the caller enqueues next (reading received data) comes after the operation.
    if (caller_waits) cuda_check(cudaStreamWaitEvent(caller, done->get(), 0), "cudaStreamWaitEvent");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back(Work{std::move(done), timed ? std::move(ready) : nullptr, op, peers,
                              detail::comm_context_lines(), start});
      if (timing_.load()) {
        host_calls_.count += 1;
        host_calls_.seconds += elapsed(entered);
      }
    }
    wake_.notify_all();
  }

  bool linked(int peer, int64_t bytes) const {
    return bytes > 0 && bytes <= kLinkMaxMessage && links_.count(peer) > 0;
  }

  // Hands a link's operation (complete at `done`) to the watchdog, and counts it. A link's wait that
  // times out is reported as NCCL's are; ncclCommAbort cannot release a stream waiting on a flag, so in
  // throw mode that stream stays stopped until the communicator is destroyed (which raises the flags).
  void follow(std::shared_ptr<CudaEvent> done, std::shared_ptr<CudaEvent> ready, const std::string& op, int peer,
              std::chrono::steady_clock::time_point entered) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back(Work{std::move(done), std::move(ready), op, {peer}, detail::comm_context_lines(), entered});
    if (timing_.load()) {
      host_calls_.count += 1;
      host_calls_.by_copy_engines += 1;
      host_calls_.seconds += elapsed(entered);
    }
    wake_.notify_all();
  }

  // Refuses a call once the communicator has failed, with the failure itself (as the watchdog found it,
  // or an earlier call).
  void check_not_failed(const std::string& op) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!failure_.empty()) {
      const std::string msg = failure_ + "\n  (reported by the next call on the communicator: " + op + ")";
      lock.unlock();
      fail(msg);
    }
  }

#ifdef CARRY_HAVE_LINKS
  void link_check(CUresult r, const std::string& op, int peer, const char* what) {
    if (r != CUDA_SUCCESS)
      fail(detail::comm_error_message(*this, op, {peer}, std::string(what) + " failed (CUresult " +
                                                             std::to_string(static_cast<int>(r)) + ")"));
  }
  void cuda_link_check(cudaError_t e, const std::string& op, int peer, const char* what) {
    if (e != cudaSuccess)
      fail(detail::comm_error_message(*this, op, {peer}, std::string(what) + ": " + cudaGetErrorString(e)));
  }

  // The message (contiguous, this GPU's, no longer written by the caller) into the peer's ring, on the
  // link's copy stream after the caller's current stream.
  void link_send(int peer, const Tensor& buf, const std::string& op) {
    const auto entered = std::chrono::steady_clock::now();
    check_not_failed(op);
    CopyLink& l = *links_.at(peer);
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    const cudaStream_t copy = l.copy->stream();
    const int64_t bytes = buf.nbytes();
    const int64_t start = CopyLink::place(l.send_head, bytes);
    const int64_t end = start + (bytes + 255) / 256 * 256;
    // The peer must have copied out every earlier message this one overwrites (the ring's previous lap).
    uint32_t must = 0;
    while (!l.in_ring.empty() && l.in_ring.front().second < end - kLinkRing) {
      must = l.in_ring.front().first;
      l.in_ring.pop_front();
    }
    const uint32_t k = ++l.sent;
    l.in_ring.emplace_back(k, start);
    auto ready = std::make_shared<CudaEvent>();
    auto done = std::make_shared<CudaEvent>();
    cuda_link_check(cudaEventRecord(ready->get(), caller), op, peer, "cudaEventRecord on the caller's stream");
    cuda_link_check(cudaStreamWaitEvent(copy, ready->get(), 0), op, peer, "cudaStreamWaitEvent");
    if (must > 0)
      link_check(ops_.wait(copy, CopyLink::flag(l.base, kConsumed), must, CU_STREAM_WAIT_VALUE_GEQ), op, peer,
                 "waiting for the peer to free its ring");
    cuda_link_check(cudaMemcpyAsync(static_cast<char*>(l.peer_base) + start % kLinkRing, buf.data_ptr(), bytes,
                                    cudaMemcpyDeviceToDevice, copy),
                    op, peer, "the copy into the peer's ring");
    link_check(ops_.write(copy, CopyLink::flag(l.peer_base, kArrived), k, CU_STREAM_WRITE_VALUE_DEFAULT), op, peer,
               "writing the peer's arrived flag");
    c10::cuda::CUDACachingAllocator::recordStream(buf.storage().data_ptr(), *l.copy);
    cuda_link_check(cudaEventRecord(done->get(), copy), op, peer, "cudaEventRecord on the copy stream");
    follow(std::move(done), nullptr, op, peer, entered);
  }

  // The next message from the peer into `buf` (contiguous, this GPU's), on the caller's current stream:
  // what the caller enqueues next sees it.
  void link_recv(int peer, Tensor& buf, const std::string& op) {
    const auto entered = std::chrono::steady_clock::now();
    check_not_failed(op);
    CopyLink& l = *links_.at(peer);
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    const int64_t bytes = buf.nbytes();
    const int64_t start = CopyLink::place(l.recv_head, bytes);
    const uint32_t k = ++l.received;
    const bool timed = timing_.load();
    std::shared_ptr<CudaEvent> ready = timed ? std::make_shared<CudaEvent>(true) : nullptr;
    auto done = std::make_shared<CudaEvent>(timed);
    if (ready) cuda_link_check(cudaEventRecord(ready->get(), caller), op, peer, "cudaEventRecord");
    link_check(ops_.wait(caller, CopyLink::flag(l.base, kArrived), k, CU_STREAM_WAIT_VALUE_GEQ | link_wait_flags_),
               op, peer, "waiting for the message");
    if (ready) cuda_link_check(cudaEventRecord(done->get(), caller), op, peer, "cudaEventRecord");
    cuda_link_check(cudaMemcpyAsync(buf.data_ptr(), static_cast<char*>(l.base) + start % kLinkRing, bytes,
                                    cudaMemcpyDeviceToDevice, caller),
                    op, peer, "the copy out of the ring");
    link_check(ops_.write(caller, CopyLink::flag(l.peer_base, kConsumed), k, CU_STREAM_WRITE_VALUE_DEFAULT), op,
               peer, "writing the peer's consumed flag");
    if (!ready) cuda_link_check(cudaEventRecord(done->get(), caller), op, peer, "cudaEventRecord");
    follow(std::move(done), std::move(ready), op, peer, entered);
  }

 public:
  // Collective over the ranks of `boot` (this communicator's): links to r - 1 and r + 1 where both are
  // on this host and both GPUs map each other's block; "" when every link this rank wanted is up, else
  // why not (that neighbour's messages go by NCCL).
  std::string open_links(Communicator& boot) {
    std::string why;
    if (size_ < 2) return why;
    std::string local = load_stream_ops(ops_);
    int flush = 0;
    if (cudaDeviceGetAttribute(&flush, cudaDevAttrCanFlushRemoteWrites, device_) == cudaSuccess && flush)
      link_wait_flags_ = CU_STREAM_WAIT_VALUE_FLUSH;
    (void)cudaGetLastError();
    const uint64_t host = std::hash<std::string>{}(world_info().host);
    for (int peer : {rank_ - 1, rank_ + 1}) {  // every rank: the left link first, so the pairs meet in order
      if (peer < 0 || peer >= size_) continue;
      auto l = std::make_unique<CopyLink>();
      std::string mine = local;
      cudaIpcMemHandle_t handle{};
      if (mine.empty()) mine = prepare_block(*l, &handle);
      constexpr int64_t kH = sizeof(cudaIpcMemHandle_t);
      auto out = at::zeros({1 + 8 + kH}, at::kByte), in = at::zeros({1 + 8 + kH}, at::kByte);
      out.data_ptr<uint8_t>()[0] = mine.empty() ? 1 : 0;
      std::memcpy(out.data_ptr<uint8_t>() + 1, &host, 8);
      std::memcpy(out.data_ptr<uint8_t>() + 9, &handle, kH);
      {
        CommContext ctx("communicator '" + opt_.name + "': exchanging the neighbour links' IPC handles");
        boot.send_recv(out, peer, in, peer, /*tag=*/7301);
      }
      uint64_t peer_host = 0;
      std::memcpy(&peer_host, in.data_ptr<uint8_t>() + 1, 8);
      if (mine.empty() && peer_host != host) mine = "rank " + std::to_string(peer) + " is on another host";
      if (mine.empty() && in.data_ptr<uint8_t>()[0] == 0) mine = "rank " + std::to_string(peer) + " could not share its block";
      if (mine.empty()) {
        std::memcpy(&handle, in.data_ptr<uint8_t>() + 9, kH);
        mine = map_peer_block(*l, handle);
      }
      auto ok = at::full({1}, mine.empty() ? 1 : 0, at::kByte), peer_ok = at::zeros({1}, at::kByte);
      {
        CommContext ctx("communicator '" + opt_.name + "': agreeing on the neighbour links");
        boot.send_recv(ok, peer, peer_ok, peer, /*tag=*/7302);
      }
      if (mine.empty() && peer_ok.data_ptr<uint8_t>()[0] == 0)
        mine = "rank " + std::to_string(peer) + " could not map this rank's block";
      if (mine.empty()) {
        links_[peer] = std::move(l);
      } else {
        release_link(*l);
        why += (why.empty() ? "" : "; ") + std::string("to rank ") + std::to_string(peer) + ": " + mine;
      }
    }
    return why;
  }

 private:
  std::string prepare_block(CopyLink& l, cudaIpcMemHandle_t* handle) {
    c10::cuda::CUDAGuard guard(device_);
    const int64_t bytes = kLinkRing + kLinkFlagBytes;
    if (cudaMalloc(&l.base, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      l.base = nullptr;
      return "cudaMalloc of the link's ring (" + std::to_string(bytes >> 20) + " MiB) failed";
    }
    if (cudaMemset(l.base, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
        cudaIpcGetMemHandle(handle, l.base) != cudaSuccess) {
      (void)cudaGetLastError();
      return "zeroing or sharing the link's ring failed";
    }
    return "";
  }

  std::string map_peer_block(CopyLink& l, const cudaIpcMemHandle_t& handle) {
    c10::cuda::CUDAGuard guard(device_);
    if (cudaIpcOpenMemHandle(&l.peer_base, handle, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      (void)cudaGetLastError();
      l.peer_base = nullptr;
      return "cudaIpcOpenMemHandle could not map the neighbour's ring (no peer access between the GPUs?)";
    }
    l.copy.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(device_)));
    const cudaStream_t s = l.copy->stream();
    const CUresult w = ops_.write(s, CopyLink::flag(l.base, kArrived), 0, CU_STREAM_WRITE_VALUE_DEFAULT);
    const CUresult v = ops_.wait(s, CopyLink::flag(l.base, kArrived), 0, CU_STREAM_WAIT_VALUE_GEQ | link_wait_flags_);
    if (w != CUDA_SUCCESS || v != CUDA_SUCCESS || cudaStreamSynchronize(s) != cudaSuccess) {
      (void)cudaGetLastError();
      return "the stream memory operations failed on this device";
    }
    return "";
  }

  // Raises this rank's flags past every wait (a message that never came must not hang a stream), waits
  // for the link's copies, then unmaps and frees.
  void release_link(CopyLink& l) {
    c10::cuda::CUDAGuard guard(device_);
    if (l.base && ops_.write) {
      auto s = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device_));
      (void)ops_.write(s.stream(), CopyLink::flag(l.base, kArrived), l.received + (1u << 30), CU_STREAM_WRITE_VALUE_DEFAULT);
      (void)ops_.write(s.stream(), CopyLink::flag(l.base, kConsumed), l.sent + (1u << 30), CU_STREAM_WRITE_VALUE_DEFAULT);
      (void)cudaStreamSynchronize(s.stream());
    }
    if (l.copy) (void)cudaStreamSynchronize(l.copy->stream());
    if (l.peer_base) (void)cudaIpcCloseMemHandle(l.peer_base);
    if (l.base) (void)cudaFree(l.base);
    l.base = l.peer_base = nullptr;
    (void)cudaGetLastError();
  }
  void close_links() {
    for (auto& [peer, l] : links_) release_link(*l);
    links_.clear();
  }
#else
  void link_send(int, const Tensor&, const std::string&) {}
  void link_recv(int, Tensor&, const std::string&) {}
  void close_links() {}

 public:
  std::string open_links(Communicator&) { return "carry was built without cudaTypedefs.h (stream memory operations)"; }

 private:
#endif

  // The watchdog: drops completed operations, and on an error or a timeout aborts the communicator
  // and records (or, in abort mode, reports) the failure.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (pending_.empty() || !failure_.empty()) {
        wake_.wait(lock, [&] { return stop_ || (!pending_.empty() && failure_.empty()); });
        continue;
      }
      std::string why;
      while (!pending_.empty()) {
        const Work& w = pending_.front();
        cudaError_t q = cudaEventQuery(w.done->get());
        if (q == cudaSuccess) {
          float ms = 0;
          if (w.ready && cudaEventElapsedTime(&ms, w.ready->get(), w.done->get()) == cudaSuccess) {
            waited_ms_ += ms;
            const std::string kind = message_kind(w.context.empty() ? w.op : w.context.back());
            waited_by_kind_ms_[kind] += ms;
            wait_sequence_.emplace_back(kind, ms / 1000.0);
            if (wait_sequence_.size() > 4096) wait_sequence_.pop_front();
          }
          pending_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady) {
          why = std::string("CUDA error: ") + cudaGetErrorString(q);
        } else {
          // Skipped while the caller is in a call (it polls the same error; the next round asks).
          ncclResult_t st = ncclSuccess;
          std::unique_lock<std::mutex> api(api_mutex_, std::try_to_lock);
          if (api.owns_lock()) nccl().CommGetAsyncError(comm_, &st);
          if (st != ncclSuccess && st != ncclInProgress)
            why = std::string("NCCL error: ") + nccl().GetErrorString(st);
          else if (elapsed(w.start) > timeout_s())
            why = "timeout after " + std::to_string(timeout_s()) + " s";
        }
        break;
      }
      if (!why.empty()) {
        const Work& w = pending_.front();
        failure_ = detail::comm_error_message(*this, w.op, w.peers, why, &w.context);
        nccl().CommAbort(comm_);
        // Abort mode stops the job here (comm_fail); throw mode leaves the failure to the next call.
        if (opt_.on_timeout == CommOptions::OnTimeout::abort) detail::comm_fail(*this, failure_);
      }
      if (pending_.empty() || !failure_.empty()) {
        idle_.notify_all();
        continue;
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      lock.lock();
    }
  }

  [[noreturn]] void nccl_fail(const std::string& op, const std::vector<int>& peers,
                              ncclResult_t r) {
    std::string msg = detail::comm_error_message(
        *this, op, peers, std::string("NCCL error: ") + nccl().GetErrorString(r));
    mark_broken(msg);
    fail(msg);
  }

  [[noreturn]] void time_out(const std::string& op, const std::vector<int>& peers) {
    std::string msg = detail::comm_error_message(
        *this, op, peers, "timeout after " + std::to_string(timeout_s()) + " s");
    mark_broken(msg);
    fail(msg);
  }

  void mark_broken(const std::string& msg) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) nccl().CommAbort(comm_);
    failure_ = msg;
    idle_.notify_all();
  }

  [[noreturn]] void fail(const std::string& msg) const { detail::comm_fail(*this, msg); }

  std::shared_ptr<Communicator> host_;  // MPI over the same ranks: the messages of host tensors
  ncclComm_t comm_;
  int rank_, size_, device_;
  std::vector<int> world_ranks_;
  CommOptions opt_;
  c10::cuda::CUDAStream stream_;  // where every NCCL operation of this communicator runs
  // Under mutex_: the operations not known to be complete, in order; the failure's message, once there
  // is one (empty until then), after which no call is accepted.
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<Work> pending_;
  std::string failure_;
  double waited_ms_ = 0;  // set_wait_timing's sum, under mutex_
  std::map<std::string, double> waited_by_kind_ms_;  // the same by message_kind, under mutex_
  std::deque<std::pair<std::string, double>> wait_sequence_;  // the same one by one (s), under mutex_
  HostCalls host_calls_;  // run()'s host time while timing, under mutex_
  // Held by run() while it enqueues and polls, and by the watchdog while it asks for the async error.
  // NCCL's calls are generally not thread-safe on one communicator (its documentation: threads should use
  // communicators of their own), and the watchdog's ncclCommGetAsyncError beside the caller's enqueue
  // and polls crashed a run inside ncclCommGetAsyncError (SIGSEGV on rank 0, 125M Gated
  // DeltaNet at sp = 2, the caller polling without sleeps). ncclCommAbort takes no lock: it is meant
  // to stop a call in progress from another thread.
  std::mutex api_mutex_;
  std::atomic<bool> timing_{false};
  std::map<int, std::unique_ptr<CopyLink>> links_;  // by neighbour rank (open_links)
#ifdef CARRY_HAVE_LINKS
  StreamOps ops_;
  unsigned int link_wait_flags_ = 0;
#endif
  bool stop_ = false;
  std::thread watchdog_;  // last: started once the rest is constructed
};

}  // namespace

bool nccl_available() { return true; }

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int device, CommOptions opt) {
  CommOptions bo = opt;
  bo.name = opt.name + " (NCCL bootstrap over MPI)";
  bo.copy_engine_neighbours = false;
  return make_nccl_communicator(make_mpi_communicator(comm, bo), device, std::move(opt));
}

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> boot, int device, CommOptions opt) {
  // NVLink multicast (NVLS) can take a host's GPUs out of service on the machines we run on; keep
  // it off unless the user asks for it explicitly.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  TORCH_CHECK(device >= 0 && device < devices, "communicator '", opt.name,
              "': the NCCL backend needs ", "CUDA device ", device,
              " (one GPU a rank, by local rank) but this process sees ", devices,
              " CUDA device(s); start at most as many ranks a host as it has GPUs");
  ncclUniqueId id;
  Tensor idt = at::zeros({static_cast<int64_t>(sizeof(id))}, at::kByte);
  if (boot->rank() == 0) {
    ncclResult_t r = nccl().GetUniqueId(&id);
    TORCH_CHECK(r == ncclSuccess, "ncclGetUniqueId failed: ", nccl().GetErrorString(r));
    std::memcpy(idt.data_ptr(), &id, sizeof(id));
  }
  {
    CommContext ctx("broadcasting the NCCL id of communicator '" + opt.name + "'");
    boot->broadcast(idt, 0);
  }
  std::memcpy(&id, idt.data_ptr(), sizeof(id));
  std::vector<int> world_ranks;
  for (int i = 0; i < boot->size(); ++i) world_ranks.push_back(boot->world_rank_of(i));

  c10::cuda::CUDAGuard guard(device);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t c = nullptr;
  // Before the initialization starts (a bad CARRY_COMM_TIMEOUT_S must not leave it half done).
  const double timeout = opt.timeout_s > 0 ? opt.timeout_s : default_comm_timeout_s();
  ncclResult_t r = nccl().CommInitRankConfig(&c, boot->size(), id, boot->rank(), &cfg);
  TORCH_CHECK(r == ncclSuccess || r == ncclInProgress,
              "ncclCommInitRankConfig failed for communicator '", opt.name,
              "': ", nccl().GetErrorString(r));
  auto start = std::chrono::steady_clock::now();
  ncclResult_t st = ncclInProgress;
  while (nccl().CommGetAsyncError(c, &st) == ncclSuccess && st == ncclInProgress) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout) {
      nccl().CommAbort(c);
      detail::comm_fail(*boot, detail::comm_error_message(*boot, "NCCL communicator initialization",
                                                          {}, "timeout"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (st != ncclSuccess) {
    nccl().CommAbort(c);
    detail::comm_fail(
        *boot, detail::comm_error_message(*boot, "NCCL communicator initialization", {},
                                          std::string("NCCL error: ") + nccl().GetErrorString(st)));
  }
  // The bootstrap communicator stays: host tensors' messages go over it (NcclCommunicator::send_recv).
  const bool links = opt.copy_engine_neighbours;
  auto nc = std::make_shared<NcclCommunicator>(c, boot->rank(), boot->size(), device, std::move(world_ranks),
                                               std::move(opt), boot);
  if (links) {
    const std::string why = nc->open_links(*boot);
    if (!why.empty())
      std::fprintf(stderr, "carry: rank %d: communicator '%s': some messages to neighbours go by NCCL, not the copy engines (%s)\n",
                   world_info().rank, nc->options().name.c_str(), why.c_str());
  }
  return nc;
}

}  // namespace carry::parallel

#else  // no CUDA or no nccl.h

namespace carry::parallel {

bool nccl_available() { return false; }

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm, int, CommOptions opt) {
  TORCH_CHECK(
      false, "communicator '", opt.name,
      "': the NCCL backend is not in this build of carry (it needs CUDA and nccl.h at build "
      "time); use the MPI backend");
}

std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator>, int, CommOptions opt) {
  TORCH_CHECK(
      false, "communicator '", opt.name,
      "': the NCCL backend is not in this build of carry (it needs CUDA and nccl.h at build "
      "time); use the MPI backend");
}

}  // namespace carry::parallel

#endif
