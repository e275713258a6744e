// A small TCP key-value store through which ranks started without MPI (torchrun, srun; see
// launch_env.h) meet, and a Communicator over it.
//
// Rank 0 listens on MASTER_PORT (every interface) and serves the keys from memory, one thread a
// connection; every rank, rank 0 included, connects to MASTER_ADDR:MASTER_PORT as a client, retrying
// until the timeout (rank 0 may start last), then fails with one line: the address, the variables it
// came from, the last error. Requests: set(key, bytes); get(key), which waits on the server until
// the key exists; take(key), get then erase; add(key, n), an atomic counter. A get that waits past
// the timeout fails naming the key. Safe to use from several threads. The store carries what the setup needs (the NCCL unique id, the
// hosts) and, through make_store_communicator, the CPU messages of a job with no MPI world: each
// message a key, read once and erased; a collective's pieces erased by the last rank to read them.
#pragma once

#include "parallel/process_group.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace carry::parallel {

class TcpStore {
 public:
  // Rank 0 (is_server) also starts the server. `where` names the address's origin in messages
  // ("MASTER_ADDR:MASTER_PORT from torchrun's environment").
  TcpStore(const std::string& host, int port, bool is_server, double timeout_s, std::string where);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key);   // waits until the key is set
  std::string take(const std::string& key);  // get, then erase it
  int64_t add(const std::string& key, int64_t n);
  void erase(const std::string& key);
  int port() const { return port_; }  // the server's port (tests: port 0 picks a free one)

 private:
  std::string request(char op, const std::string& key, const std::string& value);
  int connect_to_server();  // a new connection, retried until the timeout
  struct Server;
  std::unique_ptr<Server> server_;
  // Idle connections: a request takes one (or opens one), so threads that wait in a get do not hold
  // up the others' requests.
  std::mutex mu_;
  std::vector<int> idle_;
  int port_ = 0;
  double timeout_s_;
  std::string host_, where_;
};

// The ranks of `world_ranks` (this process is world_ranks[rank]) as a Communicator over `store`: CPU
// tensors; all_reduce_sum adds the ranks' tensors in rank order, so every rank gets the same bits.
// Keys start with the name and the ranks, so several communicators share one store.
std::shared_ptr<Communicator> make_store_communicator(std::shared_ptr<TcpStore> store, std::vector<int> world_ranks,
                                                      int rank, CommOptions opt = {});

// The process's store when it was started without MPI (read_launch_env: torchrun or slurm), made on
// first use from MASTER_ADDR/MASTER_PORT; null under MPI or for a single process.
std::shared_ptr<TcpStore> launch_store();

}  // namespace carry::parallel
