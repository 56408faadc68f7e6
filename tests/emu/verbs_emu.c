/*
 * An emulated libibverbs provider for tests: exports the ibv_* functions the RDMA
 * transport loads and emulates HCAs inside one process, or across the processes of one
 * host that share a fabric file (VERBS_EMU_FABRIC, below).
 *
 *   cc -shared -fPIC -O2 -o libverbs_emu.so verbs_emu.c -lpthread
 *
 * - VERBS_EMU_DEVICES=N (default 2, at most 8) devices named emu0..emuN-1, one port
 *   each, IB link layer, LID = index + 1, GID 0 = fe80::<pid>:<index>.
 * - PDs; MRs with process-wide unique lkey/rkey, bounds- and access-checked.
 *   ibv_reg_mr refuses (EFAULT) memory the CPU cannot read, as pinning would fail (the
 *   fake GPU drivers' device memory is PROT_NONE); ibv_reg_dmabuf_mr maps the dma-buf
 *   fd and serves the MR's addresses (from iova) out of that mapping, never touching
 *   the exporter's own view, the way a NIC's DMA reaches GPU memory.
 * - RC QPs with the RESET -> INIT -> RTR -> RTS state machine (required attribute masks
 *   enforced; posting outside RTS is refused with EINVAL, posting in ERR flushes).
 * - RDMA READ / WRITE run synchronously inside ibv_post_send: the peer QP is found by
 *   its number, the remote key and range are checked, the bytes copied, and a work
 *   completion queued on the send CQ. A bad remote key or range completes with
 *   IBV_WC_REM_ACCESS_ERR, a bad local key with IBV_WC_LOC_PROT_ERR, an unreachable
 *   or downed device with IBV_WC_RETRY_EXC_ERR; each moves the QP to ERR, as RC does.
 * - Completion channels: ibv_create_comp_channel gives a channel whose fd (an eventfd)
 *   is readable while CQ events are queued on it. A CQ created on a channel (of the same
 *   context, as the kernel insists) and armed with ibv_req_notify_cq queues one event
 *   when its next completion arrives; completions already in the CQ when it is armed
 *   raise none, so a consumer that does not poll again after arming can miss one.
 *   ibv_get_cq_event blocks, or fails with EAGAIN when the fd is O_NONBLOCK; a CQ with
 *   events read but not acknowledged (ibv_ack_cq_events) cannot be destroyed (EBUSY;
 *   real libibverbs would wait forever instead).
 * - Faults: verbs_emu_fail_device(name, down), verbs_emu_fail_after(name, bytes),
 *   verbs_emu_fail_qp(qp_num); counters: verbs_emu_bytes(name), verbs_emu_ops(name),
 *   verbs_emu_cq_events() (verbs_emu_wait_cq_events(n, ms) waits until n are). verbs_emu_hold_completions(1) keeps completions back (the
 *   bytes still move at post time) until verbs_emu_hold_completions(0) delivers them;
 *   verbs_emu_wait_held(n, ms) waits until n are held, verbs_emu_wait_held_armed(ms) until
 *   the CQs they are bound for are all armed.
 *
 * - Across processes (opt-in): with VERBS_EMU_FABRIC=<file> every process naming the
 *   same file shares a "fabric", a registry mapped from that file (created on first
 *   use, reinitialized when its layout differs) under a process-shared robust mutex.
 *   QP numbers (24 bits) and keys then come from the fabric, unique across processes;
 *   every QP (owner, PD, GID, state, dest QPN, access) and MR (owner, PD, rkey, range,
 *   access, and where the owner's CPU reaches the bytes: the address itself or its
 *   dma-buf mapping) is published there. A request whose peer QP is not in this
 *   process goes to the fabric: the same GID/QPN/state/rkey/range/access checks, then
 *   process_vm_readv/writev on the owner, under the fabric lock so that a peer's
 *   ibv_dereg_mr waits for copies into its memory to end. An owner that is gone (pid
 *   absent, a zombie, or reused: its start time differs) completes with
 *   IBV_WC_RETRY_EXC_ERR. Entries of gone processes are reclaimed when a process
 *   attaches and when a table is full; destroying a QP or MR, or closing its device,
 *   removes it. Device faults and counters stay per process: a device downed here
 *   fails this process's requests, and bytes count on the requester's device only.
 *   Unset, the emulator is process-local exactly as described above.
 *
 * Struct layouts below mirror rdma-core 44's <infiniband/verbs.h> (LP64) for the
 * parts callers read or write; the emulator does not include that header so that it
 * builds where libibverbs-dev is absent. Figures from it are not performance claims.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 8

/* ---- verbs.h mirrors ---- */

union ibv_gid {
	uint8_t raw[16];
	struct {
		uint64_t subnet_prefix;
		uint64_t interface_id;
	} global;
};

struct ibv_device {
	void *_ops[2];
	int node_type;
	int transport_type;
	char name[64];
	char dev_name[64];
	char dev_path[256];
	char ibdev_path[256];
};

struct ibv_context;
struct ibv_cq;
struct ibv_qp;
struct ibv_wc;
struct ibv_send_wr;
struct ibv_recv_wr;

struct ibv_context_ops {
	void *_compat_before_poll[11];
	int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
	int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
	void *_compat_middle[12];
	int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
	int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
	void *_compat_after[5];
};

struct ibv_context {
	struct ibv_device *device;
	struct ibv_context_ops ops;
	int cmd_fd;
	int async_fd;
	int num_comp_vectors;
	pthread_mutex_t mutex;
	void *abi_compat;
};

struct ibv_pd {
	struct ibv_context *context;
	uint32_t handle;
};

struct ibv_mr {
	struct ibv_context *context;
	struct ibv_pd *pd;
	void *addr;
	size_t length;
	uint32_t handle;
	uint32_t lkey;
	uint32_t rkey;
};

struct ibv_comp_channel {
	struct ibv_context *context;
	int fd;
	int refcnt;
};

struct ibv_cq {
	struct ibv_context *context;
	struct ibv_comp_channel *channel;
	void *cq_context;
	uint32_t handle;
	int cqe;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t comp_events_completed;
	uint32_t async_events_completed;
};

struct ibv_qp {
	struct ibv_context *context;
	void *qp_context;
	struct ibv_pd *pd;
	struct ibv_cq *send_cq;
	struct ibv_cq *recv_cq;
	void *srq;
	uint32_t handle;
	uint32_t qp_num;
	int state;
	int qp_type;
	pthread_mutex_t mutex;
	pthread_cond_t cond;
	uint32_t events_completed;
};

struct ibv_qp_cap {
	uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};

struct ibv_qp_init_attr {
	void *qp_context;
	struct ibv_cq *send_cq;
	struct ibv_cq *recv_cq;
	void *srq;
	struct ibv_qp_cap cap;
	int qp_type;
	int sq_sig_all;
};

struct ibv_global_route {
	union ibv_gid dgid;
	uint32_t flow_label;
	uint8_t sgid_index, hop_limit, traffic_class;
};

struct ibv_ah_attr {
	struct ibv_global_route grh;
	uint16_t dlid;
	uint8_t sl, src_path_bits, static_rate, is_global, port_num;
};

struct ibv_qp_attr {
	int qp_state, cur_qp_state, path_mtu, path_mig_state;
	uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
	unsigned int qp_access_flags;
	struct ibv_qp_cap cap;
	struct ibv_ah_attr ah_attr, alt_ah_attr;
	uint16_t pkey_index, alt_pkey_index;
	uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic,
		min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
	uint32_t rate_limit;
};

struct ibv_sge {
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
};

struct ibv_send_wr {
	uint64_t wr_id;
	struct ibv_send_wr *next;
	struct ibv_sge *sg_list;
	int num_sge;
	int opcode;
	unsigned int send_flags;
	uint32_t imm_data;
	union {
		struct {
			uint64_t remote_addr;
			uint32_t rkey;
		} rdma;
		struct {
			uint64_t remote_addr, compare_add, swap;
			uint32_t rkey;
		} atomic;
	} wr;
	uint32_t remote_srqn;
	uint64_t bind_mw_or_tso[6];
};

struct ibv_wc {
	uint64_t wr_id;
	int status;
	int opcode;
	uint32_t vendor_err;
	uint32_t byte_len;
	uint32_t imm_data;
	uint32_t qp_num;
	uint32_t src_qp;
	unsigned int wc_flags;
	uint16_t pkey_index;
	uint16_t slid;
	uint8_t sl;
	uint8_t dlid_path_bits;
};

/* The prefix of struct ibv_port_attr that ibv_query_port@IBVERBS_1.1 fills. */
struct compat_port_attr {
	int state, max_mtu, active_mtu, gid_tbl_len;
	uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
	uint16_t pkey_tbl_len, lid, sm_lid;
	uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width,
		active_speed, phys_state, link_layer;
};

_Static_assert(sizeof(struct ibv_context_ops) == 32 * 8, "ops");
_Static_assert(sizeof(struct ibv_context) == 328, "context");
_Static_assert(sizeof(struct ibv_send_wr) == 128, "send_wr");
_Static_assert(sizeof(struct ibv_wc) == 48, "wc");
_Static_assert(sizeof(struct ibv_qp_attr) == 144, "qp_attr");
_Static_assert(sizeof(struct ibv_qp) == 160, "qp");
_Static_assert(sizeof(struct ibv_cq) == 128, "cq");
_Static_assert(sizeof(struct ibv_comp_channel) == 16, "comp_channel");

enum { QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_SQD, QPS_SQE, QPS_ERR };
enum {
	QP_STATE = 1 << 0, QP_ACCESS_FLAGS = 1 << 3, QP_PKEY_INDEX = 1 << 4, QP_PORT = 1 << 5,
	QP_AV = 1 << 7, QP_PATH_MTU = 1 << 8, QP_TIMEOUT = 1 << 9, QP_RETRY_CNT = 1 << 10,
	QP_RNR_RETRY = 1 << 11, QP_RQ_PSN = 1 << 12, QP_MAX_QP_RD_ATOMIC = 1 << 13,
	QP_MIN_RNR_TIMER = 1 << 15, QP_SQ_PSN = 1 << 16, QP_MAX_DEST_RD_ATOMIC = 1 << 17,
	QP_DEST_QPN = 1 << 20,
};
enum { ACCESS_LOCAL_WRITE = 1, ACCESS_REMOTE_WRITE = 2, ACCESS_REMOTE_READ = 4 };
enum { WR_RDMA_WRITE = 0, WR_RDMA_READ = 4 };
enum { SEND_SIGNALED = 1 << 1 };
enum { WC_SUCCESS = 0, WC_LOC_PROT_ERR = 4, WC_WR_FLUSH_ERR = 5, WC_REM_ACCESS_ERR = 10,
       WC_RETRY_EXC_ERR = 12 };
enum { WC_OP_RDMA_WRITE = 1, WC_OP_RDMA_READ = 2 };
enum { QPT_RC = 2 };

/* ---- emulator state (one lock; work runs synchronously under it) ---- */

struct emu_device {
	struct ibv_device dev;
	int index;
	int down;
	uint64_t bytes;
	uint64_t ops;
	uint64_t fail_after; /* go down once bytes >= this (0: never) */
};

struct emu_context {
	struct ibv_context ctx;
	struct emu_device *dev;
};

struct emu_mr {
	struct ibv_mr mr;
	int access;
	/* A dma-buf MR: where this process sees the bytes the MR addresses from
	 * mr.addr (the iova); NULL for ordinary MRs, whose addresses are the bytes. */
	char *dma_view;
	void *dma_map;
	size_t dma_map_len;
	int slot; /* its fabric entry; -1: none */
	struct emu_mr *next;
};

struct emu_cq {
	struct ibv_cq cq;
	struct ibv_wc *ring;
	int cap, head, count;
	int overrun;
	int armed;                /* the next completion queues an event */
	uint32_t events_reported; /* events handed out by ibv_get_cq_event */
};

struct emu_event {
	struct ibv_cq *cq;
	struct emu_event *next;
};

/* The fd (an eventfd) holds a non-zero count exactly while `head` is non-empty. */
struct emu_channel {
	struct ibv_comp_channel ch;
	struct emu_event *head, *tail;
};

/* A completion kept back by verbs_emu_hold_completions. */
struct held_wc {
	struct ibv_cq *cq;
	struct ibv_wc wc;
	struct held_wc *next;
};

struct emu_qp {
	struct ibv_qp qp;
	struct emu_device *dev;
	int access;
	uint32_t dest_qpn;
	union ibv_gid dgid;
	int sig_all;
	int slot; /* its fabric entry; -1: none */
	struct emu_qp *next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct emu_device devices[MAX_DEVICES];
static int ndevices;
static struct emu_mr *mrs;
static struct emu_qp *qps;
static uint32_t next_key = 0x1000;
static uint32_t next_qpn = 0x100;
static uint32_t next_handle = 1;
static uint64_t cq_events; /* events read through ibv_get_cq_event */
static int holding;
static struct held_wc *held_head, *held_tail;
static int nheld;
static pthread_cond_t held_cond = PTHREAD_COND_INITIALIZER;

static int fab_attach(const char *path);

static void init_devices(void)
{
	const char *env = getenv("VERBS_EMU_DEVICES");
	int n = env ? atoi(env) : 2;
	const char *path = getenv("VERBS_EMU_FABRIC");
	if (path && *path && fab_attach(path) != 0) {
		/* No devices rather than a silently process-local emulator. */
		fprintf(stderr, "verbs_emu: VERBS_EMU_FABRIC=%s: %s\n", path, strerror(errno));
		n = 0;
	}
	if (n < 0)
		n = 0;
	if (n > MAX_DEVICES)
		n = MAX_DEVICES;
	ndevices = n;
	for (int i = 0; i < n; i++) {
		struct emu_device *d = &devices[i];
		memset(d, 0, sizeof(*d));
		d->index = i;
		d->dev.node_type = 1;      /* IBV_NODE_CA */
		d->dev.transport_type = 0; /* IBV_TRANSPORT_IB */
		snprintf(d->dev.name, sizeof(d->dev.name), "emu%d", i);
		snprintf(d->dev.dev_name, sizeof(d->dev.dev_name), "uverbs-emu%d", i);
		snprintf(d->dev.dev_path, sizeof(d->dev.dev_path), "/emu/uverbs%d", i);
		snprintf(d->dev.ibdev_path, sizeof(d->dev.ibdev_path), "/emu/emu%d", i);
	}
}

static void device_gid(const struct emu_device *d, union ibv_gid *gid)
{
	uint32_t pid = (uint32_t)getpid();
	memset(gid, 0, sizeof(*gid));
	gid->raw[0] = 0xfe;
	gid->raw[1] = 0x80;
	gid->raw[8] = (uint8_t)(pid >> 24);
	gid->raw[9] = (uint8_t)(pid >> 16);
	gid->raw[10] = (uint8_t)(pid >> 8);
	gid->raw[11] = (uint8_t)pid;
	gid->raw[15] = (uint8_t)d->index;
}

static struct emu_device *device_named(const char *name)
{
	pthread_once(&once, init_devices);
	for (int i = 0; i < ndevices; i++)
		if (strcmp(devices[i].dev.name, name) == 0)
			return &devices[i];
	return NULL;
}

static struct emu_device *dev_of(struct ibv_context *ctx)
{
	return ((struct emu_context *)ctx)->dev;
}

/* ---- the shared fabric (VERBS_EMU_FABRIC): registry of every process's QPs and MRs ---- */

#define FAB_MAGIC 0x3162614675656d76ULL /* "vemuFab1" */
#define FAB_VERSION 1
#define FAB_QPS 4096
#define FAB_MRS 8192
#define QPN_FIRST 0x100
#define QPN_LAST 0xffffff /* QP numbers are 24 bits on the wire */

/* pid 0: a free slot. The start time (clock ticks after boot) tells a reused pid apart. */
struct fab_owner {
	int32_t pid;
	uint32_t pad;
	uint64_t start;
};

struct fab_qp {
	struct fab_owner owner;
	uint32_t qpn, pd, dest_qpn;
	int32_t state, access;
	uint8_t gid[16];
};

struct fab_mr {
	struct fab_owner owner;
	uint32_t rkey, pd;
	int32_t access;
	uint64_t addr, length;
	uint64_t reach; /* where the owner's CPU reaches `addr` */
};

struct fabric {
	uint64_t magic;
	uint32_t version, size;
	pthread_mutex_t mutex; /* process-shared, robust: a process may die holding it */
	uint32_t next_qpn, next_key;
	uint32_t qps_used, mrs_used; /* one past the highest slot in use */
	struct fab_qp qps[FAB_QPS];
	struct fab_mr mrs[FAB_MRS];
};

static struct fabric *fab; /* NULL: this process is on its own */
static uint64_t self_start;

/* The start time of process `pid` (field 22 of /proc/<pid>/stat); 0 when it is gone
 * or a zombie, whose memory is gone too. */
static uint64_t proc_start(pid_t pid)
{
	char path[64], buf[1024];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	/* The command name (field 2) may hold spaces and parentheses: count from its end. */
	char *p = strrchr(buf, ')');
	if (!p || p[1] != ' ' || p[2] == 'Z' || p[2] == 'X')
		return 0;
	for (int i = 0; i < 20 && p; i++) /* the space before field 3, ..., before field 22 */
		p = strchr(p + 1, ' ');
	return p ? strtoull(p + 1, NULL, 10) : 0;
}

static int owner_alive(const struct fab_owner *o)
{
	if (o->pid == (int32_t)getpid() && o->start == self_start)
		return 1;
	return o->pid > 0 && proc_start(o->pid) == o->start;
}

static void set_owner(struct fab_owner *o)
{
	o->pid = (int32_t)getpid();
	o->start = self_start;
}

static void fab_lock(void)
{
	if (pthread_mutex_lock(&fab->mutex) == EOWNERDEAD)
		/* Its holder died between single-field updates; reclaim drops its entries. */
		pthread_mutex_consistent(&fab->mutex);
}

static void fab_unlock(void)
{
	pthread_mutex_unlock(&fab->mutex);
}

/* Lowers the high-water marks past freed slots (under the fabric lock). */
static void fab_trim(void)
{
	while (fab->qps_used > 0 && fab->qps[fab->qps_used - 1].owner.pid == 0)
		fab->qps_used--;
	while (fab->mrs_used > 0 && fab->mrs[fab->mrs_used - 1].owner.pid == 0)
		fab->mrs_used--;
}

/* Frees the entries of processes that are gone (under the fabric lock); returns how many. */
static int fab_reclaim(void)
{
	int freed = 0;
	for (uint32_t i = 0; i < fab->qps_used; i++)
		if (fab->qps[i].owner.pid && !owner_alive(&fab->qps[i].owner)) {
			memset(&fab->qps[i], 0, sizeof(fab->qps[i]));
			freed++;
		}
	for (uint32_t i = 0; i < fab->mrs_used; i++)
		if (fab->mrs[i].owner.pid && !owner_alive(&fab->mrs[i].owner)) {
			memset(&fab->mrs[i], 0, sizeof(fab->mrs[i]));
			freed++;
		}
	fab_trim();
	return freed;
}

static struct fab_qp *fab_find_qp(uint32_t qpn)
{
	for (uint32_t i = 0; i < fab->qps_used; i++)
		if (fab->qps[i].owner.pid && fab->qps[i].qpn == qpn)
			return &fab->qps[i];
	return NULL;
}

static struct fab_mr *fab_find_mr(uint32_t rkey)
{
	for (uint32_t i = 0; i < fab->mrs_used; i++)
		if (fab->mrs[i].owner.pid && fab->mrs[i].rkey == rkey)
			return &fab->mrs[i];
	return NULL;
}

/* A free QP slot, reclaiming gone processes' entries when none is (under the fabric
 * lock); -1 when the table is full. */
static int fab_qp_slot(void)
{
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < FAB_QPS; i++)
			if (fab->qps[i].owner.pid == 0) {
				if ((uint32_t)i >= fab->qps_used)
					fab->qps_used = (uint32_t)i + 1;
				return i;
			}
		if (pass == 0 && fab_reclaim() == 0)
			break;
	}
	return -1;
}

static int fab_mr_slot(void)
{
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < FAB_MRS; i++)
			if (fab->mrs[i].owner.pid == 0) {
				if ((uint32_t)i >= fab->mrs_used)
					fab->mrs_used = (uint32_t)i + 1;
				return i;
			}
		if (pass == 0 && fab_reclaim() == 0)
			break;
	}
	return -1;
}

/* The next QP number no live QP has (under the fabric lock; the table is smaller than
 * the number space, so this ends). */
static uint32_t fab_new_qpn(void)
{
	for (;;) {
		uint32_t n = fab->next_qpn;
		fab->next_qpn = n >= QPN_LAST ? QPN_FIRST : n + 1;
		if (!fab_find_qp(n))
			return n;
	}
}

static uint32_t fab_new_key(void)
{
	for (;;) {
		uint32_t k = fab->next_key++;
		if (k != 0 && !fab_find_mr(k))
			return k;
	}
}

/* Publishes q's state, destination and access (under the emulator lock). */
static void fab_sync_qp(const struct emu_qp *q)
{
	if (q->slot < 0)
		return;
	fab_lock();
	struct fab_qp *e = &fab->qps[q->slot];
	e->state = q->qp.state;
	e->dest_qpn = q->dest_qpn;
	e->access = q->access;
	fab_unlock();
}

static void fab_free_qp(struct emu_qp *q)
{
	if (q->slot < 0)
		return;
	fab_lock();
	memset(&fab->qps[q->slot], 0, sizeof(fab->qps[q->slot]));
	fab_trim();
	fab_unlock();
	q->slot = -1;
}

static void fab_free_mr(struct emu_mr *m)
{
	if (m->slot < 0)
		return;
	fab_lock();
	memset(&fab->mrs[m->slot], 0, sizeof(fab->mrs[m->slot]));
	fab_trim();
	fab_unlock();
	m->slot = -1;
}

static void fab_init(struct fabric *f)
{
	memset(f, 0, sizeof(*f));
	pthread_mutexattr_t a;
	pthread_mutexattr_init(&a);
	pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
	pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
	pthread_mutex_init(&f->mutex, &a);
	pthread_mutexattr_destroy(&a);
	f->version = FAB_VERSION;
	f->size = (uint32_t)sizeof(*f);
	f->next_qpn = QPN_FIRST;
	f->next_key = 0x1000;
	f->magic = FAB_MAGIC;
}

/* Maps the fabric file, creating or (re)initializing it under flock, so that processes
 * attaching at once agree on one mutex. */
static int fab_attach(const char *path)
{
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return -1;
	struct fabric *f = MAP_FAILED;
	struct stat st;
	if (flock(fd, LOCK_EX) == 0 && fstat(fd, &st) == 0 &&
	    (st.st_size == (off_t)sizeof(*f) ||
	     (ftruncate(fd, 0) == 0 && ftruncate(fd, (off_t)sizeof(*f)) == 0)))
		f = mmap(NULL, sizeof(*f), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (f != MAP_FAILED &&
	    (f->magic != FAB_MAGIC || f->version != FAB_VERSION || f->size != sizeof(*f)))
		fab_init(f);
	int e = errno;
	/* Explicitly: the mapping keeps the open file, and so a flock on it, alive. */
	flock(fd, LOCK_UN);
	close(fd);
	if (f == MAP_FAILED) {
		errno = e;
		return -1;
	}
	self_start = proc_start(getpid());
	if (self_start == 0) {
		/* Without /proc, owners could not be told alive from gone. */
		munmap(f, sizeof(*f));
		errno = ENOENT;
		return -1;
	}
	fab = f;
	fab_lock();
	fab_reclaim();
	fab_unlock();
	return 0;
}

/* ---- data path (static in real providers; reached through context->ops) ---- */

static struct emu_mr *find_mr(uint32_t key, int remote, struct ibv_pd *pd)
{
	for (struct emu_mr *m = mrs; m; m = m->next)
		if ((remote ? m->mr.rkey : m->mr.lkey) == key)
			return m->mr.pd == pd ? m : NULL;
	return NULL;
}

static int in_range(uint64_t start, uint64_t length, uint64_t addr, uint64_t len)
{
	return addr >= start && len <= length && addr - start <= length - len;
}

static int in_mr(const struct emu_mr *m, uint64_t addr, uint64_t len)
{
	return in_range((uint64_t)(uintptr_t)m->mr.addr, m->mr.length, addr, len);
}

/* Where the CPU (standing in for the NIC's DMA engine) reaches addr of m. */
static char *dma_ptr(const struct emu_mr *m, uint64_t addr)
{
	if (!m->dma_view)
		return (char *)(uintptr_t)addr;
	return m->dma_view + (addr - (uint64_t)(uintptr_t)m->mr.addr);
}

static struct emu_qp *find_qp(uint32_t qpn)
{
	for (struct emu_qp *q = qps; q; q = q->next)
		if (q->qp.qp_num == qpn)
			return q;
	return NULL;
}

static void eventfd_set(int fd, int readable)
{
	uint64_t v = 1;
	ssize_t r;
	if (readable)
		r = write(fd, &v, sizeof(v));
	else
		r = read(fd, &v, sizeof(v));
	(void)r; /* a counter already set (or already clear) is the state we want */
}

/* Queues an event for `cq` on its channel (under the lock). */
static void queue_event(struct ibv_cq *cq)
{
	struct emu_channel *ch = (struct emu_channel *)cq->channel;
	struct emu_event *e = calloc(1, sizeof(*e));
	if (!e)
		return; /* out of memory: the event is lost, as an overflowing queue would */
	e->cq = cq;
	if (ch->tail)
		ch->tail->next = e;
	else
		ch->head = e;
	ch->tail = e;
	if (ch->head == e)
		eventfd_set(ch->ch.fd, 1);
}

/* Drops the events still queued for `cq` (under the lock), as destroying a CQ does. */
static void purge_events(struct ibv_cq *cq)
{
	struct emu_channel *ch = (struct emu_channel *)cq->channel;
	if (!ch)
		return;
	int had = ch->head != NULL;
	struct emu_event **p = &ch->head;
	ch->tail = NULL;
	while (*p) {
		if ((*p)->cq == cq) {
			struct emu_event *e = *p;
			*p = e->next;
			free(e);
		} else {
			ch->tail = *p;
			p = &(*p)->next;
		}
	}
	if (had && !ch->head)
		eventfd_set(ch->ch.fd, 0);
}

static void push_wc(struct ibv_cq *cq, const struct ibv_wc *wc)
{
	struct emu_cq *c = (struct emu_cq *)cq;
	if (c->count == c->cap) {
		c->overrun = 1;
		return;
	}
	c->ring[(c->head + c->count) % c->cap] = *wc;
	c->count++;
	if (c->armed && cq->channel) {
		c->armed = 0;
		queue_event(cq);
	}
}

/* Delivers a completion now, or keeps it back while holding (under the lock). */
static void complete(struct ibv_cq *cq, const struct ibv_wc *wc)
{
	if (!holding) {
		push_wc(cq, wc);
		return;
	}
	struct held_wc *h = calloc(1, sizeof(*h));
	if (!h) {
		push_wc(cq, wc);
		return;
	}
	h->cq = cq;
	h->wc = *wc;
	if (held_tail)
		held_tail->next = h;
	else
		held_head = h;
	held_tail = h;
	nheld++;
	pthread_cond_broadcast(&held_cond);
}

static void account(struct emu_device *d, uint64_t bytes)
{
	d->bytes += bytes;
	d->ops++;
	if (d->fail_after && d->bytes >= d->fail_after)
		d->down = 1;
}

/* Checks the local SGEs of `wr` (bounds, lkey of q's PD, local write for a READ) and
 * fills `iov` with where the CPU reaches them; returns a completion status. */
static int local_sges(struct emu_qp *q, struct ibv_send_wr *wr, struct iovec *iov,
		      uint64_t *total)
{
	int read = wr->opcode == WR_RDMA_READ;
	*total = 0;
	for (int i = 0; i < wr->num_sge; i++) {
		struct ibv_sge *s = &wr->sg_list[i];
		struct emu_mr *m = find_mr(s->lkey, 0, q->qp.pd);
		if (!m || !in_mr(m, s->addr, s->length) || (read && !(m->access & ACCESS_LOCAL_WRITE)))
			return WC_LOC_PROT_ERR;
		iov[i].iov_base = dma_ptr(m, s->addr);
		iov[i].iov_len = s->length;
		*total += s->length;
	}
	return WC_SUCCESS;
}

/* A request to a QP of another process (under both locks): the in-process checks
 * against the fabric's entries, then the owner's memory through process_vm_*. */
static int execute_remote(struct emu_qp *q, struct ibv_send_wr *wr, uint64_t *total)
{
	struct fab_qp *peer = fab_find_qp(q->dest_qpn);
	if (!peer || (peer->state != QPS_RTR && peer->state != QPS_RTS) ||
	    memcmp(peer->gid, q->dgid.raw, 16) != 0 || peer->dest_qpn != q->qp.qp_num ||
	    !owner_alive(&peer->owner))
		return WC_RETRY_EXC_ERR;
	struct iovec local[16];
	int status = local_sges(q, wr, local, total);
	if (status != WC_SUCCESS)
		return status;
	int read = wr->opcode == WR_RDMA_READ;
	int need = read ? ACCESS_REMOTE_READ : ACCESS_REMOTE_WRITE;
	uint64_t raddr = wr->wr.rdma.remote_addr;
	struct fab_mr *r = fab_find_mr(wr->wr.rdma.rkey);
	if (!r || r->owner.pid != peer->owner.pid || r->owner.start != peer->owner.start ||
	    r->pd != peer->pd || !(r->access & need) || !(peer->access & need) ||
	    !in_range(r->addr, r->length, raddr, *total))
		return WC_REM_ACCESS_ERR;
	if (*total == 0)
		return WC_SUCCESS;
	struct iovec remote = {(void *)(uintptr_t)(r->reach + (raddr - r->addr)), *total};
	unsigned long n = (unsigned long)wr->num_sge;
	ssize_t done = read ? process_vm_readv(peer->owner.pid, local, n, &remote, 1, 0)
			    : process_vm_writev(peer->owner.pid, local, n, &remote, 1, 0);
	if (done < 0 && errno == EPERM) {
		static int told;
		if (!told++)
			fprintf(stderr, "verbs_emu: process_vm_%s(%d): %s (ptrace restrictions?)\n",
				read ? "readv" : "writev", (int)peer->owner.pid, strerror(errno));
	}
	if (done < 0 && errno != EFAULT)
		return WC_RETRY_EXC_ERR; /* gone (ESRCH) or out of reach */
	if (done < 0 || (uint64_t)done != *total)
		return WC_REM_ACCESS_ERR; /* its memory went away under the MR */
	return WC_SUCCESS;
}

/* Runs one RDMA READ/WRITE; returns the completion status. */
static int execute(struct emu_qp *q, struct ibv_send_wr *wr, uint32_t *moved)
{
	*moved = 0;
	if (q->dev->down)
		return WC_RETRY_EXC_ERR;
	struct emu_qp *peer = find_qp(q->dest_qpn);
	uint64_t total;
	if (!peer && fab) {
		/* Under the fabric lock throughout, so the owner cannot deregister the MR (and
		 * free its memory) while the bytes move. */
		fab_lock();
		int status = execute_remote(q, wr, &total);
		fab_unlock();
		if (status == WC_SUCCESS) {
			account(q->dev, total);
			*moved = (uint32_t)total;
		}
		return status;
	}
	union ibv_gid peer_gid;
	if (!peer || peer->dev->down || (peer->qp.state != QPS_RTR && peer->qp.state != QPS_RTS))
		return WC_RETRY_EXC_ERR;
	device_gid(peer->dev, &peer_gid);
	if (memcmp(peer_gid.raw, q->dgid.raw, 16) != 0 || peer->dest_qpn != q->qp.qp_num)
		return WC_RETRY_EXC_ERR;
	struct iovec local[16];
	int status = local_sges(q, wr, local, &total);
	if (status != WC_SUCCESS)
		return status;
	int read = wr->opcode == WR_RDMA_READ;
	int need = read ? ACCESS_REMOTE_READ : ACCESS_REMOTE_WRITE;
	struct emu_mr *r = find_mr(wr->wr.rdma.rkey, 1, peer->qp.pd);
	if (!r || !(r->access & need) || !(peer->access & need) ||
	    !in_mr(r, wr->wr.rdma.remote_addr, total))
		return WC_REM_ACCESS_ERR;
	char *remote = dma_ptr(r, wr->wr.rdma.remote_addr);
	for (int i = 0; i < wr->num_sge; i++) {
		if (read)
			memmove(local[i].iov_base, remote, local[i].iov_len);
		else
			memmove(remote, local[i].iov_base, local[i].iov_len);
		remote += local[i].iov_len;
	}
	account(q->dev, total);
	if (peer->dev != q->dev)
		account(peer->dev, total);
	*moved = (uint32_t)total;
	return WC_SUCCESS;
}

static int emu_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	struct emu_qp *q = (struct emu_qp *)qp;
	int rc = 0;
	pthread_mutex_lock(&lock);
	for (; wr; wr = wr->next) {
		if (qp->state != QPS_RTS && qp->state != QPS_ERR) {
			rc = EINVAL;
			break;
		}
		if ((wr->opcode != WR_RDMA_WRITE && wr->opcode != WR_RDMA_READ) || wr->num_sge < 0 ||
		    wr->num_sge > 16) {
			rc = EINVAL;
			break;
		}
		struct ibv_wc wc;
		memset(&wc, 0, sizeof(wc));
		wc.wr_id = wr->wr_id;
		wc.qp_num = qp->qp_num;
		wc.opcode = wr->opcode == WR_RDMA_READ ? WC_OP_RDMA_READ : WC_OP_RDMA_WRITE;
		if (qp->state == QPS_ERR) {
			wc.status = WC_WR_FLUSH_ERR;
		} else {
			uint32_t moved;
			wc.status = execute(q, wr, &moved);
			wc.byte_len = moved;
			if (wc.status != WC_SUCCESS) {
				qp->state = QPS_ERR;
				fab_sync_qp(q);
			}
		}
		if (wc.status != WC_SUCCESS || q->sig_all || (wr->send_flags & SEND_SIGNALED))
			complete(qp->send_cq, &wc);
	}
	pthread_mutex_unlock(&lock);
	if (rc && bad)
		*bad = wr;
	return rc;
}

static int emu_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	(void)qp;
	if (bad)
		*bad = wr;
	return EOPNOTSUPP; /* the emulator only does one-sided RDMA */
}

static int emu_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
	struct emu_cq *c = (struct emu_cq *)cq;
	int got = 0;
	pthread_mutex_lock(&lock);
	if (c->overrun) {
		pthread_mutex_unlock(&lock);
		return -EOVERFLOW;
	}
	while (got < n && c->count > 0) {
		wc[got++] = c->ring[c->head];
		c->head = (c->head + 1) % c->cap;
		c->count--;
	}
	pthread_mutex_unlock(&lock);
	return got;
}

static int emu_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
	(void)solicited_only; /* RDMA READ/WRITE completions are never solicited */
	pthread_mutex_lock(&lock);
	((struct emu_cq *)cq)->armed = 1;
	pthread_cond_broadcast(&held_cond); /* verbs_emu_wait_held_armed may be waiting */
	pthread_mutex_unlock(&lock);
	return 0;
}

/* ---- exported verbs ---- */

EXPORT struct ibv_device **ibv_get_device_list(int *num)
{
	pthread_once(&once, init_devices);
	struct ibv_device **list = calloc((size_t)ndevices + 1, sizeof(*list));
	if (!list) {
		errno = ENOMEM;
		return NULL;
	}
	for (int i = 0; i < ndevices; i++)
		list[i] = &devices[i].dev;
	if (num)
		*num = ndevices;
	return list;
}

EXPORT void ibv_free_device_list(struct ibv_device **list)
{
	free(list);
}

EXPORT const char *ibv_get_device_name(struct ibv_device *dev)
{
	return dev->name;
}

EXPORT struct ibv_context *ibv_open_device(struct ibv_device *dev)
{
	struct emu_context *c = calloc(1, sizeof(*c));
	if (!c) {
		errno = ENOMEM;
		return NULL;
	}
	c->dev = (struct emu_device *)dev;
	c->ctx.device = dev;
	c->ctx.cmd_fd = -1;
	c->ctx.async_fd = -1;
	c->ctx.num_comp_vectors = 1;
	pthread_mutex_init(&c->ctx.mutex, NULL);
	c->ctx.ops.poll_cq = emu_poll_cq;
	c->ctx.ops.req_notify_cq = emu_req_notify_cq;
	c->ctx.ops.post_send = emu_post_send;
	c->ctx.ops.post_recv = emu_post_recv;
	return &c->ctx;
}

EXPORT int ibv_close_device(struct ibv_context *ctx)
{
	/* The kernel would release what is left on the device: peers lose sight of it. */
	pthread_mutex_lock(&lock);
	for (struct emu_qp *q = qps; q; q = q->next)
		if (q->qp.context == ctx)
			fab_free_qp(q);
	for (struct emu_mr *m = mrs; m; m = m->next)
		if (m->mr.context == ctx)
			fab_free_mr(m);
	pthread_mutex_unlock(&lock);
	free(ctx);
	return 0;
}

EXPORT int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct compat_port_attr *attr)
{
	if (port != 1)
		return EINVAL;
	struct emu_device *d = dev_of(ctx);
	memset(attr, 0, sizeof(*attr));
	pthread_mutex_lock(&lock);
	attr->state = d->down ? 1 /* DOWN */ : 4 /* ACTIVE */;
	attr->phys_state = d->down ? 3 /* disabled */ : 5 /* link up */;
	pthread_mutex_unlock(&lock);
	attr->max_mtu = 5;
	attr->active_mtu = 5;
	attr->gid_tbl_len = 1;
	attr->max_msg_sz = 1u << 31;
	attr->pkey_tbl_len = 1;
	attr->lid = (uint16_t)(d->index + 1);
	attr->sm_lid = 1;
	attr->link_layer = 1; /* InfiniBand */
	return 0;
}

EXPORT int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid)
{
	if (port != 1 || index != 0)
		return EINVAL;
	device_gid(dev_of(ctx), gid);
	return 0;
}

EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx)
{
	struct ibv_pd *pd = calloc(1, sizeof(*pd));
	if (!pd) {
		errno = ENOMEM;
		return NULL;
	}
	pd->context = ctx;
	pthread_mutex_lock(&lock);
	pd->handle = next_handle++;
	pthread_mutex_unlock(&lock);
	return pd;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd *pd)
{
	pthread_mutex_lock(&lock);
	for (struct emu_mr *m = mrs; m; m = m->next)
		if (m->mr.pd == pd) {
			pthread_mutex_unlock(&lock);
			return EBUSY;
		}
	pthread_mutex_unlock(&lock);
	free(pd);
	return 0;
}

/* Whether the CPU can read addr (the kernel pins pages for an MR; memory mapped
 * PROT_NONE, such as the fake GPU drivers' device memory, cannot be pinned). */
static int readable(const void *addr)
{
	char byte;
	struct iovec local = {&byte, 1}, remote = {(void *)addr, 1};
	return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == 1;
}

static struct ibv_mr *add_mr(struct ibv_pd *pd, void *addr, size_t length, int access, char *view,
			     void *map, size_t map_len)
{
	struct emu_mr *m = calloc(1, sizeof(*m));
	if (!m) {
		errno = ENOMEM;
		return NULL;
	}
	m->mr.context = pd->context;
	m->mr.pd = pd;
	m->mr.addr = addr;
	m->mr.length = length;
	m->access = access;
	m->dma_view = view;
	m->dma_map = map;
	m->dma_map_len = map_len;
	m->slot = -1;
	pthread_mutex_lock(&lock);
	m->mr.handle = next_handle++;
	if (fab) {
		fab_lock();
		m->slot = fab_mr_slot();
		if (m->slot >= 0) {
			struct fab_mr *e = &fab->mrs[m->slot];
			set_owner(&e->owner);
			m->mr.lkey = fab_new_key();
			m->mr.rkey = fab_new_key();
			e->rkey = m->mr.rkey;
			e->pd = pd->handle;
			e->access = access;
			e->addr = (uint64_t)(uintptr_t)addr;
			e->length = length;
			e->reach = (uint64_t)(uintptr_t)(view ? view : addr);
		}
		fab_unlock();
		if (m->slot < 0) {
			pthread_mutex_unlock(&lock);
			free(m);
			errno = ENOMEM; /* the fabric's MR table is full */
			return NULL;
		}
	} else {
		m->mr.lkey = next_key++;
		m->mr.rkey = next_key++;
	}
	m->next = mrs;
	mrs = m;
	pthread_mutex_unlock(&lock);
	return &m->mr;
}

static int bad_access(int access)
{
	/* Remote write needs local write, as in the kernel. */
	return (access & ACCESS_REMOTE_WRITE) && !(access & ACCESS_LOCAL_WRITE);
}

EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)
{
	if (!pd || (!addr && length) || length == 0 || bad_access(access)) {
		errno = EINVAL;
		return NULL;
	}
	if (!readable(addr) || !readable((char *)addr + length - 1)) {
		errno = EFAULT;
		return NULL;
	}
	return add_mr(pd, addr, length, access, NULL, NULL, 0);
}

/* The NIC maps the dma-buf (here: mmap of the exporter's fd) and addresses it from
 * iova; the exporter's own mapping of those bytes is never touched. */
EXPORT struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
					uint64_t iova, int fd, int access)
{
	if (!pd || length == 0 || iova == 0 || fd < 0 || bad_access(access)) {
		errno = EINVAL;
		return NULL;
	}
	struct stat st;
	if (fstat(fd, &st) != 0 || offset + length < offset || offset + length > (uint64_t)st.st_size) {
		errno = EINVAL;
		return NULL;
	}
	uint64_t start = offset & ~(uint64_t)4095;
	size_t map_len = (size_t)(offset + length - start);
	void *map = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)start);
	if (map == MAP_FAILED)
		return NULL;
	struct ibv_mr *mr = add_mr(pd, (void *)(uintptr_t)iova, length, access,
				   (char *)map + (offset - start), map, map_len);
	if (!mr)
		munmap(map, map_len);
	return mr;
}

EXPORT int ibv_dereg_mr(struct ibv_mr *mr)
{
	pthread_mutex_lock(&lock);
	for (struct emu_mr **p = &mrs; *p; p = &(*p)->next)
		if (&(*p)->mr == mr) {
			struct emu_mr *m = *p;
			*p = m->next;
			/* Before the caller may free the memory: no peer copies into it after this. */
			fab_free_mr(m);
			pthread_mutex_unlock(&lock);
			if (m->dma_map)
				munmap(m->dma_map, m->dma_map_len);
			free(m);
			return 0;
		}
	pthread_mutex_unlock(&lock);
	return EINVAL;
}

EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *ctx)
{
	struct emu_channel *ch = calloc(1, sizeof(*ch));
	if (!ch) {
		errno = ENOMEM;
		return NULL;
	}
	ch->ch.context = ctx;
	ch->ch.fd = eventfd(0, EFD_CLOEXEC);
	if (ch->ch.fd < 0) {
		int e = errno;
		free(ch);
		errno = e;
		return NULL;
	}
	return &ch->ch;
}

EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *channel)
{
	struct emu_channel *ch = (struct emu_channel *)channel;
	pthread_mutex_lock(&lock);
	if (channel->refcnt) {
		pthread_mutex_unlock(&lock);
		return EBUSY;
	}
	pthread_mutex_unlock(&lock);
	close(channel->fd);
	free(ch);
	return 0;
}

EXPORT int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq,
			    void **cq_context)
{
	struct emu_channel *ch = (struct emu_channel *)channel;
	for (;;) {
		pthread_mutex_lock(&lock);
		struct emu_event *e = ch->head;
		if (e) {
			ch->head = e->next;
			if (!ch->head) {
				ch->tail = NULL;
				eventfd_set(channel->fd, 0);
			}
			((struct emu_cq *)e->cq)->events_reported++;
			cq_events++;
			pthread_cond_broadcast(&held_cond); /* verbs_emu_wait_cq_events may wait */
			pthread_mutex_unlock(&lock);
			*cq = e->cq;
			*cq_context = e->cq->cq_context;
			free(e);
			return 0;
		}
		pthread_mutex_unlock(&lock);
		int flags = fcntl(channel->fd, F_GETFL);
		if (flags < 0)
			return -1;
		if (flags & O_NONBLOCK) {
			errno = EAGAIN;
			return -1;
		}
		struct pollfd p = {.fd = channel->fd, .events = POLLIN};
		if (poll(&p, 1, -1) < 0 && errno != EINTR)
			return -1;
	}
}

EXPORT void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents)
{
	pthread_mutex_lock(&lock);
	cq->comp_events_completed += nevents;
	pthread_mutex_unlock(&lock);
}

EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_context,
				    struct ibv_comp_channel *channel, int comp_vector)
{
	(void)comp_vector;
	/* A channel serves the CQs of its own device only. */
	if (cqe < 1 || cqe > (1 << 22) || (channel && channel->context != ctx)) {
		errno = EINVAL;
		return NULL;
	}
	struct emu_cq *c = calloc(1, sizeof(*c));
	if (c)
		c->ring = calloc((size_t)cqe, sizeof(struct ibv_wc));
	if (!c || !c->ring) {
		free(c);
		errno = ENOMEM;
		return NULL;
	}
	c->cap = cqe;
	c->cq.context = ctx;
	c->cq.channel = channel;
	c->cq.cq_context = cq_context;
	c->cq.cqe = cqe;
	pthread_mutex_lock(&lock);
	c->cq.handle = next_handle++;
	if (channel)
		channel->refcnt++;
	pthread_mutex_unlock(&lock);
	return &c->cq;
}

EXPORT int ibv_destroy_cq(struct ibv_cq *cq)
{
	struct emu_cq *c = (struct emu_cq *)cq;
	pthread_mutex_lock(&lock);
	for (struct emu_qp *q = qps; q; q = q->next)
		if (q->qp.send_cq == cq || q->qp.recv_cq == cq) {
			pthread_mutex_unlock(&lock);
			return EBUSY;
		}
	if (c->events_reported != cq->comp_events_completed) {
		pthread_mutex_unlock(&lock);
		return EBUSY;
	}
	purge_events(cq);
	for (struct held_wc **p = &held_head; *p;) {
		if ((*p)->cq == cq) {
			struct held_wc *h = *p;
			*p = h->next;
			free(h);
			nheld--;
		} else {
			p = &(*p)->next;
		}
	}
	held_tail = NULL;
	for (struct held_wc *h = held_head; h; h = h->next)
		held_tail = h;
	if (cq->channel)
		cq->channel->refcnt--;
	pthread_mutex_unlock(&lock);
	free(c->ring);
	free(c);
	return 0;
}

EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
	if (!pd || !attr || attr->qp_type != QPT_RC || !attr->send_cq || !attr->recv_cq ||
	    attr->send_cq->context != pd->context) {
		errno = EINVAL;
		return NULL;
	}
	struct emu_qp *q = calloc(1, sizeof(*q));
	if (!q) {
		errno = ENOMEM;
		return NULL;
	}
	q->qp.context = pd->context;
	q->qp.qp_context = attr->qp_context;
	q->qp.pd = pd;
	q->qp.send_cq = attr->send_cq;
	q->qp.recv_cq = attr->recv_cq;
	q->qp.qp_type = QPT_RC;
	q->qp.state = QPS_RESET;
	q->dev = dev_of(pd->context);
	q->sig_all = attr->sq_sig_all;
	q->slot = -1;
	pthread_mutex_lock(&lock);
	q->qp.handle = next_handle++;
	if (fab) {
		fab_lock();
		q->slot = fab_qp_slot();
		if (q->slot >= 0) {
			struct fab_qp *e = &fab->qps[q->slot];
			union ibv_gid gid;
			device_gid(q->dev, &gid);
			set_owner(&e->owner);
			q->qp.qp_num = fab_new_qpn();
			e->qpn = q->qp.qp_num;
			e->pd = pd->handle;
			e->state = QPS_RESET;
			memcpy(e->gid, gid.raw, 16);
		}
		fab_unlock();
		if (q->slot < 0) {
			pthread_mutex_unlock(&lock);
			free(q);
			errno = ENOMEM; /* the fabric's QP table is full */
			return NULL;
		}
	} else {
		q->qp.qp_num = next_qpn++;
	}
	q->next = qps;
	qps = q;
	pthread_mutex_unlock(&lock);
	return &q->qp;
}

EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
	struct emu_qp *q = (struct emu_qp *)qp;
	int rc = 0;
	pthread_mutex_lock(&lock);
	int cur = qp->state;
	int next = (mask & QP_STATE) ? attr->qp_state : cur;
	int need = 0;
	if (next == QPS_RESET || next == QPS_ERR) {
		need = 0;
	} else if (cur == QPS_RESET && next == QPS_INIT) {
		need = QP_PKEY_INDEX | QP_PORT | QP_ACCESS_FLAGS;
	} else if (cur == QPS_INIT && next == QPS_RTR) {
		need = QP_AV | QP_PATH_MTU | QP_DEST_QPN | QP_RQ_PSN | QP_MAX_DEST_RD_ATOMIC |
		       QP_MIN_RNR_TIMER;
	} else if (cur == QPS_RTR && next == QPS_RTS) {
		need = QP_SQ_PSN | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_MAX_QP_RD_ATOMIC;
	} else if (!(mask & QP_STATE) || cur == next) {
		need = 0;
	} else {
		rc = EINVAL;
	}
	if (!rc && (mask & need) != need)
		rc = EINVAL;
	if (!rc && (mask & QP_PORT) && attr->port_num != 1)
		rc = EINVAL;
	if (!rc && q->dev->down && next != QPS_RESET && next != QPS_ERR && next != cur)
		rc = EIO; /* the port is down: no transition to a working state */
	if (!rc) {
		if (mask & QP_ACCESS_FLAGS)
			q->access = (int)attr->qp_access_flags;
		if (mask & QP_DEST_QPN)
			q->dest_qpn = attr->dest_qp_num;
		if (mask & QP_AV) {
			if (!attr->ah_attr.is_global)
				rc = EINVAL; /* the emulator routes by GID only */
			else
				q->dgid = attr->ah_attr.grh.dgid;
		}
	}
	if (!rc)
		qp->state = next;
	fab_sync_qp(q);
	pthread_mutex_unlock(&lock);
	return rc;
}

EXPORT int ibv_destroy_qp(struct ibv_qp *qp)
{
	pthread_mutex_lock(&lock);
	for (struct emu_qp **p = &qps; *p; p = &(*p)->next)
		if (&(*p)->qp == qp) {
			struct emu_qp *q = *p;
			*p = q->next;
			fab_free_qp(q);
			pthread_mutex_unlock(&lock);
			free(q);
			return 0;
		}
	pthread_mutex_unlock(&lock);
	return EINVAL;
}

/* ---- fault injection and counters (emulator only) ---- */

EXPORT int verbs_emu_fail_device(const char *name, int down)
{
	struct emu_device *d = device_named(name);
	if (!d)
		return ENODEV;
	pthread_mutex_lock(&lock);
	d->down = down != 0;
	if (!down)
		d->fail_after = 0;
	pthread_mutex_unlock(&lock);
	return 0;
}

/* The device goes down once `bytes` more bytes have gone through it. */
EXPORT int verbs_emu_fail_after(const char *name, uint64_t bytes)
{
	struct emu_device *d = device_named(name);
	if (!d)
		return ENODEV;
	pthread_mutex_lock(&lock);
	d->fail_after = d->bytes + (bytes ? bytes : 1);
	pthread_mutex_unlock(&lock);
	return 0;
}

EXPORT int verbs_emu_fail_qp(uint32_t qp_num)
{
	pthread_mutex_lock(&lock);
	struct emu_qp *q = find_qp(qp_num);
	if (q) {
		q->qp.state = QPS_ERR;
		fab_sync_qp(q);
	}
	pthread_mutex_unlock(&lock);
	return q ? 0 : ENOENT;
}

EXPORT uint64_t verbs_emu_bytes(const char *name)
{
	struct emu_device *d = device_named(name);
	uint64_t b = 0;
	pthread_mutex_lock(&lock);
	if (d)
		b = d->bytes;
	pthread_mutex_unlock(&lock);
	return b;
}

EXPORT uint64_t verbs_emu_ops(const char *name)
{
	struct emu_device *d = device_named(name);
	uint64_t n = 0;
	pthread_mutex_lock(&lock);
	if (d)
		n = d->ops;
	pthread_mutex_unlock(&lock);
	return n;
}

/* QPs currently alive (to check that endpoints are evicted and destroyed). */
EXPORT int verbs_emu_qp_count(void)
{
	int n = 0;
	pthread_mutex_lock(&lock);
	for (struct emu_qp *q = qps; q; q = q->next)
		n++;
	pthread_mutex_unlock(&lock);
	return n;
}

/* Fabric entries (QPs and MRs) owned by process `pid`; -1 without a fabric. */
EXPORT int verbs_emu_fabric_entries(int pid)
{
	pthread_once(&once, init_devices);
	if (!fab || pid <= 0)
		return -1;
	int n = 0;
	fab_lock();
	for (uint32_t i = 0; i < fab->qps_used; i++)
		n += fab->qps[i].owner.pid == pid;
	for (uint32_t i = 0; i < fab->mrs_used; i++)
		n += fab->mrs[i].owner.pid == pid;
	fab_unlock();
	return n;
}

/* Frees the fabric entries of processes that are gone now; returns how many. */
EXPORT int verbs_emu_fabric_reclaim(void)
{
	pthread_once(&once, init_devices);
	if (!fab)
		return 0;
	fab_lock();
	int n = fab_reclaim();
	fab_unlock();
	return n;
}

/* Waits on `held_cond` (with `lock` held) until `done(arg)`, or `timeout_ms` passes:
 * every change these waits are for broadcasts `held_cond`. */
static void wait_locked(int (*done)(const void *arg), const void *arg, int timeout_ms)
{
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += timeout_ms / 1000;
	until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	while (!done(arg) && pthread_cond_timedwait(&held_cond, &lock, &until) == 0)
		;
}

/* Total CQ events read through ibv_get_cq_event. */
EXPORT uint64_t verbs_emu_cq_events(void)
{
	pthread_mutex_lock(&lock);
	uint64_t n = cq_events;
	pthread_mutex_unlock(&lock);
	return n;
}

static int events_read(const void *n)
{
	return cq_events >= *(const uint64_t *)n;
}

/* Waits up to `timeout_ms` until at least `n` CQ events have been read in all; returns
 * how many have. */
EXPORT uint64_t verbs_emu_wait_cq_events(uint64_t n, int timeout_ms)
{
	pthread_mutex_lock(&lock);
	wait_locked(events_read, &n, timeout_ms);
	uint64_t got = cq_events;
	pthread_mutex_unlock(&lock);
	return got;
}

/* on: keep completions back from here on; off: deliver the held ones, in order. */
EXPORT void verbs_emu_hold_completions(int on)
{
	pthread_mutex_lock(&lock);
	holding = on != 0;
	if (!holding) {
		struct held_wc *h = held_head;
		held_head = held_tail = NULL;
		nheld = 0;
		while (h) {
			struct held_wc *next = h->next;
			push_wc(h->cq, &h->wc);
			free(h);
			h = next;
		}
	}
	pthread_mutex_unlock(&lock);
}

static int held_at_least(const void *n)
{
	return nheld >= *(const int *)n;
}

/* Waits up to `timeout_ms` until at least `n` completions are held; returns how many are. */
EXPORT int verbs_emu_wait_held(int n, int timeout_ms)
{
	pthread_mutex_lock(&lock);
	wait_locked(held_at_least, &n, timeout_ms);
	int got = nheld;
	pthread_mutex_unlock(&lock);
	return got;
}

/* Whether every CQ a held completion is bound for is armed (under the lock). */
static int held_cqs_armed(const void *unused)
{
	(void)unused;
	for (struct held_wc *h = held_head; h; h = h->next)
		if (!((struct emu_cq *)h->cq)->armed)
			return 0;
	return 1;
}

/* Waits up to `timeout_ms` until every CQ a held completion is bound for is armed (so
 * delivering them raises channel events); returns whether they all are. */
EXPORT int verbs_emu_wait_held_armed(int timeout_ms)
{
	pthread_mutex_lock(&lock);
	wait_locked(held_cqs_armed, NULL, timeout_ms);
	int armed = held_cqs_armed(NULL);
	pthread_mutex_unlock(&lock);
	return armed;
}
