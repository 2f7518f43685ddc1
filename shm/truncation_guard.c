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
 * The pages a truncation gave back are taken again only as they are touched, so a writer who
 * truncates and then fills /dev/shm leaves the file whole but a touched page with no room: the
 * fault comes back. The handler then takes that page with fallocate, and where /dev/shm has no
 * room, it puts a private zero page of this process in its place (MAP_FIXED), so the touch goes
 * on and the process lives. Such a page is no longer the object's: what this process writes there
 * nobody else sees. guard_restore() puts the object's page back once there is room again, for
 * mappings whose owner says when it is about to unmap them (guard_close), so that no page is ever
 * put into an address range another mapping may have taken since. fallocate keeps the file's size
 * (the last page of an object whose size is no multiple of a page lies partly past its end).
 *
 * A mapping guarded to be zeroed (GUARD_ZEROED: an object only its client's own requests use, a
 * registered region or the client's segment) is not grown back, neither at a fault nor by
 * guard_restore: its whole range is replaced by private zero pages at the first fault, and
 * guard_zeroed() says so, so that the copy runs on over zeros and its request is then refused
 * (guard_shrunk() tells a truncation nobody met yet). Grown back page by page, a copy of N pages racing a truncation in a loop faulted up to
 * N times, each fault waiting on the truncating process: seconds per MiB in a broker or a worker
 * that other clients wait for.
 *
 * A SIGBUS outside every guarded mapping, or one that keeps coming back at one address although
 * the file is whole and the page could be had or replaced, goes to the handler that was there
 * before, as if this one did not exist.
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
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GUARD_CAPACITY 16384

enum { SLOT_FREE = 0, SLOT_FILLING = 1, SLOT_LIVE = 2, SLOT_LEAVING = 3 };

/* What becomes of a page of a guarded mapping that /dev/shm has no room for. */
enum {
    PAGES_REPLACED = 1, /* replaced by a private zero page, for the mapping's life */
    PAGES_RESTORED = 2, /* replaced, and the object's page put back by guard_restore once there is room */
};

/* guard_add's mode, bits: GUARD_RESTORABLE, the mapping's owner says when it unmaps (guard_close),
 * so a replaced page may be put back; GUARD_ZEROED, a truncation met zeroes the mapping instead of
 * growing the file back. */
enum { GUARD_RESTORABLE = 1, GUARD_ZEROED = 2 };

struct guarded_file {
    atomic_int state;
    atomic_int pages;     /* PAGES_*: what a page with no room may become */
    atomic_int zero;      /* GUARD_ZEROED asked, and the mapping not about to be unmapped */
    atomic_int zeroed;    /* its range was replaced by zero pages (a truncation met) */
    int fd;               /* our own duplicate, open for writing */
    int prot, flags;      /* the mapping's protection and MAP_SHARED or MAP_PRIVATE */
    off_t size;           /* the size the process maps */
    uintptr_t start, end; /* where it is mapped */
};

/* A page replaced by a private zero page, whose object's page guard_restore may put back. */
struct replaced_page {
    atomic_int state; /* SLOT_FREE, SLOT_FILLING or SLOT_LIVE */
    int slot;
    uintptr_t address;
};

#define REPLACED_CAPACITY 65536 /* (zero until used: costs no memory before) */

/* Faults in a guarded mapping whose file was whole already: another process (or another thread's
 * fault) grew it back first, and the access is only made again. So many in a row at one address
 * mean that the page cannot be had (/dev/shm full): the fault is then the previous handler's. */
#define FUTILE_LIMIT 10000

static struct guarded_file table[GUARD_CAPACITY];
static atomic_int slots_used;        /* slots at or past this index were never filled */
static atomic_int handlers_running;  /* so that a slot's descriptor is not closed under a handler */
static atomic_ulong files_regrown;
static struct replaced_page replaced[REPLACED_CAPACITY];
static atomic_int replaced_used;    /* entries at or past this index were never filled */
static atomic_ulong pages_replaced, pages_restored;
static uintptr_t page_size;
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
        if (atomic_load(&g->state) != SLOT_LIVE || atomic_load(&g->zero) || atomic_load(&g->zeroed))
            continue; /* (one to be zeroed is its owner's to keep whole: guard_shrunk says it is not) */
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

/* Remember a replaced page of `slot`, for guard_restore; nothing when the table is full (the page
 * then stays this process's until the mapping goes). */
static void remember_replaced(int slot, uintptr_t page)
{
    for (int i = 0; i < REPLACED_CAPACITY; i++) {
        int expected = SLOT_FREE;
        if (!atomic_compare_exchange_strong(&replaced[i].state, &expected, SLOT_FILLING))
            continue;
        replaced[i].slot = slot;
        replaced[i].address = page;
        int used = atomic_load(&replaced_used);
        while (used <= i && !atomic_compare_exchange_weak(&replaced_used, &used, i + 1))
            ;
        atomic_store(&replaced[i].state, SLOT_LIVE);
        return;
    }
}

/* A fault in a guarded mapping whose file is whole: take the page (fallocate), or where /dev/shm
 * has no room for it put a private zero page in its place. */
static void take_or_replace(uintptr_t address, int used)
{
    uintptr_t page = address & ~(page_size - 1);
    int no_room = -1; /* a slot whose file has no room for the page */
    for (int i = 0; i < used; i++) {
        struct guarded_file *g = &table[i];
        if (atomic_load(&g->state) != SLOT_LIVE || atomic_load(&g->zeroed) || page < g->start || page >= g->end)
            continue;
        /* (KEEP_SIZE: the last page of an object whose size is no multiple of it stays as long) */
        if (fallocate(g->fd, FALLOC_FL_KEEP_SIZE, (off_t)(page - g->start), (off_t)page_size) == 0)
            return; /* there was room: the page is the file's now */
        if (errno == ENOSPC || errno == ENOMEM)
            no_room = i;
    }
    if (no_room < 0)
        return;
    struct guarded_file *g = &table[no_room];
    if (mmap((void *)page, page_size, g->prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
        return;
    atomic_fetch_add(&pages_replaced, 1);
    if (atomic_load(&g->pages) == PAGES_RESTORED)
        remember_replaced(no_room, page);
}

/* Put back the object's page in place of each replaced one that /dev/shm has room for again; how
 * many. Only for mappings still PAGES_RESTORED: their owner calls guard_close before unmapping. */
static int restore_replaced(void)
{
    int restored = 0;
    atomic_fetch_add(&handlers_running, 1);
    int used = atomic_load(&replaced_used);
    for (int i = 0; i < used; i++) {
        struct replaced_page *r = &replaced[i];
        if (atomic_load(&r->state) != SLOT_LIVE)
            continue;
        struct guarded_file *g = &table[r->slot];
        if (atomic_load(&g->state) != SLOT_LIVE || atomic_load(&g->pages) != PAGES_RESTORED)
            continue;
        off_t offset = (off_t)(r->address - g->start);
        if (fallocate(g->fd, FALLOC_FL_KEEP_SIZE, offset, (off_t)page_size) != 0)
            continue; /* still no room */
        if (mmap((void *)r->address, page_size, g->prot, g->flags | MAP_FIXED, g->fd, offset) == MAP_FAILED)
            continue;
        int expected = SLOT_LIVE;
        if (atomic_compare_exchange_strong(&r->state, &expected, SLOT_FREE))
            restored++;
    }
    atomic_fetch_sub(&handlers_running, 1);
    if (restored)
        atomic_fetch_add(&pages_restored, (unsigned long)restored);
    return restored;
}

/* Forget the replaced pages of `slot`. */
static void forget_replaced(int slot)
{
    int used = atomic_load(&replaced_used);
    for (int i = 0; i < used; i++) {
        int expected = SLOT_LIVE;
        if (atomic_load(&replaced[i].state) == SLOT_LIVE && replaced[i].slot == slot)
            atomic_compare_exchange_strong(&replaced[i].state, &expected, SLOT_FREE);
    }
}

/* Replace the whole range of `g` by private zero pages; 0 where that cannot be had, the range
 * still mapping the file then (the caller grows the file back instead). Made elsewhere first and
 * moved in place: a MAP_FIXED mapping the kernel refuses (its memory not committable: a sparse
 * object larger than memory and swap, or the commit limit reached) has unmapped the range already
 * before Linux 6.12, and the access made again would be a SIGSEGV. MAP_NORESERVE: zero pages read
 * commit nothing, and only an output copied over them takes pages. */
static int zero_range(const struct guarded_file *g)
{
    size_t length = (size_t)(g->end - g->start);
    void *fresh = mmap(NULL, length, g->prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (fresh == MAP_FAILED)
        return 0;
    if (mremap(fresh, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)g->start) == MAP_FAILED) {
        munmap(fresh, length);
        return 0;
    }
    return 1;
}

static void on_sigbus(int signo, siginfo_t *info, void *context)
{
    int saved_errno = errno;
    uintptr_t address = (uintptr_t)info->si_addr;
    int ours = 0, regrown = 0, zeroed = 0;
    atomic_fetch_add(&handlers_running, 1);
    int used = atomic_load(&slots_used);
    for (int i = 0; i < used; i++) {
        struct guarded_file *g = &table[i];
        if (atomic_load(&g->state) != SLOT_LIVE || address < g->start || address >= g->end)
            continue;
        ours = 1; /* (every slot that covers it: one of a mapping gone may still cover the address) */
        struct stat st;
        int shrunk = fstat(g->fd, &st) == 0 && st.st_size < g->size;
        /* (zeroed already: a page put back meanwhile by guard_restore, zeroed again) */
        if ((shrunk || atomic_load(&g->zeroed)) && atomic_load(&g->zero) && zero_range(g)) {
            atomic_store(&g->pages, PAGES_REPLACED); /* (no page of the object is put back there) */
            forget_replaced(i);
            atomic_store(&g->zeroed, 1);
            zeroed = 1; /* (the access made again finds a zero page) */
        } else if (shrunk && ftruncate(g->fd, g->size) == 0) {
            regrown = 1;
        }
    }
    if (ours && !regrown && !zeroed)
        take_or_replace(address, used);
    atomic_fetch_sub(&handlers_running, 1);
    if (regrown || zeroed) {
        if (regrown)
            atomic_fetch_add(&files_regrown, 1);
        atomic_store(&futile_count, 0);
    } else if (ours) {
        /* Whole already (and the page taken or replaced where it could be): made again, unless it
         * keeps failing at this address all the same, as it would with a hardware error. */
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
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous_action) != 0) {
        int e = errno;
        atomic_store(&installed, 0);
        return e;
    }
    return pthread_atfork(NULL, NULL, after_fork_in_child);
}

/* Guard the file open as `fd` (duplicated here) at `size` bytes, mapped at `start` with `prot` and
 * `flags` (MAP_SHARED or MAP_PRIVATE); `mode`: GUARD_* bits. The slot, or -errno. */
int guard_add(int fd, long long size, void *start, int prot, int flags, int mode)
{
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0)
        return -errno;
    for (int i = 0; i < GUARD_CAPACITY; i++) {
        int expected = SLOT_FREE;
        if (!atomic_compare_exchange_strong(&table[i].state, &expected, SLOT_FILLING))
            continue;
        table[i].fd = own;
        table[i].prot = prot;
        table[i].flags = flags & (MAP_SHARED | MAP_PRIVATE);
        atomic_store(&table[i].pages, (mode & GUARD_RESTORABLE) ? PAGES_RESTORED : PAGES_REPLACED);
        atomic_store(&table[i].zero, (mode & GUARD_ZEROED) != 0);
        atomic_store(&table[i].zeroed, 0);
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

/* The mapping of a slot is about to be unmapped: from now on no page of it is put back (its
 * address range may soon be another mapping's, or it stays mapped as long as a view of it lives);
 * faults in it are still undone, and a page with no room replaced. */
void guard_close(int slot)
{
    if (slot < 0 || slot >= GUARD_CAPACITY || atomic_load(&table[slot].state) != SLOT_LIVE)
        return;
    atomic_store(&table[slot].pages, PAGES_REPLACED);
    atomic_store(&table[slot].zero, 0); /* (nor is the range zeroed: it may be another mapping's soon) */
    while (atomic_load(&handlers_running) > 0) /* one may have read the old value */
        sched_yield();
    forget_replaced(slot);
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
    forget_replaced(slot);
    close(table[slot].fd);
    table[slot].fd = -1;
    atomic_store(&table[slot].state, SLOT_FREE);
}

/* Grow back now what was shrunk, before any touch of it: other processes may map the file anew,
 * and an empty one cannot be mapped; and put back the object's pages that were replaced, where
 * there is room again. How many files were grown back. */
int guard_restore(void)
{
    int regrown = regrow_shrunk();
    restore_replaced();
    return regrown;
}

/* How many pages with no room were replaced by private zero pages, and how many of those were
 * put back, since the process started. */
unsigned long guard_replaced(void)
{
    return atomic_load(&pages_replaced);
}

unsigned long guard_restored(void)
{
    return atomic_load(&pages_restored);
}

/* How many replaced pages are still waiting to be put back. */
int guard_waiting(void)
{
    int waiting = 0, used = atomic_load(&replaced_used);
    for (int i = 0; i < used; i++)
        waiting += atomic_load(&replaced[i].state) == SLOT_LIVE;
    return waiting;
}

/* Whether a GUARD_ZEROED slot's mapping was zeroed: a truncation met, what was copied from or into
 * it since is not the object's. */
int guard_zeroed(int slot)
{
    if (slot < 0 || slot >= GUARD_CAPACITY)
        return 0;
    return atomic_load(&table[slot].zeroed);
}

/* Whether a slot's file is shorter now than the size it was guarded at. */
int guard_shrunk(int slot)
{
    if (slot < 0 || slot >= GUARD_CAPACITY || atomic_load(&table[slot].state) != SLOT_LIVE)
        return 0;
    struct stat st;
    return fstat(table[slot].fd, &st) == 0 && st.st_size < table[slot].size;
}

/* How many times a guarded file was grown back since the process started. */
unsigned long guard_regrown(void)
{
    return atomic_load(&files_regrown);
}
