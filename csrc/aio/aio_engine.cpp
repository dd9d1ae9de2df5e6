// Asynchronous block I/O: a pool of threads doing pread/pwrite, one task per block.
//
// Note [why a thread pool, not io_uring]: on this project's reference disk, queue_depth
// threads each issuing one blocking O_DIRECT pread/pwrite of block_size bytes keep as many
// requests in flight as fio's libaio engine at the same iodepth, and measure within noise of
// it (benchmarks/bench_aio.py prints the ratio). The pool needs no liburing headers, no
// kernel >= 5.1 and no io_uring sysctl, so it builds and runs everywhere Linux does.
//
// The Python side (zeroshard/io/_plan.py) decides everything about a request -- which file
// descriptors, how it splits into blocks, which blocks may use O_DIRECT -- and hands this
// engine a flat list of tasks. The engine only executes them and records the first failure,
// so the native and the pure-Python backends cannot disagree about layout.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <vector>

namespace py = pybind11;

namespace {

struct Op {
  std::mutex m;
  std::condition_variable cv;
  int64_t remaining = 0;
  std::atomic<bool> failed{false};
  // The failure nearest the file's start: errno (0 for an unexpected end of file), file offset where the failing
  // block starts, bytes the block wanted and bytes it got before failing.
  int err = 0;
  int64_t err_offset = -1;
  int64_t err_wanted = 0;
  int64_t err_got = 0;
  bool eof = false;
  std::atomic<int64_t> direct_fallbacks{0};

  // Keeps the failure nearest the start of the file: blocks fail in whatever order threads
  // reach them, and the first bad byte is what the caller can act on.
  void fail(int e, int64_t off, int64_t wanted, int64_t got, bool at_eof) {
    std::lock_guard<std::mutex> g(m);
    if (failed.load() && off >= err_offset) return;
    err = e; err_offset = off; err_wanted = wanted; err_got = got; eof = at_eof;
    failed.store(true);
  }
  void finish_one() {
    std::lock_guard<std::mutex> g(m);
    if (--remaining == 0) cv.notify_all();
  }
  bool done() {
    std::lock_guard<std::mutex> g(m);
    return remaining == 0;
  }
  void wait() {
    std::unique_lock<std::mutex> g(m);
    cv.wait(g, [this] { return remaining == 0; });
  }
  py::tuple error() {
    std::lock_guard<std::mutex> g(m);
    return py::make_tuple(failed.load(), err, err_offset, err_wanted, err_got, eof);
  }
};

struct Task {
  std::shared_ptr<Op> op;
  int fd;           // descriptor for this block (O_DIRECT when the block allows it)
  int fallback_fd;  // buffered descriptor used if the file system refuses O_DIRECT (EINVAL)
  char* buf;
  int64_t len;
  int64_t off;
  bool write;
};

void run_task(Task& t) {
  if (t.op->failed.load()) return;  // another block of this request failed: skip the I/O
  int fd = t.fd;
  int64_t done = 0;
  while (done < t.len) {
    ssize_t r = t.write ? ::pwrite(fd, t.buf + done, t.len - done, t.off + done)
                        : ::pread(fd, t.buf + done, t.len - done, t.off + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      // Some file systems accept O_DIRECT at open() and refuse it per request, and a
      // short O_DIRECT transfer leaves the rest unaligned: retry through the buffered fd.
      if (errno == EINVAL && fd != t.fallback_fd && t.fallback_fd >= 0) {
        fd = t.fallback_fd;
        t.op->direct_fallbacks.fetch_add(1);
        continue;
      }
      t.op->fail(errno, t.off, t.len, done, false);
      return;
    }
    if (r == 0) {
      // A read at end of file, or a write that made no progress: never report silent zeros.
      t.op->fail(t.write ? EIO : 0, t.off, t.len, done, !t.write);
      return;
    }
    done += r;
  }
}

class Engine {
 public:
  explicit Engine(int threads) {
    if (threads < 1) throw std::invalid_argument("queue_depth must be >= 1");
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Engine() { shutdown(); }

  // tasks: (fd, fallback_fd, buffer address, length, file offset)
  std::shared_ptr<Op> submit(const std::vector<std::tuple<int, int, uintptr_t, int64_t, int64_t>>& tasks,
                             bool write) {
    auto op = std::make_shared<Op>();
    op->remaining = static_cast<int64_t>(tasks.size());
    {
      std::lock_guard<std::mutex> g(m_);
      if (stopping_) throw std::runtime_error("the I/O engine is closed");
      for (const auto& t : tasks) {
        queue_.push_back(Task{op, std::get<0>(t), std::get<1>(t), reinterpret_cast<char*>(std::get<2>(t)),
                              std::get<3>(t), std::get<4>(t), write});
      }
    }
    if (tasks.size() == 1) cv_.notify_one(); else cv_.notify_all();
    return op;
  }

  void shutdown() {
    {
      std::lock_guard<std::mutex> g(m_);
      if (stopping_ && workers_.empty()) return;
      stopping_ = true;  // workers drain the queue before they exit
    }
    cv_.notify_all();
    for (auto& w : workers_) if (w.joinable()) w.join();
    workers_.clear();
  }

  int threads() const { return static_cast<int>(workers_.size()); }

 private:
  void loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      run_task(t);
      t.op->finish_one();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroshard asynchronous block I/O engine (thread pool of pread/pwrite)";
  py::class_<Op, std::shared_ptr<Op>>(m, "Op")
      .def("done", &Op::done)
      .def("wait", &Op::wait, py::call_guard<py::gil_scoped_release>())
      .def("error", &Op::error, "(failed, errno, offset, wanted, got, eof)")
      .def("direct_fallbacks", [](Op& op) { return op.direct_fallbacks.load(); });
  py::class_<Engine>(m, "Engine")
      .def(py::init<int>(), py::arg("threads"))
      .def("submit", &Engine::submit, py::arg("tasks"), py::arg("write"))
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("threads", &Engine::threads);
  m.attr("BACKEND") = "pthread-pool";
}
