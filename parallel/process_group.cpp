// The MPI bootstrap, the MPI backend of the Communicator interface, lists of tensors as messages,
// and the dp × sp grid (see process_group.h). Every MPI call that waits is nonblocking (MPI_Issend,
// MPI_Irecv, MPI_Iallgather, MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier, MPI_Comm_idup) and is polled
// against the communicator's timeout; sends are synchronous-mode so that a send, like a receive,
// completes only once its peer takes part (a missing receiver is then caught too).
#include "parallel/process_group.h"
#include "layers/core/knobs.h"
#include "parallel/launch_env.h"
#include "parallel/tcp_store.h"

#include "layers/core/nvtx.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <thread>

#include <unistd.h>

namespace carry::parallel {

void Communicator::send(const Tensor& t, int dst, int tag) {
  Tensor none;
  send_recv(t, dst, none, -1, tag);
}

void Communicator::recv(Tensor& t, int src, int tag) { send_recv(Tensor(), -1, t, src, tag); }

namespace {
// The piece length of `flat` for reduce_scatter_sum and all_gather_pieces, after checking its shape.
int64_t piece_length(const Tensor& flat, int ranks, const char* op) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous() && flat.numel() % ranks == 0, op,
              ": expected a contiguous 1-D buffer of ", ranks, " equal pieces, got shape ", flat.sizes(),
              flat.is_contiguous() ? "" : " (not contiguous)");
  return flat.numel() / ranks;
}
}  // namespace

void Communicator::reduce_scatter_sum(Tensor& flat) {
  piece_length(flat, size(), "reduce_scatter_sum");
  all_reduce_sum(flat);
}

void Communicator::all_gather_pieces(Tensor& flat) {
  const int64_t n = piece_length(flat, size(), "all_gather_pieces");
  auto all = all_gather(flat.narrow(0, rank() * n, n));
  for (int r = 0; r < size(); ++r)
    if (r != rank()) flat.narrow(0, r * n, n).copy_(all[r]);
}

namespace {

bool g_we_initialized = false;
WorldInfo g_world;
bool g_world_ready = false;

thread_local std::vector<std::string> t_context;

std::string join_ints(const std::vector<int>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str();
}

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, len);
}

// Polls `reqs` until all complete (true) or `timeout_s` passes (false). Yields, then sleeps with a
// growing pause, so that waiting ranks leave the cores to working ones. MPI errors go to
// `on_error`.
template <class OnError>
bool poll_requests(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>& st, double timeout_s,
                   OnError on_error) {
  using clock = std::chrono::steady_clock;
  st.resize(reqs.size());
  auto start = clock::now();
  int spins = 0;
  auto pause = std::chrono::microseconds(5);
  for (;;) {
    int done = 0;
    int rc = MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, st.data());
    if (rc != MPI_SUCCESS) {
      std::string why = mpi_error_string(rc);
      if (rc == MPI_ERR_IN_STATUS)
        for (auto& s : st)
          if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING)
            why = mpi_error_string(s.MPI_ERROR);
      on_error(why);
    }
    if (done) return true;
    if (std::chrono::duration<double>(clock::now() - start).count() > timeout_s) return false;
    if (++spins < 200) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
  }
}

constexpr int64_t kMaxPiece = int64_t{1} << 30;  // bytes per MPI call (counts are int)

MPI_Datatype mpi_type_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return MPI_DOUBLE;
    case at::kFloat:
      return MPI_FLOAT;
    case at::kLong:
      return MPI_INT64_T;
    case at::kInt:
      return MPI_INT32_T;
    case at::kShort:
      return MPI_INT16_T;
    case at::kChar:
      return MPI_INT8_T;
    case at::kByte:
      return MPI_UINT8_T;
    default:
      return MPI_DATATYPE_NULL;
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, CommOptions opt) : comm_(comm), opt_(std::move(opt)) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Group group, world_group;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> mine(size_);
    for (int i = 0; i < size_; ++i) mine[i] = i;
    world_ranks_.resize(size_);
    MPI_Group_translate_ranks(group, size_, mine.data(), world_group, world_ranks_.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
  }

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& r : abandoned_) {
      int done = 0;
      if (r != MPI_REQUEST_NULL) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    }
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank_of(int r) const override { return world_ranks_.at(r); }
  std::string backend() const override { return "mpi"; }
  at::Device device() const override { return at::kCPU; }
  const CommOptions& options() const override { return opt_; }

  void send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag) override {
    NvtxRange range("send_recv " + opt_.name);
    std::string op;
    std::vector<int> peers;
    if (dst >= 0) {
      check_peer(dst, "send");
      op = op_name("send", out.nbytes(), tag, "to", dst);
      peers.push_back(dst);
    }
    if (src >= 0) {
      check_peer(src, "recv");
      op += std::string(op.empty() ? "" : " and ") + op_name("recv", in.nbytes(), tag, "from", src);
      if (src != dst) peers.push_back(src);
    }
    if (peers.empty()) return;
    enter(op, peers);
    std::vector<MPI_Request> reqs;
    std::vector<int> expect;  // bytes of each receive piece; -1 for send pieces
    bool direct = src < 0 || (in.device().is_cpu() && in.is_contiguous());
    Tensor rbuf = src < 0  ? Tensor()
                  : direct ? in
                           : at::empty(in.sizes(), in.options().device(at::kCPU));
    if (src >= 0) post(rbuf, src, tag, /*send=*/false, reqs, expect, op, peers);
    Tensor sbuf = dst < 0 ? Tensor() : host_contiguous(out);
    if (dst >= 0) post(sbuf, dst, tag, /*send=*/true, reqs, expect, op, peers);
    auto st = wait(reqs, op, peers, /*p2p=*/true);
    for (size_t i = 0; i < st.size(); ++i) {
      if (expect[i] < 0) continue;
      int got = 0;
      MPI_Get_count(&st[i], MPI_BYTE, &got);
      if (got != expect[i])
        fail(detail::comm_error_message(*this, op, peers,
                                        "message size mismatch: expected " +
                                            std::to_string(expect[i]) + " bytes, got " +
                                            std::to_string(got)));
    }
    if (src >= 0 && !direct) in.copy_(rbuf);
  }

  std::vector<Tensor> all_gather(const Tensor& t) override {
    NvtxRange range("all_gather " + opt_.name);
    enter("all_gather", all_peers());
    Tensor buf = host_contiguous(t);
    TORCH_CHECK(buf.nbytes() < INT_MAX, "all_gather of ", buf.nbytes(),
                " bytes a rank is more than the MPI backend moves in one call");
    auto sizes = t.sizes().vec();
    sizes.insert(sizes.begin(), size_);
    Tensor out = at::empty(sizes, buf.options());
    std::vector<MPI_Request> reqs(1);
    int n = static_cast<int>(buf.nbytes());
    call(MPI_Iallgather(buf.data_ptr(), n, MPI_BYTE, out.data_ptr(), n, MPI_BYTE, comm_, &reqs[0]),
         "all_gather", all_peers());
    wait(reqs, op_name("all_gather", buf.nbytes(), -1, "", -1), all_peers(), false);
    if (!t.device().is_cpu()) out = out.to(t.device());
    return out.unbind(0);
  }

  void all_reduce_sum(Tensor& t) override {
    NvtxRange range("all_reduce_sum " + opt_.name);
    enter("all_reduce_sum", all_peers());
    MPI_Datatype type = mpi_type_of(t.scalar_type());
    bool widen = type == MPI_DATATYPE_NULL;  // half, bfloat16, ...: reduce in fp32
    TORCH_CHECK(!widen || at::isFloatingType(t.scalar_type()), "all_reduce_sum: dtype ",
                t.scalar_type(), " is not supported by the MPI backend");
    Tensor buf = widen ? t.to(t.options().device(at::kCPU).dtype(at::kFloat)).contiguous()
                       : host_contiguous(t).clone();
    if (widen) type = MPI_FLOAT;
    int64_t elem = buf.element_size(), n = buf.numel(), step = kMaxPiece / elem;
    for (int64_t off = 0; off < n; off += step) {
      std::vector<MPI_Request> reqs(1);
      int len = static_cast<int>(std::min(step, n - off));
      call(MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(buf.data_ptr()) + off * elem, len, type,
                          MPI_SUM, comm_, &reqs[0]),
           "all_reduce_sum", all_peers());
      wait(reqs, op_name("all_reduce_sum", buf.nbytes(), -1, "", -1), all_peers(), false);
    }
    t.copy_(buf);
  }

  void broadcast(Tensor& t, int root) override {
    NvtxRange range("broadcast " + opt_.name);
    enter("broadcast", {root});
    check_peer(root, "broadcast");
    bool direct = t.device().is_cpu() && t.is_contiguous();
    Tensor buf = direct ? t : host_contiguous(t).clone();
    auto* p = static_cast<char*>(buf.data_ptr());
    for (int64_t off = 0, n = buf.nbytes(); off < n; off += kMaxPiece) {
      std::vector<MPI_Request> reqs(1);
      int len = static_cast<int>(std::min(kMaxPiece, n - off));
      call(MPI_Ibcast(p + off, len, MPI_BYTE, root, comm_, &reqs[0]), "broadcast", {root});
      wait(reqs, op_name("broadcast", buf.nbytes(), -1, "from root", root), all_peers(), false);
    }
    if (!direct) t.copy_(buf);
  }

  void barrier() override {
    NvtxRange range("barrier " + opt_.name);
    enter("barrier", all_peers());
    std::vector<MPI_Request> reqs(1);
    call(MPI_Ibarrier(comm_, &reqs[0]), "barrier", all_peers());
    wait(reqs, "barrier", all_peers(), false);
  }

 private:
  // Posts a synchronous-mode send or a receive of `buf`'s bytes, in pieces MPI counts can hold (a
  // zero-byte message is still posted, so both sides always match).
  void post(const Tensor& buf, int peer, int tag, bool send, std::vector<MPI_Request>& reqs,
            std::vector<int>& expect, const std::string& op, const std::vector<int>& peers) {
    auto* p = static_cast<char*>(buf.data_ptr());
    int64_t n = buf.nbytes();
    for (int64_t off = 0; off < n || off == 0; off += kMaxPiece) {
      int len = static_cast<int>(std::min(kMaxPiece, n - off));
      reqs.emplace_back();
      expect.push_back(send ? -1 : len);
      int rc = send ? MPI_Issend(p + off, len, MPI_BYTE, peer, tag, comm_, &reqs.back())
                    : MPI_Irecv(p + off, len, MPI_BYTE, peer, tag, comm_, &reqs.back());
      call(rc, op.c_str(), peers);
      if (n == 0) break;
    }
  }

  static Tensor host_contiguous(const Tensor& t) {
    return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  }

  std::vector<int> all_peers() const {
    std::vector<int> p;
    for (int i = 0; i < size_; ++i)
      if (i != rank_) p.push_back(i);
    return p;
  }

  std::string op_name(const char* op, int64_t bytes, int tag, const char* dir, int peer) const {
    std::ostringstream s;
    s << op << " of " << bytes << " bytes";
    if (tag >= 0) s << " (tag " << tag << ")";
    if (peer >= 0) s << " " << dir << " rank " << peer;
    return s.str();
  }

  void check_peer(int peer, const char* op) const {
    TORCH_CHECK(peer >= 0 && peer < size_, op, ": peer rank ", peer,
                " is not a rank of communicator '", opt_.name, "' (ranks 0..", size_ - 1,
                ", this is rank ", rank_, ")");
  }

  // Refuses work after an earlier failure.
  void enter(const std::string& op, const std::vector<int>& peers) const {
    if (!broken_.empty())
      fail(detail::comm_error_message(
          *this, op, peers, "communicator unusable after an earlier failure (" + broken_ + ")"));
  }

  void call(int rc, const char* op, const std::vector<int>& peers) {
    if (rc != MPI_SUCCESS) fail(detail::comm_error_message(*this, op, peers, mpi_error_string(rc)));
  }

  std::vector<MPI_Status> wait(std::vector<MPI_Request>& reqs, const std::string& op,
                               const std::vector<int>& peers, bool p2p) {
    std::vector<MPI_Status> st;
    bool ok = poll_requests(reqs, st, timeout_s(), [&](const std::string& why) {
      fail(detail::comm_error_message(*this, op, peers, "MPI error: " + why));
    });
    if (ok) return st;
    std::ostringstream why;
    why << "timeout after " << timeout_s() << " s";
    std::string msg = detail::comm_error_message(*this, op, peers, why.str());
    if (opt_.on_timeout == CommOptions::OnTimeout::throw_error) {
      // Leave MPI clean enough to go on: cancel what can be cancelled (receives), free
      // point-to-point requests, keep collective ones (they may be neither cancelled nor freed).
      for (auto& r : reqs) {
        if (r == MPI_REQUEST_NULL) continue;
        if (p2p) {
          MPI_Cancel(&r);
          int done = 0;
          MPI_Test(&r, &done, MPI_STATUS_IGNORE);
          if (!done) MPI_Request_free(&r);
        } else {
          abandoned_.push_back(r);
        }
      }
      broken_ = op + " timed out";
    }
    fail(msg);
  }

  [[noreturn]] void fail(const std::string& msg) const { detail::comm_fail(*this, msg); }

  double timeout_s() const {
    return opt_.timeout_s > 0 ? opt_.timeout_s : default_comm_timeout_s();
  }

  MPI_Comm comm_;
  CommOptions opt_;
  int rank_ = 0, size_ = 1;
  std::vector<int> world_ranks_;
  std::string broken_;
  std::vector<MPI_Request> abandoned_;
};

}  // namespace

// ---- bootstrap ----

bool store_world() {
  static const bool without_mpi = [] {
    const auto kind = read_launch_env().kind;
    return kind == LaunchEnv::Kind::torchrun || kind == LaunchEnv::Kind::slurm;
  }();
  return without_mpi;
}

namespace {
// The world over the TCP store, for the setup's own collectives (world_max, the final barrier).
std::shared_ptr<Communicator> store_world_comm() {
  static std::shared_ptr<Communicator> comm;
  if (!comm) {
    std::vector<int> all(static_cast<size_t>(world_info().size));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
    CommOptions o;
    o.name = "world setup";
    comm = make_store_communicator(launch_store(), all, world_info().rank, o);
  }
  return comm;
}
}  // namespace

void init_mpi(int* argc, char*** argv) {
  if (store_world()) {  // torchrun or srun without MPI: the launcher's variables, no MPI at all
    if (!g_world_ready) {
      const LaunchEnv e = read_launch_env();
      g_world.rank = e.rank, g_world.size = e.size, g_world.local_rank = e.local_rank, g_world.local_size = e.local_size;
      char name[256] = {};
      ::gethostname(name, sizeof name - 1);
      g_world.host = name;
      g_world_ready = true;
      if (g_world.size > 1) launch_store();  // rank 0 starts listening; everyone connects (or fails here)
    }
    return;
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    TORCH_CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed: ", mpi_error_string(rc));
    g_we_initialized = true;
    TORCH_CHECK(
        provided >= MPI_THREAD_SERIALIZED, "MPI provides thread level ", provided,
        " but carry needs at least MPI_THREAD_SERIALIZED (autograd may call it from another "
        "thread); use an MPI built with thread support");
  }
  if (!g_world_ready) {
    MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world.size);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_world.rank, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &g_world.local_rank);
    MPI_Comm_size(local, &g_world.local_size);
    MPI_Comm_free(&local);
    char name[MPI_MAX_PROCESSOR_NAME];
    int len = 0;
    MPI_Get_processor_name(name, &len);
    g_world.host.assign(name, len);
    g_world_ready = true;
  }
}

void finalize_mpi() {
  if (store_world()) {
    // Rank 0 serves the store: it stays until every other rank has made its last request (an add whose
    // answer it has read, or missed because rank 0 was already gone, which is then harmless).
    static bool done = false;
    if (!done && g_world_ready && g_world.size > 1) {
      done = true;
      try {
        auto store = launch_store();
        if (g_world.rank != 0) {
          try {
            store->add("carry/finished", 1);
          } catch (const std::exception&) {
          }
        } else {
          const auto start = std::chrono::steady_clock::now();
          while (store->add("carry/finished", 0) < g_world.size - 1 &&
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < default_comm_timeout_s())
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the last answers leave the socket
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "carry: rank %d: the last exchange over the TCP store failed: %s\n", g_world.rank, e.what());
      }
    }
    return;
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized && g_we_initialized) MPI_Finalize();
}

const WorldInfo& world_info() {
  init_mpi();
  return g_world;
}

int world_max(int v) {
  if (world_info().size == 1) return v;
  if (store_world()) {
    auto t = at::full({1}, v, at::kInt);
    int out = v;
    for (auto& x : store_world_comm()->all_gather(t)) out = std::max(out, x.item<int>());
    return out;
  }
  int out = v;
  MPI_Allreduce(&v, &out, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

int world_min(int v) { return -world_max(-v); }

void abort_world(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (!store_world()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

double default_comm_timeout_s() {
  if (const char* e = knob_value("CARRY_COMM_TIMEOUT_S")) {
    char* end = nullptr;
    double v = std::strtod(e, &end);
    TORCH_CHECK(end != e && *end == '\0' && v > 0,
                "CARRY_COMM_TIMEOUT_S must be a positive number of seconds, got '", e, "'");
    return v;
  }
  return 300;
}

CommContext::CommContext(std::string what) { t_context.push_back(std::move(what)); }
CommContext::~CommContext() { t_context.pop_back(); }

std::string message_kind(const std::string& line) {
  std::string s = line;
  // "sequence-parallel ordered scan of <family> over sp=P ranks: <message>": the message, with the
  // family named once in front.
  const std::string scan = "sequence-parallel ";
  if (s.rfind(scan, 0) == 0) {
    const auto colon = s.find(": ");
    const auto of = s.find(" scan of ");
    if (colon != std::string::npos && of != std::string::npos && of < colon) {
      const auto over = s.find(" over ", of);
      const std::string family = s.substr(of + 9, (over == std::string::npos || over > colon ? colon : over) - of - 9);
      s = family + ": " + s.substr(colon + 2);
    }
  }
  std::string out;
  for (char c : s) {
    if (c >= '0' && c <= '9') {
      if (out.empty() || out.back() != '#') out += '#';
    } else {
      out += c;
    }
  }
  return out;
}

namespace detail {

std::vector<std::string> comm_context_lines() { return t_context; }

std::string comm_error_message(const Communicator& comm, const std::string& op,
                               const std::vector<int>& peers, const std::string& why,
                               const std::vector<std::string>* context) {
  const std::vector<std::string>& lines = context ? *context : t_context;
  const auto& w = world_info();
  std::vector<int> world_peers;
  for (int p : peers) world_peers.push_back(comm.world_rank_of(p));
  std::ostringstream s;
  s << "carry: communication failure: " << why << " in " << op << " on rank " << comm.rank()
    << " of communicator '" << comm.options().name << "' (" << comm.size() << " ranks, "
    << comm.backend() << "; world rank " << w.rank << " on host " << w.host << ")";
  if (!peers.empty())
    s << "; waiting for peer rank(s) " << join_ints(peers) << " (world rank(s) "
      << join_ints(world_peers) << ")";
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) s << "\n  while: " << *it;
  s << "\n  A peer rank probably failed, exited, or waits in a different operation. Timeout: "
    << (comm.options().timeout_s > 0 ? comm.options().timeout_s : default_comm_timeout_s())
    << " s (CommOptions::timeout_s or CARRY_COMM_TIMEOUT_S).";
  return s.str();
}

void comm_fail(const Communicator& comm, const std::string& message) {
  if (comm.options().on_timeout == CommOptions::OnTimeout::throw_error) throw CommError(message);
  std::fprintf(stderr, "%s\n  Aborting the job (%s) so that no rank hangs.\n", message.c_str(),
               store_world() ? "this rank exits; the others' waits on it fail" : "MPI_Abort");
  abort_world(3);
}

}  // namespace detail

// ---- communicators ----

std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, CommOptions opt) {
  TORCH_CHECK(!store_world(), "communicator '", opt.name, "': this process was started by ",
              launch_kind_name(read_launch_env().kind), " without MPI, so it has no MPI world (start it with mpirun "
              "for MPI communicators; carry's own commands build theirs over the TCP store)");
  init_mpi();
  // Before the duplication starts: a bad CARRY_COMM_TIMEOUT_S throws here, not while an MPI_Comm_idup
  // is in flight (MPI_Finalize then crashed freeing the half-made communicator, now and then).
  const double timeout = opt.timeout_s > 0 ? opt.timeout_s : default_comm_timeout_s();
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(comm, &dup, &req);
  TORCH_CHECK(rc == MPI_SUCCESS, "MPI_Comm_idup failed: ", mpi_error_string(rc));
  std::vector<MPI_Request> reqs{req};
  std::vector<MPI_Status> st;
  std::string err;
  bool ok = poll_requests(reqs, st, timeout, [&](const std::string& why) { err = why; });
  if (!ok || !err.empty()) {
    int r = 0, n = 0;
    MPI_Comm_rank(comm, &r);
    MPI_Comm_size(comm, &n);
    std::ostringstream s;
    s << "carry: communication failure: "
      << (ok ? err : "timeout after " + std::to_string(timeout) + " s")
      << " in creating communicator '" << opt.name << "' (MPI_Comm_idup) on rank " << r << " of "
      << n << " (world rank " << world_info().rank << "); every rank of the parent must take part";
    if (opt.on_timeout == CommOptions::OnTimeout::throw_error) throw CommError(s.str());
    std::fprintf(stderr, "%s\n  Aborting the job (MPI_Abort).\n", s.str().c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  return std::make_shared<MpiCommunicator>(dup, std::move(opt));
}

// ---- lists of tensors ----

namespace {

int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }

// Byte offsets of each defined tensor in a packed buffer (16-byte aligned); returns the total.
int64_t layout_bytes(const std::vector<Tensor>& ts, std::vector<int64_t>& offsets) {
  int64_t total = 0;
  offsets.clear();
  for (auto& t : ts) {
    if (!t.defined()) {
      offsets.push_back(-1);
      continue;
    }
    total = align16(total);
    offsets.push_back(total);
    total += t.numel() * t.element_size();
  }
  return total;
}

at::Device device_of_list(const std::vector<Tensor>& ts) {
  for (auto& t : ts)
    if (t.defined()) return t.device();
  return at::kCPU;
}

Tensor pack_bytes(const std::vector<Tensor>& ts, at::Device device) {
  std::vector<int64_t> off;
  int64_t total = layout_bytes(ts, off);
  Tensor buf = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!ts[i].defined() || ts[i].numel() == 0) continue;
    int64_t n = ts[i].numel() * ts[i].element_size();
    buf.narrow(0, off[i], n).copy_(ts[i].detach().contiguous().reshape(-1).view(at::kByte));
  }
  return buf;
}

// Views of `buf` laid out like `like` (dtypes and shapes); undefined stays undefined.
std::vector<Tensor> unpack_bytes(const Tensor& buf, const std::vector<Tensor>& like) {
  std::vector<int64_t> off;
  layout_bytes(like, off);
  std::vector<Tensor> out;
  for (size_t i = 0; i < like.size(); ++i) {
    if (!like[i].defined()) {
      out.emplace_back();
      continue;
    }
    auto opt = like[i].options().device(buf.device());
    if (like[i].numel() == 0) {
      out.push_back(at::empty(like[i].sizes(), opt));
      continue;
    }
    int64_t n = like[i].numel() * like[i].element_size();
    out.push_back(buf.narrow(0, off[i], n).view(like[i].scalar_type()).view(like[i].sizes()));
  }
  return out;
}

// Header: [count, then per tensor: defined, dtype, ndim, sizes...].
Tensor make_header(const std::vector<Tensor>& ts) {
  std::vector<int64_t> h{static_cast<int64_t>(ts.size())};
  for (auto& t : ts) {
    h.push_back(t.defined());
    if (!t.defined()) continue;
    h.push_back(static_cast<int64_t>(t.scalar_type()));
    h.push_back(t.dim());
    for (auto s : t.sizes()) h.push_back(s);
  }
  return at::tensor(h, at::kLong);
}

// Meta tensors with the header's dtypes and shapes (undefined entries undefined).
std::vector<Tensor> parse_header(const Tensor& header) {
  auto h = header.contiguous();
  const int64_t* p = h.data_ptr<int64_t>();
  int64_t n = h.numel(), i = 0;
  auto next = [&] {
    TORCH_INTERNAL_ASSERT(i < n, "malformed tensor-list header");
    return p[i++];
  };
  int64_t count = next();
  std::vector<Tensor> like;
  for (int64_t k = 0; k < count; ++k) {
    if (!next()) {
      like.emplace_back();
      continue;
    }
    auto dtype = static_cast<at::ScalarType>(next());
    int64_t dim = next();
    std::vector<int64_t> sizes;
    for (int64_t d = 0; d < dim; ++d) sizes.push_back(next());
    like.push_back(at::empty(sizes, at::TensorOptions().dtype(dtype).device(at::kMeta)));
  }
  return like;
}

}  // namespace

void send_tensors(Communicator& comm, const std::vector<Tensor>& ts, int dst, int tag) {
  Tensor buf = pack_bytes(ts, device_of_list(ts));
  if (buf.numel() > 0) comm.send(buf, dst, tag);
}

std::vector<Tensor> recv_tensors(Communicator& comm, const std::vector<Tensor>& like, int src,
                                 int tag) {
  std::vector<int64_t> off;
  int64_t total = layout_bytes(like, off);
  Tensor buf =
      at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device_of_list(like)));
  if (total > 0) comm.recv(buf, src, tag);
  return unpack_bytes(buf, like);
}

std::vector<Tensor> exchange_packed(Communicator& comm, const std::vector<Tensor>& ts, int dst,
                                    int src, const at::TensorOptions& device_of, int tag) {
  // Three rounds: the lengths, the header, the payload; each a send_recv.
  Tensor header, payload, lens;
  if (dst >= 0) {
    header = make_header(ts);
    payload = pack_bytes(ts, device_of.device());
    lens = at::tensor({header.numel(), payload.numel()}, at::kLong);
  }
  Tensor rlens = at::empty({2}, at::kLong);
  comm.send_recv(lens, dst, rlens, src, tag);
  Tensor rheader = src >= 0 ? at::empty({rlens[0].item<int64_t>()}, at::kLong) : Tensor();
  comm.send_recv(header, dst, rheader, src, tag);
  std::vector<Tensor> like;
  Tensor rpayload;
  if (src >= 0) {
    like = parse_header(rheader);
    std::vector<int64_t> off;
    int64_t total = layout_bytes(like, off);
    TORCH_INTERNAL_ASSERT(total == rlens[1].item<int64_t>(),
                          "packed message: header and payload disagree");
    rpayload = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device_of.device()));
  }
  comm.send_recv(payload, dst, rpayload, src, tag);
  if (src < 0) return {};
  return unpack_bytes(rpayload, like);
}

void send_packed(Communicator& comm, const std::vector<Tensor>& ts, int dst, int tag) {
  exchange_packed(comm, ts, dst, -1, at::TensorOptions().device(device_of_list(ts)), tag);
}

std::vector<Tensor> recv_packed(Communicator& comm, int src, const at::TensorOptions& device_of,
                                int tag) {
  return exchange_packed(comm, {}, -1, src, device_of, tag);
}

std::vector<std::vector<Tensor>> all_gather_packed(Communicator& comm,
                                                   const std::vector<Tensor>& ts,
                                                   const at::TensorOptions& device_of) {
  Tensor header = make_header(ts);
  Tensor payload = pack_bytes(ts, device_of.device());
  Tensor lens = at::tensor({header.numel(), payload.numel()}, at::kLong);
  auto all_lens = comm.all_gather(lens);
  int64_t max_h = 0, max_p = 0;
  for (auto& l : all_lens) {
    max_h = std::max(max_h, l[0].item<int64_t>());
    max_p = std::max(max_p, l[1].item<int64_t>());
  }
  // Every rank's payload starts 16-byte aligned in the gathered buffer, so any dtype can view it.
  max_p = (max_p + 15) / 16 * 16;
  auto headers = comm.all_gather(at::constant_pad_nd(header, {0, max_h - header.numel()}, 0));
  std::vector<Tensor> payloads;
  if (max_p > 0)
    payloads = comm.all_gather(at::constant_pad_nd(payload, {0, max_p - payload.numel()}, 0));
  std::vector<std::vector<Tensor>> out;
  for (int r = 0; r < comm.size(); ++r) {
    auto like = parse_header(headers[r]);
    out.push_back(unpack_bytes(max_p > 0 ? payloads[r] : payload, like));
  }
  return out;
}

// ---- the grid ----

namespace {

// make_process_groups without an MPI world: the same groups over the TCP store (the MPI backend's
// place on CPU), or NCCL communicators bootstrapped through it.
ProcessGroups make_store_process_groups(ProcessGroups g, Backend backend, const CommOptions& opt) {
  const WorldInfo& w = g.world_info;
  const int sp = g.layout.sp, dp = g.layout.dp;
  auto store = launch_store();
  if (!store) {  // one process: a store of its own on a free port
    store = std::make_shared<TcpStore>("127.0.0.1", 0, true, default_comm_timeout_s(), "a single process");
  }
  std::vector<int> all(w.size), sp_ranks(sp), dp_ranks(dp);
  for (int i = 0; i < w.size; ++i) all[i] = i;
  for (int i = 0; i < sp; ++i) sp_ranks[i] = g.dp_rank * sp + i;
  for (int i = 0; i < dp; ++i) dp_ranks[i] = i * sp + g.sp_rank;
  auto named = [&](const char* name, bool copy_engines) {
    CommOptions o = opt;
    o.name = name;
    o.copy_engine_neighbours = copy_engines && opt.copy_engine_neighbours;
    return o;
  };
  auto over_store = [&](const std::vector<int>& ranks, int rank, CommOptions o) {
    if (backend == Backend::mpi) return make_store_communicator(store, ranks, rank, o);
    CommOptions bo = o;
    bo.name = o.name + " (NCCL bootstrap over the TCP store)";
    bo.copy_engine_neighbours = false;
    return make_nccl_communicator(make_store_communicator(store, ranks, rank, bo), w.local_rank, o);
  };
  {
    auto setup = make_store_communicator(store, all, w.rank, named("world", false));
    CommContext ctx("building the dp × sp process groups (all ranks must call make_process_groups)");
    setup->barrier();
  }
  g.world = over_store(all, w.rank, named("world", false));
  g.sp = over_store(sp_ranks, g.sp_rank, named("sp", true));
  g.dp = over_store(dp_ranks, g.dp_rank, named("dp", false));
  if (sp > 1) g.sp_gradients = over_store(sp_ranks, g.sp_rank, named("sp gradients", false));
  return g;
}

}  // namespace

ProcessGroups make_process_groups(ParallelLayout layout, Backend backend, CommOptions opt) {
  const WorldInfo& w = world_info();
  TORCH_CHECK(layout.dp >= 1 && layout.sp >= 1,
              "parallel layout: dp and sp must be at least 1, got dp=", layout.dp,
              ", sp=", layout.sp);
  TORCH_CHECK(static_cast<int64_t>(layout.dp) * layout.sp == w.size,
              "parallel layout: dp=", layout.dp, " × sp=", layout.sp, " = ",
              static_cast<int64_t>(layout.dp) * layout.sp, " ranks, but the job has ", w.size,
              " ranks (the MPI world size); dp·sp must equal ", w.size);
  ProcessGroups g;
  g.world_info = w;
  g.layout = layout;
  g.sp_rank = w.rank % layout.sp;
  g.dp_rank = w.rank / layout.sp;
  if (store_world()) return make_store_process_groups(g, backend, opt);

  // All ranks present before the (blocking) splits: a timed barrier over the world.
  CommOptions wo = opt;
  wo.name = "world";
  wo.copy_engine_neighbours = false;
  auto mpi_world = make_mpi_communicator(MPI_COMM_WORLD, wo);
  {
    CommContext ctx(
        "building the dp × sp process groups (all ranks must call make_process_groups)");
    mpi_world->barrier();
  }
  MPI_Comm sp_comm, dp_comm;
  MPI_Comm_split(MPI_COMM_WORLD, g.dp_rank, g.sp_rank, &sp_comm);
  MPI_Comm_split(MPI_COMM_WORLD, g.sp_rank, g.dp_rank, &dp_comm);
  // Only the sp group's neighbour messages may go by the copy engines (CommOptions::copy_engine_neighbours).
  CommOptions so = opt, dpo = opt;
  so.name = "sp";
  dpo.name = "dp";
  dpo.copy_engine_neighbours = false;
  CommOptions go = opt;
  go.name = "sp gradients";
  go.copy_engine_neighbours = false;
  if (backend == Backend::mpi) {
    g.world = mpi_world;
    g.sp = make_mpi_communicator(sp_comm, so);
    g.dp = make_mpi_communicator(dp_comm, dpo);
    if (layout.sp > 1) g.sp_gradients = make_mpi_communicator(sp_comm, go);
  } else {
    g.world = make_nccl_communicator(MPI_COMM_WORLD, w.local_rank, wo);
    g.sp = make_nccl_communicator(sp_comm, w.local_rank, so);
    g.dp = make_nccl_communicator(dp_comm, w.local_rank, dpo);
    if (layout.sp > 1) g.sp_gradients = make_nccl_communicator(sp_comm, w.local_rank, go);
  }
  MPI_Comm_free(&sp_comm);
  MPI_Comm_free(&dp_comm);
  TORCH_INTERNAL_ASSERT(g.sp->size() == layout.sp && g.sp->rank() == g.sp_rank);
  TORCH_INTERNAL_ASSERT(g.dp->size() == layout.dp && g.dp->rank() == g.dp_rank);
  return g;
}

}  // namespace carry::parallel
