/* Undo a truncation of shared memory this process maps, so that it costs the process no SIGBUS.
 *
 * A client of another user (--local-client-users) may write some of the objects a server process
 * maps (its own segment, broker.0, a worker's, their arenas' extents), and whoever may write a file
 * may also shrink it with ftruncate. A mapped page past the new end is then gone, and the next
 * touch of it is a SIGBUS, which would end the broker or a worker. POSIX shared memory cannot be
 * sealed against shrinking, so this handler undoes the shrink instead: on SIGBUS in a guarded
 * mapping it grows the file back to the size it had when guarded, and returns; the touch is made
 * again and finds a zero page. A truncation thus amounts to zeroing the end of the
 * object, which such a client could do anyway by writing zeros, and which every reader already
 * survives (whatever a client can write is bounds-checked before use).
 *
 * guard_restore() does the same without a fault, from a process's periodic checks, so that an
 * object is whole again for those that map it anew even when its owner does not touch it.
 *
 * A SIGBUS outside every guarded mapping, or one that keeps coming back at one address although
 * the file is whole (a page /dev/shm has no room for), goes to the handler that was there before,
 * as if this one did not exist.
 *
 * Loaded with ctypes by truncation_guard.py, which says what each guarded file is. No Python
 * headers: a plain shared object built by setuptools as an optional extension.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#define GUARD_CAPACITY 16384

enum { SLOT_FREE = 0, SLOT_FILLING = 1, SLOT_LIVE = 2, SLOT_LEAVING = 3 };

struct guarded_file {
    atomic_int state;
    int fd;               /* our own duplicate, open for writing */
    off_t size;           /* the size the process maps */
    uintptr_t start, end; /* where it is mapped */
};

/* Faults in a guarded mapping whose file was whole already: another process (or another thread's
 * fault) grew it back first, and the access is only made again. So many in a row at one address
 * mean that the page cannot be had (/dev/shm full): the fault is then the previous handler's. */
#define FUTILE_LIMIT 10000

static struct guarded_file table[GUARD_CAPACITY];
static atomic_int slots_used;        /* slots at or past this index were never filled */
static atomic_int handlers_running;  /* so that a slot's descriptor is not closed under a handler */
static atomic_ulong files_regrown;
static struct sigaction previous_action;
static atomic_int installed;
static atomic_uintptr_t futile_address;
static atomic_int futile_count;

/* Grow every guarded file that is shorter than its size back to it; how many were. */
static int regrow_shrunk(void)
{
    int regrown = 0;
    atomic_fetch_add(&handlers_running, 1);
    int used = atomic_load(&slots_used);
    for (int i = 0; i < used; i++) {
        struct guarded_file *g = &table[i];
        if (atomic_load(&g->state) != SLOT_LIVE)
            continue;
        struct stat st;
        if (fstat(g->fd, &st) == 0 && st.st_size < g->size && ftruncate(g->fd, g->size) == 0)
            regrown++;
    }
    atomic_fetch_sub(&handlers_running, 1);
    if (regrown)
        atomic_fetch_add(&files_regrown, (unsigned long)regrown);
    return regrown;
}

/* Hand the fault to the handler before ours, as if ours did not exist: a function is called (if
 * it returns, the access is made again and comes back here); the default action is put back, and
 * the access made again then ends the process. */
static void pass_on(int signo, siginfo_t *info, void *context)
{
    if ((previous_action.sa_flags & SA_SIGINFO) && previous_action.sa_sigaction != NULL) {
        previous_action.sa_sigaction(signo, info, context);
    } else if (!(previous_action.sa_flags & SA_SIGINFO) && previous_action.sa_handler != SIG_DFL &&
               previous_action.sa_handler != SIG_IGN) {
        previous_action.sa_handler(signo);
    } else {
        struct sigaction fatal = {0};
        fatal.sa_handler = SIG_DFL;
        sigemptyset(&fatal.sa_mask);
        sigaction(SIGBUS, &fatal, NULL);
    }
}

static void on_sigbus(int signo, siginfo_t *info, void *context)
{
    int saved_errno = errno;
    uintptr_t address = (uintptr_t)info->si_addr;
    int ours = 0, regrown = 0;
    atomic_fetch_add(&handlers_running, 1);
    int used = atomic_load(&slots_used);
    for (int i = 0; i < used; i++) {
        struct guarded_file *g = &table[i];
        if (atomic_load(&g->state) != SLOT_LIVE || address < g->start || address >= g->end)
            continue;
        ours = 1; /* (every slot that covers it: one of a mapping gone may still cover the address) */
        struct stat st;
        if (fstat(g->fd, &st) == 0 && st.st_size < g->size && ftruncate(g->fd, g->size) == 0)
            regrown = 1;
    }
    atomic_fetch_sub(&handlers_running, 1);
    if (regrown) {
        atomic_fetch_add(&files_regrown, 1);
        atomic_store(&futile_count, 0);
    } else if (ours) {
        /* Whole already: made again, unless it keeps failing at this address. */
        if (atomic_exchange(&futile_address, address) != address)
            atomic_store(&futile_count, 0);
        if (atomic_fetch_add(&futile_count, 1) >= FUTILE_LIMIT) {
            atomic_store(&futile_count, 0);
            pass_on(signo, info, context);
        }
    } else {
        pass_on(signo, info, context); /* not a mapping we guard */
    }
    errno = saved_errno;
}

/* A child forked while another thread was in the handler has no such thread: nothing runs there,
 * and guard_remove must not wait for it. */
static void after_fork_in_child(void)
{
    atomic_store(&handlers_running, 0);
    atomic_store(&futile_count, 0);
}

/* Install the handler once; 0 on success, else an errno value. */
int guard_install(void)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&installed, &expected, 1))
        return 0;
    struct sigaction action = {0};
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous_action) != 0) {
        int e = errno;
        atomic_store(&installed, 0);
        return e;
    }
    return pthread_atfork(NULL, NULL, after_fork_in_child);
}

/* Guard the file open as `fd` (duplicated here) at `size` bytes, mapped at `start`; the slot, or
 * -errno. */
int guard_add(int fd, long long size, void *start)
{
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0)
        return -errno;
    for (int i = 0; i < GUARD_CAPACITY; i++) {
        int expected = SLOT_FREE;
        if (!atomic_compare_exchange_strong(&table[i].state, &expected, SLOT_FILLING))
            continue;
        table[i].fd = own;
        table[i].size = (off_t)size;
        table[i].start = (uintptr_t)start;
        table[i].end = (uintptr_t)start + (uintptr_t)size;
        int used = atomic_load(&slots_used);
        while (used <= i && !atomic_compare_exchange_weak(&slots_used, &used, i + 1))
            ;
        atomic_store(&table[i].state, SLOT_LIVE);
        return i;
    }
    close(own);
    return -ENOSPC;
}

/* Stop guarding a slot guard_add returned, and close its descriptor. */
void guard_remove(int slot)
{
    if (slot < 0 || slot >= GUARD_CAPACITY)
        return;
    int expected = SLOT_LIVE;
    if (!atomic_compare_exchange_strong(&table[slot].state, &expected, SLOT_LEAVING))
        return;
    while (atomic_load(&handlers_running) > 0) /* a handler may still be using the descriptor */
        sched_yield();
    close(table[slot].fd);
    table[slot].fd = -1;
    atomic_store(&table[slot].state, SLOT_FREE);
}

/* Grow back now what was shrunk, before any touch of it: other processes may map the file anew,
 * and an empty one cannot be mapped. How many were. */
int guard_restore(void)
{
    return regrow_shrunk();
}

/* How many times a guarded file was grown back since the process started. */
unsigned long guard_regrown(void)
{
    return atomic_load(&files_regrown);
}
