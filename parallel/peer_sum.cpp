// Two GPUs of one host adding a flat buffer by their copy engines (see the header).
#include "parallel/peer_sum.h"

#include "layers/core/nvtx.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <optional>

#if defined(CARRY_WITH_CUDA) && defined(__has_include)
#if __has_include(<c10/cuda/CUDAStream.h>) && __has_include(<cudaTypedefs.h>)
#define CARRY_HAVE_PEER_SUM 1
#endif
#endif

#ifdef CARRY_HAVE_PEER_SUM
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "parallel/stream_ops.h"
#endif

namespace carry::parallel {

#ifdef CARRY_HAVE_PEER_SUM
namespace {

// The flags at the end of each rank's mapped block, on their own 128-byte lines.
constexpr int64_t kFlagBytes = 256;
constexpr int64_t kArrived = 0, kConsumed = 128;

class CopyEnginePeerSum final : public PeerSum {
 public:
  CopyEnginePeerSum(at::Device device, int64_t numel, int64_t element_size) : device_(device) {
    numel_ = numel;
    data_bytes_ = (numel * element_size + 255) / 256 * 256;
  }

  ~CopyEnginePeerSum() override {
    c10::cuda::CUDAGuard guard(device_);
    // A step cut short (an error between two buckets) can leave a wait for a flag the partner never
    // writes: raise this rank's own flags past every wait first, so freeing the block cannot hang.
    if (base_ && ops_.write && copy_) {
      auto free_stream = c10::cuda::getStreamFromPool(false, device_.index());
      CUstream s = free_stream.stream();
      (void)ops_.write(s, flag(base_, kArrived), sent_ + (1u << 30), CU_STREAM_WRITE_VALUE_DEFAULT);
      (void)ops_.write(s, flag(base_, kConsumed), step_ + (1u << 30), CU_STREAM_WRITE_VALUE_DEFAULT);
      (void)cudaStreamSynchronize(copy_->stream());
      (void)cudaStreamSynchronize(sum_->stream());
    }
    if (peer_base_) (void)cudaIpcCloseMemHandle(peer_base_);
    if (base_) (void)cudaFree(base_);
    (void)cudaGetLastError();
  }

  // Allocates and zeroes the block, its IPC handle into `handle`; "" or what failed.
  std::string prepare(cudaIpcMemHandle_t* handle, const at::ScalarType dtype) {
    c10::cuda::CUDAGuard guard(device_);
    dtype_ = dtype;
    if (auto why = load_stream_ops(ops_); !why.empty()) return why;
    int flush = 0;
    if (cudaDeviceGetAttribute(&flush, cudaDevAttrCanFlushRemoteWrites, device_.index()) == cudaSuccess && flush)
      wait_flags_ = CU_STREAM_WAIT_VALUE_FLUSH;
    if (cudaMalloc(&base_, data_bytes_ + kFlagBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      base_ = nullptr;
      return "cudaMalloc of the receive buffer (" + std::to_string((data_bytes_ + kFlagBytes) >> 20) + " MiB) failed";
    }
    if (cudaMemset(base_, 0, data_bytes_ + kFlagBytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
      (void)cudaGetLastError();
      return "zeroing the receive buffer failed";
    }
    if (cudaIpcGetMemHandle(handle, base_) != cudaSuccess) {
      (void)cudaGetLastError();
      return "cudaIpcGetMemHandle refused the receive buffer";
    }
    return "";
  }

  // Maps the partner's block and tries one write and one wait on this device; "" or what failed.
  std::string connect(const cudaIpcMemHandle_t& peer) {
    c10::cuda::CUDAGuard guard(device_);
    if (cudaIpcOpenMemHandle(&peer_base_, peer, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      (void)cudaGetLastError();
      peer_base_ = nullptr;
      return "cudaIpcOpenMemHandle could not map the other GPU's buffer (no peer access between the GPUs?)";
    }
    copy_.emplace(c10::cuda::getStreamFromPool(false, device_.index()));
    sum_.emplace(c10::cuda::getStreamFromPool(false, device_.index()));
    cudaStream_t s = copy_->stream();
    const CUresult w = ops_.write(s, flag(base_, kArrived), 0, CU_STREAM_WRITE_VALUE_DEFAULT);
    const CUresult v = ops_.wait(s, flag(base_, kArrived), 0, CU_STREAM_WAIT_VALUE_GEQ | wait_flags_);
    if (w != CUDA_SUCCESS || v != CUDA_SUCCESS || cudaStreamSynchronize(s) != cudaSuccess) {
      (void)cudaGetLastError();
      return "the stream memory operations failed on this device";
    }
    received_ = at::from_blob(base_, {numel_}, at::TensorOptions().dtype(dtype_).device(device_));
    return "";
  }

  void begin_step() override {
    ++step_;
    first_ = true;
  }

  void exchange_and_add(Tensor piece, int64_t offset) override {
    NvtxRange range("gradient bucket by copy engine");
    TORCH_CHECK(piece.is_contiguous() && piece.scalar_type() == dtype_ && offset >= 0 &&
                    offset + piece.numel() <= numel_,
                "peer sum: a bucket outside the flat buffer");
    auto current = c10::cuda::getCurrentCUDAStream(device_.index());
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(*copy_);
    CUstream copy = copy_->stream(), sum = sum_->stream();
    if (first_) {  // the partner has read the previous step's values out of its receive buffer
      check(ops_.wait(copy, flag(base_, kConsumed), step_ - 1, CU_STREAM_WAIT_VALUE_GEQ), "wait for consumed");
      first_ = false;
    }
    char* dst = static_cast<char*>(peer_base_) + offset * piece.element_size();
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, piece.data_ptr(), piece.nbytes(), cudaMemcpyDeviceToDevice, copy_->stream()));
    ++sent_;
    check(ops_.write(copy, flag(peer_base_, kArrived), sent_, CU_STREAM_WRITE_VALUE_DEFAULT), "write arrived");
    // The add changes this rank's piece: only after the copy has read it.
    at::cuda::CUDAEvent copied;
    copied.record(*copy_);
    copied.block(*sum_);
    check(ops_.wait(sum, flag(base_, kArrived), sent_, CU_STREAM_WAIT_VALUE_GEQ | wait_flags_), "wait for arrived");
    c10::cuda::CUDAStreamGuard on_sum(*sum_);
    piece.add_(received_.narrow(0, offset, piece.numel()));
  }

  void finish_step() override {
    auto current = c10::cuda::getCurrentCUDAStream(device_.index());
    at::cuda::CUDAEvent done;
    done.record(*sum_);
    done.block(current);
    check(ops_.write(sum_->stream(), flag(peer_base_, kConsumed), step_,
                     CU_STREAM_WRITE_VALUE_DEFAULT),
          "write consumed");
  }

 private:
  CUdeviceptr flag(void* base, int64_t which) const {
    return reinterpret_cast<CUdeviceptr>(static_cast<char*>(base) + data_bytes_ + which);
  }
  static void check(CUresult r, const char* what) {
    TORCH_CHECK(r == CUDA_SUCCESS, "peer sum: ", what, " failed (CUresult ", static_cast<int>(r), ")");
  }

  at::Device device_;
  at::ScalarType dtype_ = at::kFloat;
  int64_t numel_ = 0, data_bytes_ = 0;
  StreamOps ops_;
  unsigned int wait_flags_ = 0;
  void* base_ = nullptr;       // this rank's block: the receive buffer, then the flags
  void* peer_base_ = nullptr;  // the partner's block, mapped here
  std::optional<c10::cuda::CUDAStream> copy_, sum_;
  Tensor received_;
  cuuint32_t step_ = 0, sent_ = 0;
  bool first_ = false;
};

}  // namespace
#endif

std::unique_ptr<PeerSum> PeerSum::open(Communicator& comm, const Tensor& like, std::string* why) {
  auto fail = [&](std::string reason) -> std::unique_ptr<PeerSum> {
    if (why) *why = std::move(reason);
    return nullptr;
  };
  if (comm.size() != 2) return fail("it needs two ranks; the communicator has " + std::to_string(comm.size()));
  if (comm.backend() != "nccl" || !like.is_cuda())
    return fail("it needs the NCCL backend and CUDA tensors (backend " + comm.backend() + ")");
#ifndef CARRY_HAVE_PEER_SUM
  return fail("carry was built without CUDA");
#else
  const int other = 1 - comm.rank();
  auto sum = std::make_unique<CopyEnginePeerSum>(like.device(), like.numel(), like.element_size());
  // Round 1: each rank's status byte and handle; round 2: whether each mapped the other's.
  constexpr int64_t kHandle = sizeof(cudaIpcMemHandle_t);
  auto mine = at::zeros({1 + kHandle}, at::kByte), theirs = at::zeros({1 + kHandle}, at::kByte);
  cudaIpcMemHandle_t handle{};
  std::string local = sum->prepare(&handle, like.scalar_type());
  mine.data_ptr<uint8_t>()[0] = local.empty() ? 1 : 0;
  std::memcpy(mine.data_ptr<uint8_t>() + 1, &handle, kHandle);
  {
    CommContext ctx("peer sum: exchanging the receive buffers' IPC handles");
    comm.send_recv(mine, other, theirs, other);
  }
  if (local.empty() && theirs.data_ptr<uint8_t>()[0] == 0) local = "the other rank could not share its buffer";
  if (local.empty()) {
    std::memcpy(&handle, theirs.data_ptr<uint8_t>() + 1, kHandle);
    local = sum->connect(handle);
  }
  auto ok = at::full({1}, local.empty() ? 1 : 0, at::kByte), peer_ok = at::zeros({1}, at::kByte);
  {
    CommContext ctx("peer sum: agreeing whether both GPUs mapped the other's buffer");
    comm.send_recv(ok, other, peer_ok, other);
  }
  if (!local.empty()) return fail(local);
  if (peer_ok.data_ptr<uint8_t>()[0] == 0) return fail("the other rank could not map this rank's buffer");
  return sum;
#endif
}

}  // namespace carry::parallel
