/* clockshift: an LD_PRELOAD shim that sets a process's wall clock from a file.
 *
 * CLOCKSHIFT_FILE names a file holding a decimal number of microseconds since the epoch
 * (written in place by the test, fixed width); while it holds a number, gettimeofday(),
 * clock_gettime(CLOCK_REALTIME*) and time() return that time, frozen until the test writes
 * another. Without a number there, they return the real time. Monotonic clocks are untouched.
 * Used by tests/support/clockshift.py to give a private redis-server a clock the test drives.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static int fd = -2;

static int fake_us(long long *out) {
    if (fd == -2) {
        const char *path = getenv("CLOCKSHIFT_FILE");
        fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    }
    if (fd < 0) return 0;
    char buf[32];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *end;
    long long us = strtoll(buf, &end, 10);
    if (end == buf) return 0;
    *out = us;
    return 1;
}

int gettimeofday(struct timeval *tv, void *tz) {
    long long us;
    if (tv && fake_us(&us)) {
        tv->tv_sec = us / 1000000;
        tv->tv_usec = us % 1000000;
        return 0;
    }
    return (int)syscall(SYS_gettimeofday, tv, tz);
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    long long us;
    if (ts && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE) && fake_us(&us)) {
        ts->tv_sec = us / 1000000;
        ts->tv_nsec = (us % 1000000) * 1000;
        return 0;
    }
    return (int)syscall(SYS_clock_gettime, clk, ts);
}

time_t time(time_t *t) {
    long long us;
    time_t now;
    if (fake_us(&us)) {
        now = (time_t)(us / 1000000);
    } else {
        struct timespec ts;
        syscall(SYS_clock_gettime, CLOCK_REALTIME, &ts);
        now = ts.tv_sec;
    }
    if (t) *t = now;
    return now;
}
