/* Writing to a socket another process holds open, without Python in the way (see shm/peer_fds.py).
 *
 * A worker answering an HTTP client directly borrows the frontend's socket: pidfd_getfd and a
 * check that the duplicate is still the socket the request came on (its inode), then, for each
 * answer, a send that neither blocks nor raises SIGPIPE. One C call each instead of several
 * through ctypes and os; peer_fds.py keeps the ctypes path for installs without extensions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438 /* Linux 5.6+, on the architectures with the common syscall table */
#endif

/* borrow(pidfd, fd, ino) -> int
 *
 * A duplicate of the peer's descriptor fd (the caller closes it) if it is the socket with inode
 * ino; -ESTALE if fd names another socket by now; -errno when pidfd_getfd itself failed, for the
 * caller to tell a refusal from a process that is gone.
 */
static PyObject *borrow(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "borrow(pidfd, fd, ino) takes 3 arguments");
        return NULL;
    }
    int pidfd = (int)PyLong_AsLong(args[0]);
    int fd = (int)PyLong_AsLong(args[1]);
    unsigned long long ino = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    long dup = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    if (dup < 0)
        return PyLong_FromLong(-errno);
    struct stat st;
    if (fstat((int)dup, &st) == 0 && (unsigned long long)st.st_ino == ino)
        return PyLong_FromLong(dup);
    close((int)dup);
    return PyLong_FromLong(-ESTALE);
}

/* send_now(fd, data) -> int
 *
 * Bytes of data written to fd without blocking; 0 when none were (its buffer is full: EAGAIN;
 * the client left: EPIPE, ECONNRESET).
 */
static PyObject *send_now(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send_now(fd, data) takes 2 arguments");
        return NULL;
    }
    int fd = (int)PyLong_AsLong(args[0]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    ssize_t sent = send(fd, view.buf, (size_t)view.len, MSG_DONTWAIT | MSG_NOSIGNAL);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(sent < 0 ? 0 : sent);
}

static PyMethodDef methods[] = {
    {"borrow", (PyCFunction)(void (*)(void))borrow, METH_FASTCALL,
     "borrow(pidfd, fd, ino) -> a duplicate of the peer's fd, -ESTALE, or -errno of pidfd_getfd"},
    {"send_now", (PyCFunction)(void (*)(void))send_now, METH_FASTCALL,
     "send_now(fd, data) -> bytes written without blocking, or 0"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shm._peer_send", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__peer_send(void) { return PyModule_Create(&module); }
