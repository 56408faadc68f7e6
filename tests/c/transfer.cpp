// C++17 client of the mooncake C ABI (same modes as transfer.c), driven by
// tests/capi.rs. Uses RAII wrappers over the plain C header.
//
//   transfer target SIZE
//   transfer client NAME ADDR SIZE

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mooncake.h"

namespace {

struct Failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

void expect(int got, int want, const std::string &what) {
    if (got != want) {
        std::ostringstream m;
        m << what << ": got " << got << " (" << mc_error_string(got) << "), want " << want
          << " (" << mc_error_string(want) << ")";
        throw Failure(m.str());
    }
}

struct ConfigDeleter {
    void operator()(mc_config *c) const { mc_config_free(c); }
};
struct EngineDeleter {
    void operator()(mc_engine *e) const { mc_engine_free(e); }
};
using Config = std::unique_ptr<mc_config, ConfigDeleter>;
using Engine = std::unique_ptr<mc_engine, EngineDeleter>;

// Engine-owned registered memory (mc_allocate_buffer), released on scope exit.
class Registered {
  public:
    Registered(mc_engine *engine, std::size_t size) : engine_(engine), size_(size) {
        void *p = nullptr;
        expect(mc_allocate_buffer(engine_, size_, "cpu:0", &p), MC_OK, "allocate");
        if (p == nullptr) throw Failure("mc_allocate_buffer gave NULL");
        buf_ = static_cast<unsigned char *>(p);
    }
    ~Registered() { mc_free_buffer(engine_, buf_); }
    Registered(const Registered &) = delete;
    Registered &operator=(const Registered &) = delete;
    unsigned char *data() { return buf_; }
    std::size_t size() const { return size_; }

  private:
    mc_engine *engine_;
    std::size_t size_;
    unsigned char *buf_ = nullptr;
};

unsigned char pattern(int seed, std::uint64_t i) {
    return static_cast<unsigned char>((i * 131u + static_cast<std::uint64_t>(seed) * 71u + (i >> 9)) & 0xffu);
}

void fill(unsigned char *p, std::uint64_t len, int seed) {
    for (std::uint64_t i = 0; i < len; i++) p[i] = pattern(seed, i);
}

void check(const unsigned char *p, std::uint64_t len, int seed, const std::string &what) {
    for (std::uint64_t i = 0; i < len; i++) {
        if (p[i] != pattern(seed, i)) {
            throw Failure(what + ": byte " + std::to_string(i) + " is " + std::to_string(p[i]) +
                          ", want " + std::to_string(pattern(seed, i)));
        }
    }
}

std::uint64_t parse_u64(const std::string &s) {
    std::size_t used = 0;
    unsigned long long v = std::stoull(s, &used, 10);
    if (used != s.size()) throw Failure("bad number " + s);
    return v;
}

Engine start_engine() {
    Config cfg(mc_config_new());
    if (!cfg) throw Failure("mc_config_new returned NULL");
    expect(mc_config_set(cfg.get(), "metadata", "P2PHANDSHAKE"), MC_OK, "set metadata");
    expect(mc_config_set(cfg.get(), "protocol", "tcp"), MC_OK, "set protocol");
    expect(mc_config_set(cfg.get(), "bind_address", "127.0.0.1"), MC_OK, "set bind_address");
    expect(mc_config_set(cfg.get(), "no_such_key", "1"), MC_ERR_INVALID_PARAMS, "unknown key");
    expect(mc_config_set(cfg.get(), "slice_size", "12"), MC_ERR_INVALID_PARAMS, "bad value");
    mc_engine *raw = nullptr;
    expect(mc_engine_new(cfg.get(), &raw), MC_OK, "mc_engine_new");
    if (raw == nullptr) throw Failure("mc_engine_new gave no engine");
    return Engine(raw);
}

int target(std::uint64_t size) {
    Engine engine = start_engine();
    Registered buf(engine.get(), size);
    fill(buf.data(), size, 1);
    char name[256];
    expect(mc_engine_segment_name(engine.get(), name, sizeof name), MC_OK, "segment name");
    std::printf("ready %s %llu\n", name,
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(buf.data())));
    std::fflush(stdout);

    while (std::getchar() != EOF) {
    }

    char from[256];
    char msg[1024];
    char tiny[1];
    expect(mc_take_notification(engine.get(), from, sizeof from, tiny, sizeof tiny),
           MC_ERR_BUFFER_OVERFLOW, "take into a tiny buffer");
    int rc;
    while ((rc = mc_take_notification(engine.get(), from, sizeof from, msg, sizeof msg)) == 1) {
        std::printf("notified %s %s\n", from, msg);
    }
    expect(rc, 0, "take notification");
    std::fflush(stdout);
    return 0;
}

class Batch {
  public:
    Batch(mc_engine *engine, std::size_t capacity) : engine_(engine) {
        expect(mc_batch_new(engine_, capacity, &id_), MC_OK, "batch");
    }
    ~Batch() { mc_batch_free(engine_, id_); }
    Batch(const Batch &) = delete;
    Batch &operator=(const Batch &) = delete;
    std::uint64_t id() const { return id_; }

    void run(const mc_request &req, const std::string &what) {
        expect(mc_submit(engine_, id_, &req, 1), MC_OK, what);
        expect(mc_batch_wait(engine_, id_, -1), MC_OK, what);
        mc_task_status_t st{};
        expect(mc_task_status(engine_, id_, next_task_++, &st), MC_OK, what);
        expect(st.state, MC_TASK_COMPLETED, what);
        if (st.bytes != req.len) throw Failure(what + ": short transfer");
    }

  private:
    mc_engine *engine_;
    std::uint64_t id_ = 0;
    std::size_t next_task_ = 0;
};

int client(const std::string &name, std::uint64_t addr, std::uint64_t size) {
    if (mc_abi_version() != MC_ABI_VERSION) throw Failure("abi version mismatch");
    static_assert(sizeof(void *) != 8 || sizeof(mc_request) == 40, "mc_request layout");
    if (std::strcmp(mc_error_string(-4242), "unknown error") != 0) throw Failure("unknown code");
    for (int code : {MC_OK, MC_ERR_INTERNAL, MC_ERR_IO, MC_ERR_TIMEOUT}) {
        if (mc_error_string(code) == nullptr) throw Failure("mc_error_string gave NULL");
    }

    Engine engine = start_engine();
    Registered local(engine.get(), size);
    std::uint64_t seg = 0;
    expect(mc_open_segment(engine.get(), name.c_str(), &seg), MC_OK, "open segment");
    expect(mc_probe(engine.get(), seg), MC_OK, "probe");
    {
        Batch batch(engine.get(), 8);
        mc_request req{MC_OP_READ, local.data(), seg, addr, size};
        batch.run(req, "read all");
        check(local.data(), size, 1, "read all");

        std::uint64_t half = size / 2;
        fill(local.data(), half, 2);
        req.op = MC_OP_WRITE;
        req.len = half;
        batch.run(req, "write half");

        std::memset(local.data(), 0, local.size());
        req.op = MC_OP_READ;
        batch.run(req, "read back");
        check(local.data(), half, 2, "read back");

        mc_request bad = req;
        bad.len = 0;
        expect(mc_submit(engine.get(), batch.id(), &bad, 1), MC_ERR_INVALID_PARAMS, "zero length");
        bad = req;
        bad.remote_addr = addr + size - 1;
        bad.len = 2;
        expect(mc_submit(engine.get(), batch.id(), &bad, 1), MC_ERR_ADDRESS_NOT_REGISTERED,
               "outside");
        bad = req;
        bad.op = 7;
        expect(mc_submit(engine.get(), batch.id(), &bad, 1), MC_ERR_INVALID_PARAMS, "bad op");
        expect(mc_batch_free(engine.get(), batch.id() + 1000), MC_ERR_BATCH_NOT_FOUND,
               "unknown batch");
    }
    expect(mc_notify(engine.get(), seg, "hello from C++"), MC_OK, "notify");
    return 0;
}

}  // namespace

int main(int argc, char **argv) {
    std::vector<std::string> args(argv + 1, argv + argc);
    try {
        if (args.size() == 2 && args[0] == "target") return target(parse_u64(args[1]));
        if (args.size() == 4 && args[0] == "client") {
            return client(args[1], parse_u64(args[2]), parse_u64(args[3]));
        }
    } catch (const std::exception &e) {
        std::cerr << "transfer.cpp " << (args.empty() ? "" : args[0]) << ": " << e.what() << "\n";
        return 1;
    }
    std::cerr << "usage: " << argv[0] << " target SIZE | client NAME ADDR SIZE\n";
    return 2;
}
