// Process groups: the MPI bootstrap, the dp × sp grid of ranks, and the Communicator interface with
// its backends (MPI for CPU tensors here; NCCL for CUDA tensors in nccl_backend.cpp, built when
// CUDA and nccl.h are present).
//
// The one rule every backend keeps: no rank waits forever. Every blocking operation is a
// nonblocking call polled against a timeout (CommOptions::timeout_s, default from
// CARRY_COMM_TIMEOUT_S or 300 s); on timeout the error names the operation, this rank and the peer
// ranks, and then either the whole job stops (MPI_Abort, the default, so no other rank hangs
// either) or, for tests and callers that recover, a CommError is thrown and the communicator
// refuses further work.
//
// Grid: world = dp × sp ranks; an sp group is `sp` consecutive ranks (same host first), so
// sp_rank = world_rank % sp and dp_rank = world_rank / sp; a dp group joins the ranks with the same
// sp_rank.
#pragma once

#include <ATen/ATen.h>
#include <mpi.h>

#include <memory>
#include <stdexcept>
#include <map>
#include <string>
#include <vector>

namespace carry::parallel {

using at::Tensor;

// ---- MPI bootstrap ----

// Initializes MPI (MPI_Init_thread asking for MPI_THREAD_MULTIPLE, at least MPI_THREAD_SERIALIZED
// required, since autograd may run a backward on another thread) unless it already is. Idempotent.
void init_mpi(int* argc = nullptr, char*** argv = nullptr);
// MPI_Finalize if we initialized MPI and nobody finalized it yet.
void finalize_mpi();

struct WorldInfo {
  int rank = 0, size = 1;              // in MPI_COMM_WORLD
  int local_rank = 0, local_size = 1;  // among the ranks on this host (MPI_COMM_TYPE_SHARED)
  std::string host;
};
// Calls init_mpi() first; computed once. Without an MPI world, from the launcher's variables.
const WorldInfo& world_info();

// Whether this process was started without MPI, by torchrun or srun (parallel/launch_env.h): then
// init_mpi() reads the rank, world size and local rank from their variables and starts no MPI, the
// ranks meet through the TCP store on MASTER_ADDR:MASTER_PORT (parallel/tcp_store.h), and
// make_process_groups builds its communicators over it (CPU) or bootstraps NCCL through it (GPU).
bool store_world();
// The maximum and minimum of `v` over the world's ranks (collective: every rank calls it).
int world_max(int v);
int world_min(int v);
// Ends the whole job after a failure on this rank: MPI_Abort, or without MPI this process exits (the
// other ranks' waits on it then fail with a message naming it).
[[noreturn]] void abort_world(int code);

// ---- Communicators ----

// The default timeout: CARRY_COMM_TIMEOUT_S if set (seconds, > 0), else 300.
double default_comm_timeout_s();

struct CommOptions {
  double timeout_s = -1;  // <= 0: default_comm_timeout_s()
  // On timeout: abort the whole job (default) or throw CommError (tests, callers that recover).
  enum class OnTimeout { abort, throw_error } on_timeout = OnTimeout::abort;
  std::string name = "world";  // shown in error messages: "world", "sp", "dp", ...
  // NCCL backend: small point-to-point messages between neighbouring ranks (r and r ± 1) of one host go
  // by the copy engines into a ring the receiver shares by CUDA IPC, signalled by stream memory
  // operations (no kernel on an SM, no NCCL call), where both GPUs allow it; NCCL otherwise. In
  // make_process_groups' options it applies to the sp group alone (parallel.sp_messages: COPY).
  bool copy_engine_neighbours = false;
};

// A communication failure: a timeout, or any operation on a communicator that already timed out.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// While alive, adds a line of context ("ordered scan forward of gla: S_in from the previous rank")
// to every communication error raised on this thread.
class CommContext {
 public:
  explicit CommContext(std::string what);
  ~CommContext();
  CommContext(const CommContext&) = delete;
  CommContext& operator=(const CommContext&) = delete;
};

// Ranks are ranks of this communicator (0..size-1). Tensors may live on any device: a backend
// stages them through its own device when needed (MPI: host memory; NCCL: its GPU). Collective calls
// must be made by every rank of the communicator in the same order. MPI calls block until the data
// has arrived or left this rank's buffers. NCCL calls on CUDA tensors return once the operation is
// enqueued: what the caller enqueues afterwards on its current CUDA stream sees the received data
// (a send alone does not hold that stream back: it sends a copy), host reads (.cpu(), .item())
// synchronize as usual, and a watchdog thread enforces the timeout.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int world_rank_of(int rank) const = 0;
  virtual std::string backend() const = 0;  // "mpi", "nccl"
  virtual at::Device device() const = 0;    // where tensors travel without staging
  virtual const CommOptions& options() const = 0;

  // Point to point. `recv` fills `t` (its shape and dtype say what is expected).
  // Both are send_recv with one side empty.
  void send(const Tensor& t, int dst, int tag = 0);
  void recv(Tensor& t, int src, int tag = 0);
  // Sends `out` to `dst` while receiving `in` from `src` (either may be -1: none), so that shifts
  // and rings cannot deadlock.
  virtual void send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag = 0) = 0;
  // Collectives. all_gather returns size() tensors shaped like `t`, entry i from rank i.
  virtual std::vector<Tensor> all_gather(const Tensor& t) = 0;
  virtual void all_reduce_sum(Tensor& t) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  // Collectives on `flat`, a 1-D contiguous buffer of size() equal pieces, piece i being elements
  // [i·n/size(), (i+1)·n/size()), in place. reduce_scatter_sum: this rank's piece (piece rank())
  // becomes the sum over the ranks of their copies of it; the other pieces are left unspecified.
  // all_gather_pieces: piece i of every rank's `flat` becomes rank i's. The base forms run on
  // all_reduce_sum and all_gather (the sum is all_reduce_sum's); NCCL runs its reduce-scatter and
  // all-gather, which move half of an all-reduce's bytes each.
  virtual void reduce_scatter_sum(Tensor& flat);
  virtual void all_gather_pieces(Tensor& flat);
  // Blocks until every operation this rank has started has completed, and raises a failure found
  // meanwhile (as CommOptions say). Backends whose calls complete before they return (MPI) do nothing.
  virtual void synchronize() {}
  // Waiting time, measured when turned on (NCCL; other backends measure nothing and return 0): for each
  // operation the caller's stream waits for (a receive, a collective), the GPU time from the caller's
  // stream reaching it to its completion, which is how long that stream stood still when it needs the
  // data at once (as the ordered chain does). take_waited_seconds() returns the sum since the last call,
  // over completed operations: call synchronize() first for all of them.
  virtual void set_wait_timing(bool) {}
  virtual double take_waited_seconds() { return 0; }
  // The same waits by kind of message (message_kind) since the last call, in seconds.
  // take_waited_seconds() does not clear it, nor it take_waited_seconds().
  virtual std::map<std::string, double> take_waits_by_kind() { return {}; }
  // The same waits one by one, in the order their operations were enqueued, since the last call (at most
  // the last 4096): (message_kind, seconds). Cleared only by this call.
  virtual std::vector<std::pair<std::string, double>> take_wait_sequence() { return {}; }
  // The host's side of the same operations, measured when wait timing is on (NCCL): how many were
  // enqueued since the last call and the host seconds spent enqueuing them (until the backend had
  // queued its kernels on its stream), which the host does not spend running ahead of the GPU.
  struct HostCalls {
    long count = 0;
    double seconds = 0;
    long by_copy_engines = 0;  // of `count`: the messages that went by the copy engines
  };
  virtual HostCalls take_host_calls() { return {}; }
};

// The kind of a message for take_waits_by_kind: its innermost CommContext line with digits as '#', a
// scan's "sequence-parallel <mode> scan of <family> over sp=P ranks: <message>" shortened to
// "<family>: <message>" ("gated_deltanet: ordered forward, state of head group # from the previous
// rank", "halo exchange forward: last tokens to the next rank").
std::string message_kind(const std::string& line);

// A communicator over a duplicate of `comm` (MPI_Comm_idup, so it never shares message matching
// with other users of `comm`). Collective over `comm`.
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, CommOptions opt = {});
// An NCCL communicator over the ranks of `comm` on CUDA device `device` (one GPU a rank): rank 0
// creates the NCCL id and broadcasts it over MPI. Throws on builds without CUDA or nccl.h.
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, int device,
                                                     CommOptions opt = {});
// The same over the ranks of `boot` (any communicator: the TCP store's when there is no MPI world),
// which keeps carrying the host tensors' messages.
std::shared_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> boot, int device,
                                                     CommOptions opt = {});
bool nccl_available();  // compiled in (says nothing about GPUs being present)

// ---- Lists of tensors as single messages ----

// Known layout: the receiver passes tensors of the right shapes and dtypes (e.g. a zero_state) and
// gets freshly received tensors of the same layout. Undefined entries are skipped on both sides.
void send_tensors(Communicator& comm, const std::vector<Tensor>& ts, int dst, int tag = 0);
std::vector<Tensor> recv_tensors(Communicator& comm, const std::vector<Tensor>& like, int src,
                                 int tag = 0);
// Self-describing: the number of tensors, their dtypes and shapes travel first (undefined entries
// stay undefined), so the receiver needs no template.
void send_packed(Communicator& comm, const std::vector<Tensor>& ts, int dst, int tag = 0);
std::vector<Tensor> recv_packed(Communicator& comm, int src, const at::TensorOptions& device_of,
                                int tag = 0);
// Both at once (send_recv): sends `ts` to `dst`, returns the list from `src` (either may be -1).
std::vector<Tensor> exchange_packed(Communicator& comm, const std::vector<Tensor>& ts, int dst,
                                    int src, const at::TensorOptions& device_of, int tag = 0);
// Every rank's list, entry i from rank i; lists may differ in layout between ranks. Received
// tensors are placed on the device of `device_of`.
std::vector<std::vector<Tensor>> all_gather_packed(Communicator& comm,
                                                   const std::vector<Tensor>& ts,
                                                   const at::TensorOptions& device_of);

// ---- The dp × sp grid ----

enum class Backend { mpi, nccl };

struct ParallelLayout {
  int dp = 1;  // data-parallel replicas
  int sp = 1;  // ranks sharing one sequence
};

struct ProcessGroups {
  WorldInfo world_info;
  ParallelLayout layout;
  int dp_rank = 0, sp_rank = 0;
  std::shared_ptr<Communicator> world, sp, dp;
  // The sp group again, for the weight gradients summed while the backward runs
  // (parallel/gradient_sum.h): a communicator (NCCL: a stream) of their own, so the state chain's
  // messages never queue behind them. Null when sp = 1.
  std::shared_ptr<Communicator> sp_gradients;
};

// Checks dp·sp == world size (the same clear error on every rank otherwise), then builds the world,
// sp and dp communicators. For Backend::nccl, every rank uses CUDA device local_rank.
ProcessGroups make_process_groups(ParallelLayout layout, Backend backend = Backend::mpi,
                                  CommOptions opt = {});

namespace detail {
// The message of a communication error: the operation, this rank, the peers, the context lines
// (this thread's CommContext lines, or `context` when given: those captured where the operation
// was started, for a failure found on another thread).
std::string comm_error_message(const Communicator& comm, const std::string& op,
                               const std::vector<int>& peers, const std::string& why,
                               const std::vector<std::string>* context = nullptr);
// This thread's CommContext lines, outermost first.
std::vector<std::string> comm_context_lines();
// Handles a failure as the communicator's options say: print and MPI_Abort, or throw CommError.
[[noreturn]] void comm_fail(const Communicator& comm, const std::string& message);
}  // namespace detail

}  // namespace carry::parallel
