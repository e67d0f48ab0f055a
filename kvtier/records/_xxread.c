/*
 * A raw record read from a file and checked in one native call (kvtier.records._xxcopy's
 * xxh3_64_read_check): its head and checksum, then its payload straight into the caller's row
 * a piece at a time, each piece hashed just after its pread lands it, while it is still in
 * this core's cache, with no Python between the pieces. Called without the GIL.
 */
#include <errno.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_xxh3.h"

/* preadv, again after an interruption: the bytes read, or -1 with errno set. A regular file
   reads short only at its end (or once cut), which the callers count as a record of another
   length. */
static ssize_t pread_retrying(int fd, struct iovec *iov, int count, off_t at)
{
    ssize_t got;
    do
        got = preadv(fd, iov, count, at);
    while (got < 0 && errno == EINTR);
    return got;
}

XXC_INTERNAL int xxc_read_check(stripes_fn stripes, int fd, const u8 *head, size_t hlen, const u8 *prefix, size_t plen,
                                u8 *stored, u8 *row, size_t n, size_t piece)
{
    u8 spare; /* a record of the right length never reaches it; a longer one is refused */
    if (piece == 0 || plen + n < XXH3_RUN_MIN)
        piece = n;
    size_t first = n <= piece ? n : piece;
    struct iovec iov[3] = {{stored, hlen + 8}, {row, first}, {&spare, 1}};
    ssize_t got = pread_retrying(fd, iov, first == n ? 3 : 2, 0);
    if (got < 0)
        return -errno;
    if ((size_t)got != hlen + 8 + first)
        return XXC_CHECK_SHAPE;
    if (memcmp(stored, head, hlen) != 0)
        return XXC_CHECK_HEAD;
    u64 digest;
    if (first == n) {
        digest = xxh3_copy(stripes, prefix, plen, row, NULL, n);
    } else {
        xxh3_run run;
        xxh3_run_begin(&run, stripes, prefix, plen, row, n);
        xxh3_run_feed(&run, first);
        for (size_t at = first; at < n;) {
            size_t end = n - at > piece ? at + piece : n;
            struct iovec rest[2] = {{row + at, end - at}, {&spare, 1}};
            got = pread_retrying(fd, rest, end == n ? 2 : 1, (off_t)(hlen + 8 + at));
            if (got < 0)
                return -errno;
            if ((size_t)got != end - at)
                return XXC_CHECK_SHAPE;
            xxh3_run_feed(&run, end);
            at = end;
        }
        digest = xxh3_run_end(&run);
    }
    return digest == read64(stored + hlen) ? XXC_CHECK_GOOD : XXC_CHECK_SUM;
}
