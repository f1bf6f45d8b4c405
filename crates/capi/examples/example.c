/*
 * The README's C example: format an image file, write and read a file
 * synchronously and through a queue, close. Build (after `cargo build
 * --release -p iomapfs-capi`):
 *
 *   cc -O2 -I crates/capi/include crates/capi/examples/example.c \
 *      -L target/release -liomapfs -Wl,-rpath,$PWD/target/release -o example
 *   ./example vol.img
 */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "iomapfs.h"

static int fail(const char *what, long long err)
{
    fprintf(stderr, "%s: %s (%lld)\n", what, iomapfs_last_error(), err);
    return 1;
}

int main(int argc, char **argv)
{
    const char *image = argc > 1 ? argv[1] : "vol.img";
    int fd = open(image, O_RDWR | O_CREAT, 0644); /* a 64 MiB image file */
    if (fd < 0 || ftruncate(fd, 64 << 20) != 0)
        return perror(image), 1;
    close(fd);

    int err = iomapfs_format(image, NULL);
    if (err)
        return fail("format", err);
    iomapfs_volume *vol;
    iomapfs_volume_options opts = { .backend = IOMAPFS_BACKEND_AUTO, .cache_bytes = 0 };
    if ((err = iomapfs_volume_open(image, &opts, &vol)))
        return fail("open volume", err);

    iomapfs_file *f;
    if ((err = iomapfs_file_open(vol, "/log", IOMAPFS_O_CREAT | IOMAPFS_O_DIRECT, &f)))
        return fail("open /log", err);
    char block[4096];
    memset(block, 7, sizeof block);
    int64_t n = iomapfs_pwrite(f, block, sizeof block, 0);
    if (n != (int64_t)sizeof block)
        return fail("pwrite", n);
    if ((err = iomapfs_fdatasync(f)))
        return fail("fdatasync", err);

    /* Asynchronous: a queue per thread; a queue buffer is lent to its
     * request (zero-copy) until the completion is reaped. */
    iomapfs_queue *q;
    if ((err = iomapfs_queue_create(vol, 32, &q)))
        return fail("queue", err);
    void *buf = iomapfs_queue_buf_alloc(q, 4096);
    if (!buf)
        return fail("queue buffer", -1);
    if ((err = iomapfs_queue_read(q, f, buf, 4096, 0, /* token */ 7)))
        return fail("queue read", err);
    iomapfs_completion done[1];
    int got = iomapfs_queue_reap(q, 1, 1, done, -1); /* submits, waits for 1 */
    if (got != 1 || done[0].token != 7 || done[0].result != 4096)
        return fail("reap", got);
    printf("read %lld bytes, first byte %d, token %llu\n", (long long)done[0].result,
           ((unsigned char *)done[0].buf)[0], (unsigned long long)done[0].token);

    iomapfs_queue_destroy(q); /* frees its buffers too */
    iomapfs_file_close(f);
    if ((err = iomapfs_volume_close(vol)))
        return fail("close volume", err);
    return 0;
}
