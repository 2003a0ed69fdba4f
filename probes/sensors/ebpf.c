// fleettop per-agent kernel probes. Tracepoints only: many kernels (this one
// included) have no kprobes, and struct layouts from installed headers don't
// match the running kernel, so no task_struct field is read through a header.
//
// The loader (ebpf.py) prepends a block of #defines before compile:
//   MAX_AGENTS        number of agent slots (agent id = slot index)
//   EXIT_CODE_OFF     offset of task_struct.exit_code taken from the running
//                     kernel's BTF, or -1 when unknown (exit codes reported as -1)
//   HAVE_TASK_NEWTASK, HAVE_PAGE_FAULT_USER, HAVE_SOCK_LENGTH, HAVE_OOM,
//   HAVE_RSS_STAT     1 when the tracepoint exists in this kernel's tracefs
//   COUNT_SYSCALLS    1 to attach raw_syscalls:sys_enter (costs every process
//                     on the machine ~200 ns per syscall, watched or not)

#define CLONE_THREAD 0x00010000
// sched_switch prev_state: 0 = still runnable (preempted or yielded); bit 8
// (TASK_REPORT_MAX on 5.x/6.x) marks a preemption; anything else = blocked.
#define BLOCKED_MASK 0xff

#define EV_FORK 1
#define EV_EXEC 2
#define EV_EXIT 3
#define EV_OOM  4

// Per-thread state, keyed by tid. A thread of a watched process is in here;
// userspace seeds it from /proc/PID/task at watch time, fork adds, exit removes.
struct tinfo {
    u32 agent;
    u32 pad;
    u64 in_ts;       // when it last went on-CPU (0 while off-CPU)
    u64 preempt_ts;  // when it was last switched out still runnable (0 if blocked)
};

// Per-process state, keyed by tgid. RSS members are the kernel's absolute
// counters in bytes (file, anon, swap, shmem) as last reported by rss_stat.
struct pinfo {
    u32 agent;
    u32 pad;
    s64 rss[4];
};

// Per-agent counters. Cumulative; userspace turns them into rates.
struct agent_stats {
    u64 oncpu_ns;    // time on a CPU, all threads of the tree
    u64 runq_ns;     // time waiting for a CPU after a preemption
    u64 nvcsw;       // voluntary switches (the task blocked)
    u64 nivcsw;      // involuntary switches (preempted while runnable)
    u64 forks;       // new processes (threads are not counted)
    u64 execs;
    u64 exits;       // processes of the tree that exited
    u64 oom_kills;
    u64 faults;      // user page faults
    u64 tx_bytes;    // bytes sent on AF_INET/AF_INET6 sockets
    u64 rx_bytes;
    u64 syscalls;    // only with COUNT_SYSCALLS
    u64 drops;       // ring-buffer events lost because the buffer was full
};

struct event {
    u32 type;
    u32 agent;
    u32 tgid;
    u32 tid;
    u32 ppid;        // fork: parent tgid
    s32 status;      // exit: wait status (code << 8 | signal), -1 unknown
    char comm[16];
    char filename[64];
};

// tid -> thread state, for sched_switch (which only names tids).
BPF_HASH(tids, u32, struct tinfo, 65536);
// tgid -> process state: membership test for every probe, and per-process RSS.
BPF_HASH(procs, u32, struct pinfo, 16384);
// tid -> 1 for a clone with CLONE_THREAD seen by task_newtask, consumed by the
// fork probe right after (sched_process_fork alone can't tell a thread).
BPF_HASH(newthreads, u32, u8, 1024);
// agent slot -> counters, one copy per CPU so no probe contends on a cache line.
BPF_PERCPU_ARRAY(stats, struct agent_stats, MAX_AGENTS);
// fork/exec/exit/oom events for the watched trees (256 KiB: ~2300 events between
// two 20 ms polls of the loader).
BPF_RINGBUF_OUTPUT(events, 64);

static __always_inline struct agent_stats *agent_stats(u32 agent) {
    return stats.lookup(&agent);
}

static __always_inline struct pinfo *current_proc(void) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return procs.lookup(&tgid);
}

static __always_inline void emit(struct event *src) {
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        struct agent_stats *s = agent_stats(src->agent);
        if (s)
            s->drops++;
        return;
    }
    __builtin_memcpy(e, src, sizeof(struct event));
    events.ringbuf_submit(e, 0);
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid, next = args->next_pid;
    struct tinfo *t = tids.lookup(&prev);
    if (t) {
        struct agent_stats *s = agent_stats(t->agent);
        if (s) {
            if (t->in_ts)
                s->oncpu_ns += now - t->in_ts;
            if ((args->prev_state & BLOCKED_MASK) == 0) {
                s->nivcsw++;
                t->preempt_ts = now;
            } else {
                s->nvcsw++;
                t->preempt_ts = 0;
            }
        }
        t->in_ts = 0;
    }
    t = tids.lookup(&next);
    if (t) {
        if (t->preempt_ts) {
            struct agent_stats *s = agent_stats(t->agent);
            if (s)
                s->runq_ns += now - t->preempt_ts;
            t->preempt_ts = 0;
        }
        t->in_ts = now;
    }
    return 0;
}

#if HAVE_TASK_NEWTASK
TRACEPOINT_PROBE(task, task_newtask) {
    if (!(args->clone_flags & CLONE_THREAD) || !current_proc())
        return 0;
    u32 tid = args->pid;
    u8 one = 1;
    newthreads.update(&tid, &one);
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 ptgid = bpf_get_current_pid_tgid() >> 32;
    struct pinfo *p = procs.lookup(&ptgid);
    if (!p)
        return 0;
    u32 agent = p->agent;
    u32 child = args->child_pid;
    struct tinfo t = {.agent = agent};
    tids.update(&child, &t);
    if (newthreads.lookup(&child)) {
        newthreads.delete(&child);
        return 0;
    }
    struct pinfo np = {.agent = agent};
    procs.update(&child, &np);
    struct agent_stats *s = agent_stats(agent);
    if (s)
        s->forks++;
    struct event e = {.type = EV_FORK, .agent = agent, .tgid = child, .tid = child,
                      .ppid = ptgid, .status = -1};
    bpf_get_current_comm(&e.comm, sizeof(e.comm));
    emit(&e);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    u32 tgid = args->pid;
    struct pinfo *p = procs.lookup(&tgid);
    if (!p)
        return 0;
    // A new mm: the old counters are gone, the new ones arrive via rss_stat.
    p->rss[0] = p->rss[1] = p->rss[2] = p->rss[3] = 0;
    struct agent_stats *s = agent_stats(p->agent);
    if (s)
        s->execs++;
    struct event e = {.type = EV_EXEC, .agent = p->agent, .tgid = tgid, .tid = tgid,
                      .status = -1};
    bpf_get_current_comm(&e.comm, sizeof(e.comm));
    unsigned short off = args->data_loc_filename & 0xFFFF;
    bpf_probe_read_kernel_str(&e.filename, sizeof(e.filename), (char *)args + off);
    emit(&e);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id, tgid = id >> 32;
    // The task is on-CPU now and its last switch-out will find no entry: close
    // the slice here, or a task that never blocked would show no CPU at all.
    struct tinfo *t = tids.lookup(&tid);
    if (t && t->in_ts) {
        struct agent_stats *ts = agent_stats(t->agent);
        if (ts)
            ts->oncpu_ns += bpf_ktime_get_ns() - t->in_ts;
    }
    tids.delete(&tid);
    if (tid != tgid)
        procs.delete(&tid);  // a thread mistaken for a process (no task_newtask)
    if (!args->group_dead)
        return 0;
    struct pinfo *p = procs.lookup(&tgid);
    if (!p)
        return 0;
    u32 agent = p->agent;
    struct agent_stats *s = agent_stats(agent);
    if (s)
        s->exits++;
    struct event e = {.type = EV_EXIT, .agent = agent, .tgid = tgid, .tid = tid, .status = -1};
#if EXIT_CODE_OFF >= 0
    // Offset from the running kernel's BTF, not from headers: do_exit() stores
    // the wait status here before this tracepoint fires.
    void *task = (void *)bpf_get_current_task();
    int status = -1;
    bpf_probe_read_kernel(&status, sizeof(status), task + EXIT_CODE_OFF);
    e.status = status;
#endif
    bpf_probe_read_kernel(&e.comm, sizeof(e.comm), args->comm);
    procs.delete(&tgid);
    emit(&e);
    return 0;
}

#if HAVE_RSS_STAT
TRACEPOINT_PROBE(kmem, rss_stat) {
    // curr==0 means another mm (fork copying into the child, exit teardown,
    // reclaim): its tgid isn't current, so only curr==1 is attributable.
    if (!args->curr)
        return 0;
    struct pinfo *p = current_proc();
    if (!p)
        return 0;
    int m = args->member;
    if (m >= 0 && m < 4)
        p->rss[m] = args->size;
    return 0;
}
#endif

#if HAVE_OOM
TRACEPOINT_PROBE(oom, mark_victim) {
    // Runs in the allocating task's context: the victim is args->pid.
    u32 pid = args->pid;
    u32 agent;
    struct pinfo *p = procs.lookup(&pid);
    if (p) {
        agent = p->agent;
    } else {
        struct tinfo *t = tids.lookup(&pid);
        if (!t)
            return 0;
        agent = t->agent;
    }
    struct agent_stats *s = agent_stats(agent);
    if (s)
        s->oom_kills++;
    struct event e = {.type = EV_OOM, .agent = agent, .tgid = pid, .tid = pid, .status = -1};
    emit(&e);
    return 0;
}
#endif

#if HAVE_PAGE_FAULT_USER
TRACEPOINT_PROBE(exceptions, page_fault_user) {
    struct pinfo *p = current_proc();
    if (!p)
        return 0;
    struct agent_stats *s = agent_stats(p->agent);
    if (s)
        s->faults++;
    return 0;
}
#endif

#if HAVE_SOCK_LENGTH
static __always_inline int count_sock(u16 family, int ret, int rx) {
    if (ret <= 0 || (family != 2 && family != 10))  // AF_INET, AF_INET6
        return 0;
    struct pinfo *p = current_proc();
    if (!p)
        return 0;
    struct agent_stats *s = agent_stats(p->agent);
    if (!s)
        return 0;
    if (rx)
        s->rx_bytes += ret;
    else
        s->tx_bytes += ret;
    return 0;
}

TRACEPOINT_PROBE(sock, sock_send_length) {
    return count_sock(args->family, args->ret, 0);
}

TRACEPOINT_PROBE(sock, sock_recv_length) {
    if (args->flags & 2)  // MSG_PEEK: the bytes will be read again
        return 0;
    return count_sock(args->family, args->ret, 1);
}
#endif

#if COUNT_SYSCALLS
TRACEPOINT_PROBE(raw_syscalls, sys_enter) {
    struct pinfo *p = current_proc();
    if (!p)
        return 0;
    struct agent_stats *s = agent_stats(p->agent);
    if (s)
        s->syscalls++;
    return 0;
}
#endif
