/*
 * C tests of libiomapfs: the synchronous and asynchronous paths, error
 * codes and messages, buffer ownership. Run by crates/capi/tests/c_programs.rs
 * (natively, and under valgrind).
 *
 *   test_api DIR [sync|auto|uring]
 *
 * Each CHECK that fails prints where and the library's last error, and the
 * program exits 1.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "iomapfs.h"

static int checks;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        checks++;                                                                    \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__,   \
                    __LINE__, #cond, iomapfs_last_error());                          \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

/* The call returned -err and the message names `needle`. */
#define CHECK_ERR(call, err, needle)                                                 \
    do {                                                                             \
        long long r_ = (long long)(call);                                            \
        if (r_ != -(err))                                                            \
            fprintf(stderr, "%s returned %lld, want %d\n", #call, r_, -(err));       \
        CHECK(r_ == -(err));                                                         \
        CHECK(strstr(iomapfs_last_error(), (needle)) != NULL);                       \
    } while (0)

static void make_image(const char *path, off_t size)
{
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, size) == 0);
    close(fd);
}

static void pattern(unsigned char *p, size_t len, unsigned seed)
{
    for (size_t i = 0; i < len; i++)
        p[i] = (unsigned char)(seed * 31 + i * 7 + (i >> 9));
}

struct listing {
    char names[8][32];
    int n;
    int stop_at;
};

static int list_cb(void *ctx, const char *name, uint64_t ino, uint32_t kind)
{
    struct listing *l = ctx;
    (void)ino;
    (void)kind;
    if (l->n < 8)
        snprintf(l->names[l->n], sizeof l->names[0], "%s", name);
    l->n++;
    return l->n == l->stop_at ? 42 : 0;
}

static void test_sync(iomapfs_volume *vol)
{
    CHECK(iomapfs_mkdir(vol, "/d") == 0);
    iomapfs_file *f;
    CHECK(iomapfs_file_open(vol, "/d/f", IOMAPFS_O_CREAT | IOMAPFS_O_DIRECT, &f) == 0);

    unsigned char out[8192], in[12288];
    pattern(out, sizeof out, 1);
    CHECK(iomapfs_pwrite(f, out, sizeof out, 4096) == (int64_t)sizeof out);
    memset(in, 0xee, sizeof in);
    CHECK(iomapfs_pread(f, in, sizeof in, 0) == (int64_t)sizeof in);
    for (int i = 0; i < 4096; i++)
        CHECK(in[i] == 0); /* the hole before the write reads zeros */
    CHECK(memcmp(in + 4096, out, sizeof out) == 0);
    /* Unaligned offset, length and memory. */
    CHECK(iomapfs_pread(f, in + 1, 100, 4096 + 333) == 100);
    CHECK(memcmp(in + 1, out + 333, 100) == 0);
    /* Short at end of file, 0 past it. */
    CHECK(iomapfs_pread(f, in, 4096, 12288 - 10) == 10);
    CHECK(iomapfs_pread(f, in, 4096, 1 << 20) == 0);

    iomapfs_stat st;
    CHECK(iomapfs_file_stat(f, &st) == 0);
    CHECK(st.size == 12288 && st.kind == IOMAPFS_KIND_REGULAR && st.nlink == 1);
    CHECK(iomapfs_fsync(f) == 0);
    CHECK(iomapfs_fdatasync(f) == 0);

    /* fallocate: keep size, extend, punch; truncate. */
    CHECK(iomapfs_fallocate(f, IOMAPFS_FALLOC_KEEP_SIZE, 65536, 65536) == 0);
    CHECK(iomapfs_file_stat(f, &st) == 0 && st.size == 12288);
    CHECK(st.allocated_bytes >= 12288 + 65536 - 4096);
    CHECK(iomapfs_fallocate(f, 0, 12288, 4096) == 0);
    CHECK(iomapfs_file_stat(f, &st) == 0 && st.size == 16384);
    CHECK(iomapfs_fallocate(f, IOMAPFS_FALLOC_PUNCH_HOLE | IOMAPFS_FALLOC_KEEP_SIZE, 4096, 4096) == 0);
    CHECK(iomapfs_pread(f, in, 8192, 4096) == 8192);
    for (int i = 0; i < 4096; i++)
        CHECK(in[i] == 0);
    CHECK(memcmp(in + 4096, out + 4096, 4096) == 0);
    CHECK(iomapfs_truncate(f, 6000) == 0);
    CHECK(iomapfs_path_stat(vol, "/d/f", &st) == 0 && st.size == 6000);

    /* O_DSYNC writes through a second handle on the same file. */
    iomapfs_file *g;
    CHECK(iomapfs_file_open(vol, "/d/f", IOMAPFS_O_DSYNC, &g) == 0);
    CHECK(iomapfs_pwrite(g, "hello", 5, 10) == 5);
    CHECK(iomapfs_pread(f, in, 5, 10) == 5 && memcmp(in, "hello", 5) == 0);
    CHECK(iomapfs_file_close(g) == 0);

    /* Namespace. */
    iomapfs_file *h;
    CHECK(iomapfs_file_open(vol, "/d/b", IOMAPFS_O_CREAT, &h) == 0);
    CHECK(iomapfs_file_close(h) == 0);
    CHECK(iomapfs_mkdir(vol, "/d/a") == 0);
    struct listing l = { .n = 0, .stop_at = 0 };
    CHECK(iomapfs_readdir(vol, "/d", list_cb, &l) == 0);
    CHECK(l.n == 3);
    CHECK(strcmp(l.names[0], "a") == 0 && strcmp(l.names[1], "b") == 0 &&
          strcmp(l.names[2], "f") == 0);
    struct listing stop = { .n = 0, .stop_at = 2 };
    CHECK(iomapfs_readdir(vol, "/d", list_cb, &stop) == 42 && stop.n == 2);
    CHECK(iomapfs_rename(vol, "/d/b", "/d/c") == 0);
    CHECK(iomapfs_path_stat(vol, "/d/c", &st) == 0 && st.size == 0);
    CHECK_ERR(iomapfs_path_stat(vol, "/d/b", &st), ENOENT, "/d/b");
    CHECK(iomapfs_unlink(vol, "/d/c") == 0);
    CHECK(iomapfs_rmdir(vol, "/d/a") == 0);
    CHECK(iomapfs_path_stat(vol, "/d", &st) == 0 && st.kind == IOMAPFS_KIND_DIRECTORY);

    iomapfs_statfs sf;
    CHECK(iomapfs_volume_statfs(vol, &sf) == 0);
    CHECK(sf.block_size == 4096 && sf.free_bytes > 0 && sf.free_bytes < sf.data_bytes);
    CHECK(iomapfs_sync(vol) == 0);
    CHECK(iomapfs_file_close(f) == 0);
}

static void test_errors(iomapfs_volume *vol, const char *dir)
{
    iomapfs_file *f = NULL;
    char path[4096];
    CHECK_ERR(iomapfs_file_open(vol, "/nope", 0, &f), ENOENT, "/nope");
    CHECK(f == NULL);
    CHECK_ERR(iomapfs_file_open(vol, "/d/f", IOMAPFS_O_CREAT | IOMAPFS_O_EXCL, &f), EEXIST, "/d/f");
    CHECK_ERR(iomapfs_file_open(vol, "/d/f", 1u << 30, &f), EINVAL, "unknown open flags");
    CHECK_ERR(iomapfs_file_open(vol, NULL, 0, &f), EINVAL, "path is NULL");
    CHECK_ERR(iomapfs_file_open(vol, "/d", 0, &f), EISDIR, "/d");
    CHECK_ERR(iomapfs_mkdir(vol, "/d"), EEXIST, "/d");
    CHECK_ERR(iomapfs_rmdir(vol, "/d"), ENOTEMPTY, "/d");
    CHECK_ERR(iomapfs_unlink(vol, "/d"), EISDIR, "/d");
    CHECK_ERR(iomapfs_mkdir(vol, "/missing/x"), ENOENT, "/missing");

    CHECK(iomapfs_file_open(vol, "/d/f", IOMAPFS_O_RDONLY, &f) == 0);
    CHECK_ERR(iomapfs_pwrite(f, "x", 1, 0), EINVAL, "read-only");
    CHECK_ERR(iomapfs_fallocate(f, IOMAPFS_FALLOC_PUNCH_HOLE, 0, 4096), EOPNOTSUPP, "KEEP_SIZE");
    CHECK_ERR(iomapfs_pread(f, NULL, 10, 0), EINVAL, "buf is NULL");
    CHECK(iomapfs_pread(f, NULL, 0, 0) == 0);
    /* A volume with an open file refuses to close, and stays usable. */
    CHECK_ERR(iomapfs_volume_close(vol), EBUSY, "still open");
    CHECK(iomapfs_file_close(f) == 0);
    CHECK_ERR(iomapfs_file_close(f), EBADF, "not an open iomapfs file");
    CHECK_ERR(iomapfs_file_close(NULL), EINVAL, "NULL");

    snprintf(path, sizeof path, "%s/does-not-exist.img", dir);
    iomapfs_volume *v2 = NULL;
    CHECK_ERR(iomapfs_volume_open(path, NULL, &v2), ENOENT, "does-not-exist.img");
    iomapfs_volume_options bad = { .backend = 9, .cache_bytes = 0 };
    CHECK_ERR(iomapfs_volume_open(path, &bad, &v2), EINVAL, "backend 9");
    iomapfs_volume_options tiny = { .backend = 0, .cache_bytes = 4096 };
    CHECK_ERR(iomapfs_volume_open(path, &tiny, &v2), EINVAL, "cache_bytes 4096");
    /* Not iomapfs: a zeroed image. */
    snprintf(path, sizeof path, "%s/zero.img", dir);
    make_image(path, 16 << 20);
    CHECK_ERR(iomapfs_volume_open(path, NULL, &v2), EUCLEAN, "zero.img");
    CHECK(v2 == NULL);
    /* Messages are per thread and name the function. */
    CHECK(strncmp(iomapfs_last_error(), "iomapfs_volume_open: ", 21) == 0);
}

/* Non-direct files go through the volume's page cache (its size is the
 * volume option): writes leave dirty data there until fdatasync/fsync, or
 * not at all through an O_DSYNC handle; queued requests on such a file
 * go through the cache too. */
static void test_buffered(iomapfs_volume *vol)
{
    iomapfs_cache_info ci;
    iomapfs_file *f, *g;
    CHECK(iomapfs_sync(vol) == 0);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0);
    CHECK(ci.size_bytes == 16 << 20);
    CHECK(ci.dirty_bytes == 0);
    uint64_t used_before = ci.used_bytes;

    CHECK(iomapfs_file_open(vol, "/buffered", IOMAPFS_O_CREAT, &f) == 0);
    unsigned char out[3 * 4096 + 100], in[sizeof out];
    pattern(out, sizeof out, 7);
    CHECK(iomapfs_pwrite(f, out, sizeof out, 1000) == (int64_t)sizeof out);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0);
    CHECK(ci.dirty_bytes >= sizeof out);
    CHECK(ci.used_bytes >= used_before + sizeof out);
    CHECK(iomapfs_pread(f, in, sizeof in, 1000) == (int64_t)sizeof in);
    CHECK(memcmp(in, out, sizeof out) == 0);
    CHECK(iomapfs_fdatasync(f) == 0);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0);
    CHECK(ci.dirty_bytes == 0);
    CHECK(ci.used_bytes >= used_before + sizeof out); /* still cached, clean */

    CHECK(iomapfs_pwrite(f, out, 4096, 65536) == 4096);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0 && ci.dirty_bytes > 0);
    CHECK(iomapfs_fsync(f) == 0);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0 && ci.dirty_bytes == 0);

    /* O_DSYNC through the cache: durable, so clean, when the write returns. */
    CHECK(iomapfs_file_open(vol, "/buffered", IOMAPFS_O_DSYNC, &g) == 0);
    CHECK(iomapfs_pwrite(g, "dsync", 5, 30000) == 5);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0 && ci.dirty_bytes == 0);
    CHECK(iomapfs_pread(f, in, 5, 30000) == 5 && memcmp(in, "dsync", 5) == 0);
    CHECK(iomapfs_file_close(g) == 0);

    /* Queued requests on a buffered file: through the cache, on the worker. */
    iomapfs_queue *q;
    iomapfs_completion c[2];
    CHECK(iomapfs_queue_create(vol, 4, &q) == 0);
    CHECK(iomapfs_queue_write(q, f, out, 4096, 8192, 7) == 0);
    CHECK(iomapfs_queue_reap(q, 1, 2, c, -1) == 1);
    CHECK(c[0].token == 7 && c[0].result == 4096);
    CHECK(c[0].flags & IOMAPFS_COMPLETED_BY_WORKER);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0 && ci.dirty_bytes > 0);
    memset(in, 0, sizeof in);
    CHECK(iomapfs_queue_read(q, f, in, 4096, 8192, 8) == 0);
    CHECK(iomapfs_queue_reap(q, 1, 2, c, -1) == 1);
    CHECK(c[0].token == 8 && c[0].result == 4096 && memcmp(in, out, 4096) == 0);
    CHECK(iomapfs_queue_destroy(q) == 0);

    /* A file's drop_cache drops its clean data only (fadvise DONTNEED):
     * the dirty folio stays, and nothing is written back. */
    int64_t cached_before = iomapfs_file_cached_bytes(f);
    CHECK(cached_before >= 4 * 4096); /* at least the four places written */
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0);
    uint64_t dirty = ci.dirty_bytes;
    CHECK(iomapfs_file_drop_cache(f) == 0);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0 && ci.dirty_bytes == dirty);
    int64_t cached = iomapfs_file_cached_bytes(f);
    CHECK(cached > 0 && cached < cached_before);
    CHECK(iomapfs_pread(f, in, 4096, 8192) == 4096 && memcmp(in, out, 4096) == 0);

    /* The volume's drop_caches writes back and leaves nothing clean cached. */
    CHECK(iomapfs_drop_caches(vol) == 0);
    CHECK(iomapfs_volume_cache_info(vol, &ci) == 0 && ci.dirty_bytes == 0);
    CHECK(iomapfs_file_cached_bytes(f) == 0);
    CHECK(iomapfs_pread(f, in, 4096, 8192) == 4096 && memcmp(in, out, 4096) == 0);
    CHECK(iomapfs_file_cached_bytes(f) > 0); /* read through the cache */
    CHECK(iomapfs_file_close(f) == 0);
    CHECK_ERR(iomapfs_volume_cache_info(vol, NULL), EINVAL, "out is NULL");
}

#define DEPTH 8

static void test_async(iomapfs_volume *vol)
{
    iomapfs_queue *q;
    iomapfs_file *f;
    iomapfs_completion c[DEPTH * 2];
    CHECK_ERR(iomapfs_queue_create(vol, 0, &q), EINVAL, "depth 0");
    CHECK(iomapfs_queue_create(vol, DEPTH, &q) == 0);
    CHECK(iomapfs_file_open(vol, "/async", IOMAPFS_O_CREAT | IOMAPFS_O_DIRECT, &f) == 0);
    CHECK(iomapfs_fallocate(f, 0, 0, DEPTH * 4096) == 0);

    /* Zero-copy writes from queue buffers, one per request. */
    void *bufs[DEPTH];
    for (int i = 0; i < DEPTH; i++) {
        bufs[i] = iomapfs_queue_buf_alloc(q, 4096);
        CHECK(bufs[i] != NULL && ((uintptr_t)bufs[i] % 4096) == 0);
        pattern(bufs[i], 4096, 100 + i);
        CHECK(iomapfs_queue_write(q, f, bufs[i], 4096, (uint64_t)i * 4096, 1000 + i) == 0);
    }
    /* Lent buffers are checked: no second request, no free, no request
     * inside them. */
    CHECK_ERR(iomapfs_queue_write(q, f, bufs[0], 4096, 0, 1), EBUSY, "lent");
    CHECK_ERR(iomapfs_queue_read(q, f, (char *)bufs[1] + 512, 512, 0, 1), EBUSY, "lent");
    CHECK_ERR(iomapfs_queue_buf_free(q, bufs[2]), EBUSY, "lent");
    CHECK_ERR(iomapfs_queue_buf_free(q, c), EINVAL, "not a buffer of this queue");
    CHECK(iomapfs_queue_in_flight(q) == DEPTH);
    CHECK(iomapfs_queue_submit(q) >= 0);

    /* max below what is ready: the rest comes with the next reap. */
    int got = iomapfs_queue_reap(q, DEPTH, 3, c, -1);
    CHECK(got == -EINVAL); /* min > max */
    got = iomapfs_queue_reap(q, 3, 3, c, -1);
    CHECK(got == 3);
    int total = got;
    while (total < DEPTH) {
        got = iomapfs_queue_reap(q, 1, DEPTH * 2, c + total, -1);
        CHECK(got >= 1);
        total += got;
    }
    CHECK(iomapfs_queue_in_flight(q) == 0);
    unsigned seen = 0;
    for (int i = 0; i < DEPTH; i++) {
        int k = (int)(c[i].token - 1000);
        CHECK(k >= 0 && k < DEPTH && !(seen & (1u << k)));
        seen |= 1u << k;
        CHECK(c[i].result == 4096);
        CHECK(c[i].buf == bufs[k]); /* the caller's buffer comes back */
    }
    /* Reaped: the buffers are the caller's again. */
    CHECK(iomapfs_queue_buf_free(q, bufs[2]) == 0);
    bufs[2] = iomapfs_queue_buf_alloc(q, 4096);
    CHECK(bufs[2] != NULL);

    /* Reads into caller memory (bounced, unaligned), checked against the
     * synchronous path. */
    unsigned char *mem = malloc(DEPTH * 4096 + 1), *want = malloc(4096);
    CHECK(mem && want);
    for (int i = 0; i < DEPTH; i++)
        CHECK(iomapfs_queue_read(q, f, mem + 1 + i * 4096, 4096, (uint64_t)i * 4096, i) == 0);
    got = iomapfs_queue_reap(q, DEPTH, DEPTH * 2, c, -1);
    CHECK(got == DEPTH);
    for (int i = 0; i < DEPTH; i++) {
        CHECK(c[i].result == 4096);
        CHECK(c[i].buf == mem + 1 + c[i].token * 4096);
        pattern(want, 4096, 100 + (unsigned)c[i].token);
        CHECK(memcmp(mem + 1 + c[i].token * 4096, want, 4096) == 0);
    }
    /* Zero-copy read into a queue buffer, past EOF: short. */
    CHECK(iomapfs_queue_read(q, f, bufs[0], 4096, DEPTH * 4096 - 100, 77) == 0);
    CHECK(iomapfs_queue_reap(q, 1, 1, c, -1) == 1);
    CHECK(c[0].token == 77 && c[0].result == 100 && c[0].buf == bufs[0]);
    pattern(want, 4096, 100 + DEPTH - 1);
    CHECK(memcmp(bufs[0], want + 4096 - 100, 100) == 0);

    /* Nothing in flight: reaps return at once, whatever min and timeout. */
    CHECK(iomapfs_queue_reap(q, 0, DEPTH, c, 0) == 0);
    CHECK(iomapfs_queue_reap(q, 1, DEPTH, c, 1000000) == 0);
    CHECK(iomapfs_queue_reap(q, 1, DEPTH, c, -1) == 0);

    /* Writes that allocate and extend complete on the worker; a finite
     * timeout still gets them. */
    CHECK(iomapfs_queue_write(q, f, bufs[1], 4096, 1 << 20, 5) == 0);
    got = iomapfs_queue_reap(q, 1, 1, c, 5LL * 1000 * 1000 * 1000);
    CHECK(got == 1 && c[0].token == 5 && c[0].result == 4096);
    CHECK(c[0].flags & IOMAPFS_COMPLETED_BY_WORKER);
    iomapfs_stat st;
    CHECK(iomapfs_file_stat(f, &st) == 0 && st.size == (1 << 20) + 4096);

    /* A request that fails: its completion carries -errno, the message
     * says which. ENOSPC from a write larger than the volume. */
    size_t huge = 96u << 20;
    unsigned char *big = calloc(1, huge);
    CHECK(big);
    CHECK(iomapfs_queue_write(q, f, big, huge, 0, 99) == 0);
    got = iomapfs_queue_reap(q, 1, 1, c, -1);
    CHECK(got == 1 && c[0].token == 99 && c[0].result == -ENOSPC);
    CHECK(strstr(iomapfs_last_error(), "request 99") != NULL);
    CHECK(strstr(iomapfs_last_error(), "no space") != NULL);
    free(big);
    /* A refused request never enters the queue. */
    iomapfs_file *ro;
    CHECK(iomapfs_file_open(vol, "/async", IOMAPFS_O_RDONLY | IOMAPFS_O_DIRECT, &ro) == 0);
    CHECK_ERR(iomapfs_queue_write(q, ro, bufs[3], 4096, 0, 1), EINVAL, "read-only");
    CHECK(iomapfs_queue_in_flight(q) == 0);
    CHECK(iomapfs_queue_write(q, f, bufs[3], 8192, 0, 1) == -EINVAL); /* > buffer */
    CHECK(iomapfs_file_close(ro) == 0);

    /* Destroy with requests in flight: it waits for them. */
    for (int i = 0; i < 4; i++)
        CHECK(iomapfs_queue_write(q, f, bufs[4 + i], 4096, (uint64_t)i * 4096, i) == 0);
    CHECK(iomapfs_queue_submit(q) >= 0);
    CHECK_ERR(iomapfs_volume_close(vol), EBUSY, "still open");
    CHECK(iomapfs_queue_destroy(q) == 0);
    CHECK_ERR(iomapfs_queue_destroy(q), EBADF, "not an open iomapfs queue");
    CHECK(iomapfs_file_close(f) == 0);
    free(mem);
    free(want);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [sync|auto|uring]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    const char *backend = argc > 2 ? argv[2] : "sync";
    iomapfs_volume_options opts = { .backend = IOMAPFS_BACKEND_SYNC, .cache_bytes = 16 << 20 };
    if (strcmp(backend, "auto") == 0)
        opts.backend = IOMAPFS_BACKEND_AUTO;
    else if (strcmp(backend, "uring") == 0)
        opts.backend = IOMAPFS_BACKEND_URING;
    CHECK(strlen(iomapfs_version()) > 0);
    CHECK(strcmp(iomapfs_last_error(), "") == 0);

    char image[4096];
    snprintf(image, sizeof image, "%s/test.img", dir);
    make_image(image, 64 << 20);
    iomapfs_format_options fo = { .block_size = 4096, .journal_bytes = 0 };
    CHECK(iomapfs_format(image, &fo) == 0);
    iomapfs_volume *vol;
    CHECK(iomapfs_volume_open(image, &opts, &vol) == 0);
    test_sync(vol);
    test_errors(vol, dir);
    test_async(vol);
    test_buffered(vol);
    CHECK(iomapfs_volume_close(vol) == 0);
    CHECK_ERR(iomapfs_volume_close(vol), EBADF, "not an open iomapfs volume");

    /* Everything is still there after a remount. */
    CHECK(iomapfs_volume_open(image, &opts, &vol) == 0);
    iomapfs_file *f;
    char in[5];
    CHECK(iomapfs_file_open(vol, "/d/f", 0, &f) == 0);
    CHECK(iomapfs_pread(f, in, 5, 10) == 5 && memcmp(in, "hello", 5) == 0);
    iomapfs_stat st;
    CHECK(iomapfs_file_stat(f, &st) == 0 && st.size == 6000);
    CHECK(iomapfs_file_close(f) == 0);
    CHECK(iomapfs_path_stat(vol, "/async", &st) == 0 && st.size == (1 << 20) + 4096);
    CHECK(iomapfs_volume_close(vol) == 0);
    printf("test_api (%s backend): %d checks passed\n", backend, checks);
    return 0;
}
