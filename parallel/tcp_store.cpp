// The TCP store and its Communicator (see tcp_store.h). Wire format, both ways little-endian:
// request  [op u8][key length u32][key][value length u64][value]
// reply    [status u8 (0 ok, 1 timeout)][value length u64][value]
// ops: 's' set, 'g' get (waits), 't' take (waits, erases), 'a' add (value: i64 text), 'e' erase.
// A get that waits on the server stops after the client's timeout (sent as the value of 'g'/'t').
#include "parallel/tcp_store.h"

#include "parallel/launch_env.h"

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

namespace carry::parallel {

namespace {

using clock_type = std::chrono::steady_clock;

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w, n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads n bytes; false on a closed connection, an error, or (deadline set) time running out.
bool read_all(int fd, void* data, size_t n, double timeout_s = -1) {
  char* p = static_cast<char*>(data);
  const auto deadline = clock_type::now() + std::chrono::duration<double>(timeout_s);
  while (n > 0) {
    if (timeout_s >= 0) {
      const double left = std::chrono::duration<double>(deadline - clock_type::now()).count();
      if (left <= 0) return false;
      pollfd pf{fd, POLLIN, 0};
      const int r = ::poll(&pf, 1, static_cast<int>(std::min(left * 1000 + 1, 1e9)));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
    }
    ssize_t got = ::recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= static_cast<size_t>(got);
  }
  return true;
}

void put_u64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }

std::string seconds(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

}  // namespace

// ---- the server ----

struct TcpStore::Server {
  int listen_fd = -1;
  std::atomic<bool> stopping{false};
  std::mutex mu;
  std::condition_variable changed;
  std::map<std::string, std::string> data;
  std::thread acceptor;
  std::vector<std::thread> handlers;
  std::vector<int> client_fds;

  ~Server() {
    stopping = true;
    if (listen_fd >= 0) ::shutdown(listen_fd, SHUT_RDWR), ::close(listen_fd);
    {
      std::lock_guard<std::mutex> lock(mu);
      for (int fd : client_fds) ::shutdown(fd, SHUT_RDWR);
      changed.notify_all();
    }
    if (acceptor.joinable()) acceptor.join();
    for (auto& t : handlers) t.join();
    for (int fd : client_fds) ::close(fd);
  }

  void accept_loop() {
    while (!stopping) {
      pollfd pf{listen_fd, POLLIN, 0};
      if (::poll(&pf, 1, 200) <= 0) continue;
      int fd = ::accept(listen_fd, nullptr, nullptr);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      std::lock_guard<std::mutex> lock(mu);
      client_fds.push_back(fd);
      handlers.emplace_back([this, fd] { serve(fd); });
    }
  }

  void serve(int fd) {
    while (!stopping) {
      char op;
      uint32_t key_len;
      uint64_t value_len;
      if (!read_all(fd, &op, 1) || !read_all(fd, &key_len, 4)) return;
      std::string key(key_len, '\0'), value;
      if (!read_all(fd, key.data(), key_len) || !read_all(fd, &value_len, 8)) return;
      value.resize(value_len);
      if (!read_all(fd, value.data(), value_len)) return;
      std::string reply_value;
      char status = 0;
      {
        std::unique_lock<std::mutex> lock(mu);
        if (op == 's') {
          data[key] = std::move(value);
          changed.notify_all();
        } else if (op == 'g' || op == 't') {
          const double wait_s = std::strtod(value.c_str(), nullptr);
          const bool found = changed.wait_for(lock, std::chrono::duration<double>(wait_s),
                                              [&] { return stopping || data.count(key) > 0; });
          if (!found || stopping) {
            status = 1;
          } else {
            auto it = data.find(key);
            if (op == 't') reply_value = std::move(it->second), data.erase(it);
            else reply_value = it->second;
          }
        } else if (op == 'a') {
          auto& v = data[key];
          const int64_t now = (v.empty() ? 0 : std::strtoll(v.c_str(), nullptr, 10)) + std::strtoll(value.c_str(), nullptr, 10);
          v = std::to_string(now);
          reply_value = v;
          changed.notify_all();
        } else if (op == 'e') {
          data.erase(key);
        } else {
          return;  // not a client of ours: drop the connection
        }
      }
      std::string reply(1, status);
      put_u64(reply, reply_value.size());
      reply += reply_value;
      if (!write_all(fd, reply.data(), reply.size())) return;
    }
  }
};

// ---- the client ----

TcpStore::TcpStore(const std::string& host, int port, bool is_server, double timeout_s, std::string where)
    : port_(port), timeout_s_(timeout_s), host_(host), where_(std::move(where)) {
  if (is_server) {
    server_ = std::make_unique<Server>();
    int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool v6 = fd >= 0;
    if (!v6) fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    TORCH_CHECK(fd >= 0, "carry: rank 0 cannot open a socket for the TCP store: ", std::strerror(errno));
    int one = 1, zero = 0;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (v6) {
      ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);  // IPv4 clients too
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    if (rc != 0 || ::listen(fd, 1024) != 0) {
      const int e = errno;
      ::close(fd);
      TORCH_CHECK(false, "carry: rank 0 cannot listen on port ", port, " for the TCP store (", where_, "): ",
                  std::strerror(e), "; choose another MASTER_PORT");
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    server_->listen_fd = fd;
    server_->acceptor = std::thread([s = server_.get()] { s->accept_loop(); });
  }
  idle_.push_back(connect_to_server());  // fails here, at startup, when rank 0 cannot be reached
}

int TcpStore::connect_to_server() {
  // Connect, retrying until the timeout: rank 0 may not be listening yet.
  int fd_ = -1;
  const auto start = clock_type::now();
  std::string last = "no attempt";
  auto pause = std::chrono::milliseconds(10);
  while (true) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const int gai = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
    if (gai != 0) {
      last = std::string("cannot resolve the host name: ") + ::gai_strerror(gai);
    } else {
      for (addrinfo* a = res; a && fd_ < 0; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          fd_ = fd;
        } else {
          last = std::strerror(errno);
          ::close(fd);
        }
      }
      ::freeaddrinfo(res);
    }
    if (fd_ >= 0) break;
    if (std::chrono::duration<double>(clock_type::now() - start).count() > timeout_s_)
      TORCH_CHECK(false, "carry: cannot reach the TCP store at ", host_, ":", port_, " (", where_, ") within ", timeout_s_,
                  " s (last error: ", last, "); rank 0 listens there: is it running, and do all ranks have the same "
                  "MASTER_ADDR and MASTER_PORT? (CARRY_COMM_TIMEOUT_S sets the wait)");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd_;
}

TcpStore::~TcpStore() {
  for (int fd : idle_) ::close(fd);
  server_.reset();
}

std::string TcpStore::request(char op, const std::string& key, const std::string& value) {
  std::string msg(1, op);
  const auto key_len = static_cast<uint32_t>(key.size());
  msg.append(reinterpret_cast<const char*>(&key_len), 4);
  msg += key;
  put_u64(msg, value.size());
  msg += value;
  auto lost = [&](const char* what) {
    return "carry: the TCP store at " + host_ + ":" + std::to_string(port_) + " (" + where_ + ") " + what +
           " during a request for '" + key + "': rank 0, which serves it, probably ended or failed (its message says why)";
  };
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!idle_.empty()) fd = idle_.back(), idle_.pop_back();
  }
  if (fd < 0) fd = connect_to_server();
  struct Lease {  // back to the idle ones after a complete exchange; closed otherwise
    TcpStore* store;
    int fd;
    bool ok = false;
    ~Lease() {
      if (!ok) {
        ::close(fd);
        return;
      }
      std::lock_guard<std::mutex> lock(store->mu_);
      store->idle_.push_back(fd);
    }
  } lease{this, fd};
  TORCH_CHECK(write_all(fd, msg.data(), msg.size()), lost("closed the connection"));
  char status;
  uint64_t len;
  // The server answers a waiting get within the timeout it was sent; a little more for the network.
  const double wait = op == 'g' || op == 't' ? timeout_s_ + 30 : timeout_s_;
  TORCH_CHECK(read_all(fd, &status, 1, wait) && read_all(fd, &len, 8, wait), lost("did not answer"));
  std::string out(len, '\0');
  TORCH_CHECK(read_all(fd, out.data(), len, wait), lost("did not answer"));
  lease.ok = true;
  if (status == 1)
    throw CommError("timeout after " + seconds(timeout_s_) + " s waiting for '" + key +
                    "' in the TCP store at " + host_ + ":" + std::to_string(port_) + " (" + where_ +
                    "): the rank that should set it probably failed, exited, or waits in a different operation");
  return out;
}

void TcpStore::set(const std::string& key, const std::string& value) { request('s', key, value); }
std::string TcpStore::get(const std::string& key) { return request('g', key, std::to_string(timeout_s_)); }
std::string TcpStore::take(const std::string& key) { return request('t', key, std::to_string(timeout_s_)); }
int64_t TcpStore::add(const std::string& key, int64_t n) { return std::stoll(request('a', key, std::to_string(n))); }
void TcpStore::erase(const std::string& key) { request('e', key, ""); }

// ---- the communicator ----

namespace {

std::string tensor_bytes(const Tensor& t) {
  Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

void fill_from(Tensor& t, const std::string& bytes, const std::string& what) {
  TORCH_CHECK(static_cast<int64_t>(bytes.size()) == static_cast<int64_t>(t.nbytes()), what,
              ": message size mismatch: expected ", t.nbytes(), " bytes, got ", bytes.size());
  Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU));
  if (!bytes.empty()) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
  t.copy_(host);
}

class StoreCommunicator final : public Communicator {
 public:
  StoreCommunicator(std::shared_ptr<TcpStore> store, std::vector<int> world_ranks, int rank, CommOptions opt)
      : store_(std::move(store)), world_ranks_(std::move(world_ranks)), rank_(rank), opt_(std::move(opt)) {
    std::ostringstream p;
    p << opt_.name << "[";
    for (size_t i = 0; i < world_ranks_.size(); ++i) p << (i ? "," : "") << world_ranks_[i];
    p << "]/";
    prefix_ = p.str();
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(world_ranks_.size()); }
  int world_rank_of(int r) const override { return world_ranks_.at(r); }
  std::string backend() const override { return "tcp store"; }
  at::Device device() const override { return at::kCPU; }
  const CommOptions& options() const override { return opt_; }

  void send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag) override {
    if (dst >= 0) {
      check_peer(dst);
      guarded("send to rank " + std::to_string(dst), {dst},
              [&] { store_->set(p2p_key(rank_, dst, tag, sent_[{dst, tag}]++), tensor_bytes(out)); });
    }
    if (src >= 0) {
      check_peer(src);
      const std::string what = "recv from rank " + std::to_string(src);
      guarded(what, {src}, [&] { fill_from(in, store_->take(p2p_key(src, rank_, tag, received_[{src, tag}]++)), what); });
    }
  }

  std::vector<Tensor> all_gather(const Tensor& t) override {
    std::vector<Tensor> out;
    const std::string k = prefix_ + "gather/" + std::to_string(collectives_++) + "/";
    guarded("all_gather", peers(), [&] {
      store_->set(k + std::to_string(rank_), tensor_bytes(t));
      for (int r = 0; r < size(); ++r) {
        Tensor x = at::empty(t.sizes(), t.options().device(at::kCPU));
        fill_from(x, r == rank_ ? tensor_bytes(t) : store_->get(k + std::to_string(r)), "all_gather");
        out.push_back(t.device().is_cpu() ? x : x.to(t.device()));
      }
      finish(k);
    });
    return out;
  }

  void all_reduce_sum(Tensor& t) override {
    auto parts = all_gather(t);
    const bool widen = t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
    Tensor sum = widen ? parts[0].to(at::kFloat) : parts[0].clone();
    for (int r = 1; r < size(); ++r) sum.add_(widen ? parts[r].to(at::kFloat) : parts[r]);  // rank order: the same bits everywhere
    t.copy_(sum);
  }

  void broadcast(Tensor& t, int root) override {
    check_peer(root);
    const std::string k = prefix_ + "bcast/" + std::to_string(collectives_++) + "/";
    guarded("broadcast from root " + std::to_string(root), {root}, [&] {
      if (rank_ == root) store_->set(k + "v", tensor_bytes(t));
      else fill_from(t, store_->get(k + "v"), "broadcast");
      finish(k);
    });
  }

  void barrier() override {
    const std::string k = prefix_ + "barrier/" + std::to_string(collectives_++);
    guarded("barrier", peers(), [&] {
      if (store_->add(k, 1) == size()) store_->set(k + "/open", "");
      store_->get(k + "/open");
      if (store_->add(k + "/left", 1) == size()) store_->erase(k), store_->erase(k + "/open"), store_->erase(k + "/left");
    });
  }

 private:
  std::string p2p_key(int from, int to, int tag, int64_t seq) const {
    return prefix_ + "p2p/" + std::to_string(from) + ">" + std::to_string(to) + "/" + std::to_string(tag) + "/" +
           std::to_string(seq);
  }
  // The last rank through a collective erases its keys.
  void finish(const std::string& k) {
    if (store_->add(k + "done", 1) < size()) return;
    store_->erase(k + "done");
    for (int r = 0; r < size(); ++r) store_->erase(k + std::to_string(r));
    store_->erase(k + "v");
  }
  std::vector<int> peers() const {
    std::vector<int> p;
    for (int i = 0; i < size(); ++i)
      if (i != rank_) p.push_back(i);
    return p;
  }
  void check_peer(int peer) const {
    TORCH_CHECK(peer >= 0 && peer < size(), "peer rank ", peer, " is not a rank of communicator '", opt_.name,
                "' (ranks 0..", size() - 1, ", this is rank ", rank_, ")");
  }
  template <class F>
  void guarded(const std::string& op, const std::vector<int>& peers, F&& f) {
    TORCH_CHECK(broken_.empty(), "communicator '", opt_.name, "' is unusable after an earlier failure (", broken_, ")");
    try {
      f();
    } catch (const CommError& e) {
      broken_ = op + " failed";
      detail::comm_fail(*this, detail::comm_error_message(*this, op, peers, e.what()));
    }
  }

  std::shared_ptr<TcpStore> store_;
  std::vector<int> world_ranks_;
  int rank_;
  CommOptions opt_;
  std::string prefix_, broken_;
  int64_t collectives_ = 0;
  std::map<std::pair<int, int>, int64_t> sent_, received_;  // by (peer, tag): messages so far
};

}  // namespace

std::shared_ptr<Communicator> make_store_communicator(std::shared_ptr<TcpStore> store, std::vector<int> world_ranks,
                                                      int rank, CommOptions opt) {
  TORCH_CHECK(rank >= 0 && rank < static_cast<int>(world_ranks.size()), "make_store_communicator: rank ", rank,
              " is not one of the ", world_ranks.size(), " ranks");
  return std::make_shared<StoreCommunicator>(std::move(store), std::move(world_ranks), rank, std::move(opt));
}

std::shared_ptr<TcpStore> launch_store() {
  static std::mutex mu;
  static std::shared_ptr<TcpStore> store;
  std::lock_guard<std::mutex> lock(mu);
  if (store) return store;
  const LaunchEnv env = read_launch_env();
  if (env.kind != LaunchEnv::Kind::torchrun && env.kind != LaunchEnv::Kind::slurm) return nullptr;
  store = std::make_shared<TcpStore>(env.master_addr, env.master_port, env.rank == 0, default_comm_timeout_s(),
                                     "MASTER_ADDR:MASTER_PORT from " + std::string(env.kind == LaunchEnv::Kind::torchrun
                                                                                       ? "torchrun's environment"
                                                                                       : "the Slurm job"));
  return store;
}

}  // namespace carry::parallel
