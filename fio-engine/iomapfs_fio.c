// SPDX-License-Identifier: GPL-2.0-only
/*
 * iomapfs external ioengine for fio: a shim over libiomapfs (the C API).
 *
 * This file is built against fio's headers and is therefore GPL-2.0, like
 * fio (see COPYING in this directory); libiomapfs keeps its own licence.
 *
 *   fio --thread --ioengine=external:PATH/libiomapfs_fio.so \
 *       --iomapfs_volume=/dev/zram0 [--iomapfs_backend=auto|sync|uring|pool] \
 *       [--iomapfs_cache_size=256m] [--iomapfs_mkfs=1] --filename=/bench.dat ...
 *
 * Model:
 * - One mounted volume per process, shared by every job naming it (fio's
 *   jobs must be threads: `--thread`; forked jobs would mount it twice).
 *   It is unmounted when the last job using it ends.
 * - fio's files are iomapfs files (path relative to the volume's root).
 *   The engine is "diskless" to fio, so fio lays out no host file; the
 *   engine lays its files out itself, in fio's prepopulate step, by fio's
 *   own rules (extend_file in filesetup.c): for reads, and writes with
 *   overwrite=1, a file smaller than the job needs is rewritten whole with
 *   fio's buffer contents and fsynced (create_fsync); for other writes it
 *   is unlinked and created empty; allow_file_create=0 refuses to create.
 * - direct=1 jobs with iodepth > 1 go through an iomapfs queue (queue,
 *   commit, getevents, event); fio's I/O buffers are replaced by queue
 *   buffers at post_init, so requests are zero-copy. iodepth=1 and
 *   buffered (direct=0) jobs call pread/pwrite in ->queue (as psync).
 * - fsync=/fdatasync= (and end_fsync, fsync_on_close): iomapfs_fsync /
 *   iomapfs_fdatasync, after the job's requests in flight are reaped;
 *   sync=dsync / sync=1: files opened O_DSYNC / O_SYNC; trim: punch hole;
 *   invalidate=1 on a buffered job drops the file's clean cached data at
 *   open (fadvise DONTNEED on a kernel file system).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fio.h"
#include "optgroup.h"

#include "iomapfs.h"

/*
 * The installed fio checks this number when it loads the engine; the
 * Makefile asks that fio for its number (ioops_probe.c) and passes it in,
 * so building against another fio's source fails here, not at run time.
 */
#ifndef IOMAPFS_INSTALLED_FIO_IOOPS_VERSION
#error "build with fio-engine/Makefile: it passes the installed fio's FIO_IOOPS_VERSION"
#endif
#if FIO_IOOPS_VERSION != IOMAPFS_INSTALLED_FIO_IOOPS_VERSION
#error "the fio source's FIO_IOOPS_VERSION differs from the installed fio's: build against the source of the installed fio (apt-get source fio)"
#endif

struct iomapfs_fio_options {
	void *pad; /* fio: no option may sit at offset 0 */
	char *volume;
	char *backend;
	unsigned long long cache_size;
	unsigned int mkfs;
};

static struct fio_option options[] = {
	{
		.name	= "iomapfs_volume",
		.lname	= "iomapfs volume",
		.type	= FIO_OPT_STR_STORE,
		.off1	= offsetof(struct iomapfs_fio_options, volume),
		.help	= "Device or image file holding the iomapfs volume",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= "iomapfs_backend",
		.lname	= "iomapfs backend",
		.type	= FIO_OPT_STR_STORE,
		.off1	= offsetof(struct iomapfs_fio_options, backend),
		.help	= "Device backend: auto (default), sync, uring or pool",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= "iomapfs_cache_size",
		.lname	= "iomapfs page cache size",
		.type	= FIO_OPT_STR_VAL,
		.off1	= offsetof(struct iomapfs_fio_options, cache_size),
		.help	= "Page cache of buffered (direct=0) files; 0: the default",
		.def	= "0",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= "iomapfs_mkfs",
		.lname	= "iomapfs format first",
		.type	= FIO_OPT_BOOL,
		.off1	= offsetof(struct iomapfs_fio_options, mkfs),
		.help	= "Format the volume when this fio run first mounts it",
		.def	= "0",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= NULL,
	},
};

/* A mounted volume, shared by the jobs (threads) of this process. */
struct mounted {
	struct mounted *next;
	char *path;
	iomapfs_volume *vol;
	int users; /* jobs between ->init and ->cleanup */
};

static pthread_mutex_t mounted_lock = PTHREAD_MUTEX_INITIALIZER;
static struct mounted *mounted_list;
/* Volumes this process formatted already (iomapfs_mkfs=1 formats once). */
static char *formatted[64];
static int nformatted;

/* Per job. */
struct iomapfs_data {
	struct mounted *m;
	iomapfs_queue *q;		/* NULL: synchronous I/O in ->queue */
	struct io_u **events;		/* filled by ->getevents */
	iomapfs_completion *comps;
	iomapfs_completion *stash;	/* reaped early (before a sync) */
	unsigned int nstash;
	struct io_u **queued;		/* queued since the last ->commit */
	unsigned int nqueued;
	unsigned int depth;
};

static void say_error(struct thread_data *td, int err, const char *what)
{
	log_err("iomapfs: %s: %s\n", what, iomapfs_last_error());
	td_verror(td, err, what);
}

static int check_threads(struct thread_data *td)
{
	if (!td->o.use_thread) {
		log_err("iomapfs: jobs must be threads (--thread): they share one mounted volume "
			"per process, and forked jobs would mount it twice\n");
		td_verror(td, EINVAL, "iomapfs needs thread=1");
		return 1;
	}
	return 0;
}

static int backend_code(const char *name, uint32_t *out)
{
	if (!name || !strcmp(name, "auto"))
		*out = IOMAPFS_BACKEND_AUTO;
	else if (!strcmp(name, "sync"))
		*out = IOMAPFS_BACKEND_SYNC;
	else if (!strcmp(name, "uring"))
		*out = IOMAPFS_BACKEND_URING;
	else if (!strcmp(name, "pool"))
		*out = IOMAPFS_BACKEND_POOL;
	else
		return 1;
	return 0;
}

/*
 * The job's volume, mounted (and formatted, with iomapfs_mkfs=1) on first
 * use. With `hold`, the job holds it from here to put_volume() (counted in
 * the same critical section that finds it: another job's last put may
 * unmount and free it as soon as the lock is released). Without, the
 * caller uses it only while nothing can unmount it: fio's setup in the
 * main thread before any job runs, or a job thread that holds it already.
 */
static struct mounted *get_volume(struct thread_data *td, int hold)
{
	struct iomapfs_fio_options *o = td->eo;
	iomapfs_volume_options vo = { 0 };
	struct mounted *m;
	int err, i, done = 0;

	if (check_threads(td))
		return NULL;
	if (!o || !o->volume || !o->volume[0]) {
		log_err("iomapfs: iomapfs_volume= is required (the device or image file)\n");
		td_verror(td, EINVAL, "iomapfs_volume");
		return NULL;
	}
	if (backend_code(o->backend, &vo.backend)) {
		log_err("iomapfs: iomapfs_backend=%s: use auto, sync, uring or pool\n", o->backend);
		td_verror(td, EINVAL, "iomapfs_backend");
		return NULL;
	}
	vo.cache_bytes = o->cache_size;

	pthread_mutex_lock(&mounted_lock);
	for (m = mounted_list; m; m = m->next)
		if (!strcmp(m->path, o->volume))
			goto out;
	if (o->mkfs) {
		for (i = 0; i < nformatted; i++)
			done |= !strcmp(formatted[i], o->volume);
		if (!done) {
			err = iomapfs_format(o->volume, NULL);
			if (err) {
				say_error(td, -err, "iomapfs_format");
				goto out;
			}
			if (nformatted < (int)(sizeof(formatted) / sizeof(formatted[0])))
				formatted[nformatted++] = strdup(o->volume);
		}
	}
	m = calloc(1, sizeof(*m));
	if (!m) {
		td_verror(td, ENOMEM, "calloc");
		goto out;
	}
	err = iomapfs_volume_open(o->volume, &vo, &m->vol);
	if (err) {
		say_error(td, -err, "iomapfs_volume_open");
		free(m);
		m = NULL;
		goto out;
	}
	m->path = strdup(o->volume);
	m->next = mounted_list;
	mounted_list = m;
out:
	if (m && hold)
		m->users++;
	pthread_mutex_unlock(&mounted_lock);
	return m;
}

/* Unmounts `m` if no job holds it. Call with mounted_lock held. */
static void put_volume_locked(struct mounted *m)
{
	struct mounted **p;
	int err;

	if (m->users > 0)
		return;
	err = iomapfs_volume_close(m->vol);
	if (err == -EBUSY)
		return; /* a file is still open: the last close unmounts */
	if (err)
		log_err("iomapfs: unmount %s: %s\n", m->path, iomapfs_last_error());
	for (p = &mounted_list; *p; p = &(*p)->next)
		if (*p == m) {
			*p = m->next;
			break;
		}
	free(m->path);
	free(m);
}

/* fio's file name as an iomapfs path (relative names are under the root). */
static const char *iomapfs_path(struct fio_file *f, char *buf, size_t len)
{
	if (f->file_name[0] == '/')
		return f->file_name;
	snprintf(buf, len, "/%s", f->file_name);
	return buf;
}

static int fio_iomapfs_get_file_size(struct thread_data *td, struct fio_file *f)
{
	struct mounted *m = get_volume(td, 0);
	iomapfs_stat st;
	char path[PATH_MAX];
	int err;

	if (!m)
		return 1;
	err = iomapfs_path_stat(m->vol, iomapfs_path(f, path, sizeof(path)), &st);
	if (err == -ENOENT)
		f->real_file_size = 0;
	else if (err) {
		say_error(td, -err, "iomapfs_path_stat");
		return 1;
	} else
		f->real_file_size = st.size;
	fio_file_set_size_known(f);
	return 0;
}

/*
 * Lays the file out as fio's extend_file() would for a kernel file
 * system: see the top of this file. fio calls this once per job and file,
 * before any I/O (serially, with the default create_serialize=1).
 */
static int fio_iomapfs_prepopulate_file(struct thread_data *td, struct fio_file *f)
{
	struct mounted *m = get_volume(td, 0);
	const uint64_t want = f->io_size + f->file_offset;
	int new_layout, unlink_file, err, ret = 1;
	iomapfs_file *file = NULL;
	uint32_t flags = IOMAPFS_O_DIRECT;
	unsigned long long left, off, chunk;
	char path[PATH_MAX];
	const char *p;
	iomapfs_stat st;
	void *b = NULL;

	if (!m)
		return 1;
	p = iomapfs_path(f, path, sizeof(path));
	err = iomapfs_path_stat(m->vol, p, &st);
	if (err && err != -ENOENT) {
		say_error(td, -err, "iomapfs_path_stat");
		return 1;
	}
	if (!err && st.size >= want) {
		f->real_file_size = st.size;
		return 0;
	}
	if (read_only) {
		log_err("fio: refusing extend of file due to read-only\n");
		return 0;
	}
	new_layout = td_read(td) || (td_write(td) && td->o.overwrite && !td->o.file_append);
	unlink_file = td_write(td) && !td->o.overwrite && !td->o.file_append;
	if (unlink_file || new_layout) {
		err = iomapfs_unlink(m->vol, p);
		if (err && err != -ENOENT) {
			say_error(td, -err, "iomapfs_unlink");
			return 1;
		}
	}
	if (td->o.allow_create)
		flags |= IOMAPFS_O_CREAT;
	if (new_layout)
		flags |= IOMAPFS_O_TRUNC;
	err = iomapfs_file_open(m->vol, p, flags, &file);
	if (err) {
		if (err == -ENOENT && !td->o.allow_create) {
			log_err("fio: file creation disallowed by allow_file_create=0\n");
			td_verror(td, ENOENT, "open");
		} else
			say_error(td, -err, "iomapfs_file_open");
		return 1;
	}
	if (!new_layout) {
		/* As fio does: the size the job needs, which its writes fill. */
		f->real_file_size = want;
		ret = 0;
		goto out;
	}

	log_info("%s: laying out %s on iomapfs (%lluMiB)\n", td->o.name, p,
		 (unsigned long long)(want >> 20));
	err = iomapfs_truncate(file, want);
	if (err) {
		say_error(td, -err, "iomapfs_truncate");
		goto out;
	}
	chunk = 1 << 20;
	if (posix_memalign(&b, 4096, chunk)) {
		td_verror(td, ENOMEM, "posix_memalign");
		goto out;
	}
	for (off = 0, left = want; left && !td->terminate; off += chunk, left -= chunk) {
		int64_t n;

		if (chunk > left)
			chunk = left;
		fill_io_buffer(td, b, chunk, chunk);
		n = iomapfs_pwrite(file, b, chunk, off);
		if (n != (int64_t)chunk) {
			if (n == -ENOSPC)
				log_info("fio: ENOSPC on laying out file, stopping\n");
			say_error(td, n < 0 ? (int)-n : EIO, "iomapfs_pwrite (layout)");
			goto out;
		}
	}
	if (td->terminate) {
		iomapfs_unlink(m->vol, p);
		goto out;
	}
	if (td->o.create_fsync && (err = iomapfs_fsync(file))) {
		say_error(td, -err, "iomapfs_fsync (layout)");
		goto out;
	}
	f->real_file_size = want;
	ret = 0;
out:
	free(b);
	iomapfs_file_close(file);
	return ret;
}

static int fio_iomapfs_open_file(struct thread_data *td, struct fio_file *f)
{
	struct iomapfs_data *d = td->io_ops_data;
	uint32_t flags = 0;
	iomapfs_file *file;
	char path[PATH_MAX];
	int err;

	if (td->o.odirect)
		flags |= IOMAPFS_O_DIRECT;
	if (td->o.sync_io == O_DSYNC)
		flags |= IOMAPFS_O_DSYNC;
	else if (td->o.sync_io)
		flags |= IOMAPFS_O_SYNC;
	if (td->o.allow_create)
		flags |= IOMAPFS_O_CREAT;
	if (!td_write(td) && !td_trim(td))
		flags |= IOMAPFS_O_RDONLY;
	err = iomapfs_file_open(d->m->vol, iomapfs_path(f, path, sizeof(path)), flags, &file);
	if (err) {
		say_error(td, -err, "iomapfs_file_open");
		return 1;
	}
	f->engine_data = file;
	if (td->o.invalidate_cache && !td->o.odirect) {
		/* As fio does on a kernel file system: fadvise(DONTNEED) of the file. */
		err = iomapfs_file_drop_cache(file);
		if (err) {
			say_error(td, -err, "iomapfs_file_drop_cache (invalidate)");
			return 1;
		}
	}
	return 0;
}

static int fio_iomapfs_close_file(struct thread_data *td, struct fio_file *f)
{
	iomapfs_file *file = f->engine_data;
	int err, ret = 0;

	if (!file)
		return 0;
	if (td->o.fsync_on_close && (err = iomapfs_fsync(file))) {
		say_error(td, -err, "iomapfs_fsync (fsync_on_close)");
		ret = -err;
	}
	err = iomapfs_file_close(file);
	if (err && !ret) {
		say_error(td, -err, "iomapfs_file_close");
		ret = -err;
	}
	f->engine_data = NULL;
	return ret;
}

static int fio_iomapfs_unlink_file(struct thread_data *td, struct fio_file *f)
{
	struct mounted *m = get_volume(td, 0);
	char path[PATH_MAX];
	int err;

	if (!m)
		return EINVAL;
	err = iomapfs_unlink(m->vol, iomapfs_path(f, path, sizeof(path)));
	if (err && err != -ENOENT)
		log_err("iomapfs: iomapfs_unlink: %s\n", iomapfs_last_error());
	return -err;
}

/* Hands a completion to fio. */
static void complete(struct thread_data *td, const iomapfs_completion *c, struct io_u **slot)
{
	struct io_u *io_u = (struct io_u *)(uintptr_t)c->token;

	if (c->result < 0) {
		io_u->error = (int)-c->result;
		log_err("iomapfs: %s\n", iomapfs_last_error());
	} else
		io_u->resid = io_u->xfer_buflen - (unsigned long long)c->result;
	*slot = io_u;
	(void)td;
}

/* Reaps every request in flight into the stash (before a sync or trim). */
static int drain(struct thread_data *td, struct iomapfs_data *d)
{
	int n;

	if (!d->q)
		return 0;
	while (iomapfs_queue_in_flight(d->q) > 0 && d->nstash < d->depth) {
		n = iomapfs_queue_reap(d->q, 1, d->depth - d->nstash, d->stash + d->nstash, -1);
		if (n < 0) {
			say_error(td, -n, "iomapfs_queue_reap");
			return n;
		}
		d->nstash += n;
	}
	return 0;
}

static void set_issue_time(struct thread_data *td, struct io_u *io_u)
{
	if (fio_fill_issue_time(td))
		fio_gettime(&io_u->issue_time, NULL);
}

static enum fio_q_status fio_iomapfs_queue(struct thread_data *td, struct io_u *io_u)
{
	struct iomapfs_data *d = td->io_ops_data;
	iomapfs_file *file = io_u->file->engine_data;
	int64_t n;
	int err;

	fio_ro_check(td, io_u);

	if (io_u->ddir == DDIR_SYNC || io_u->ddir == DDIR_DATASYNC || io_u->ddir == DDIR_TRIM) {
		/* What was written before must be covered: reap it first. */
		if (drain(td, d)) {
			io_u->error = EIO;
			return FIO_Q_COMPLETED;
		}
		set_issue_time(td, io_u);
		if (io_u->ddir == DDIR_SYNC)
			err = iomapfs_fsync(file);
		else if (io_u->ddir == DDIR_DATASYNC)
			err = iomapfs_fdatasync(file);
		else
			err = iomapfs_fallocate(file,
						IOMAPFS_FALLOC_PUNCH_HOLE | IOMAPFS_FALLOC_KEEP_SIZE,
						io_u->offset, io_u->xfer_buflen);
		if (err) {
			io_u->error = -err;
			log_err("iomapfs: %s\n", iomapfs_last_error());
		}
		return FIO_Q_COMPLETED;
	}
	if (!ddir_rw(io_u->ddir)) {
		io_u->error = EINVAL;
		return FIO_Q_COMPLETED;
	}

	if (!d->q) {
		set_issue_time(td, io_u);
		if (io_u->ddir == DDIR_READ)
			n = iomapfs_pread(file, io_u->xfer_buf, io_u->xfer_buflen, io_u->offset);
		else
			n = iomapfs_pwrite(file, io_u->xfer_buf, io_u->xfer_buflen, io_u->offset);
		if (n < 0) {
			io_u->error = (int)-n;
			log_err("iomapfs: %s\n", iomapfs_last_error());
		} else
			io_u->resid = io_u->xfer_buflen - (unsigned long long)n;
		return FIO_Q_COMPLETED;
	}

	if (io_u->ddir == DDIR_READ)
		err = iomapfs_queue_read(d->q, file, io_u->xfer_buf, io_u->xfer_buflen,
					 io_u->offset, (uint64_t)(uintptr_t)io_u);
	else
		err = iomapfs_queue_write(d->q, file, io_u->xfer_buf, io_u->xfer_buflen,
					  io_u->offset, (uint64_t)(uintptr_t)io_u);
	if (err) {
		set_issue_time(td, io_u);
		io_u->error = -err;
		log_err("iomapfs: %s\n", iomapfs_last_error());
		return FIO_Q_COMPLETED;
	}
	d->queued[d->nqueued++] = io_u;
	return FIO_Q_QUEUED;
}

static int fio_iomapfs_commit(struct thread_data *td)
{
	struct iomapfs_data *d = td->io_ops_data;
	struct timespec now;
	unsigned int i;
	int err;

	if (!d->q || !d->nqueued)
		return 0;
	err = iomapfs_queue_submit(d->q);
	if (err < 0) {
		say_error(td, -err, "iomapfs_queue_submit");
		return err;
	}
	if (fio_fill_issue_time(td)) {
		fio_gettime(&now, NULL);
		for (i = 0; i < d->nqueued; i++) {
			memcpy(&d->queued[i]->issue_time, &now, sizeof(now));
			io_u_queued(td, d->queued[i]);
		}
	}
	io_u_mark_submit(td, d->nqueued);
	d->nqueued = 0;
	return 0;
}

static int fio_iomapfs_getevents(struct thread_data *td, unsigned int min, unsigned int max,
				 const struct timespec *t)
{
	struct iomapfs_data *d = td->io_ops_data;
	unsigned int n = 0, i;
	int64_t timeout = -1;
	int got;

	while (d->nstash && n < max) {
		complete(td, &d->stash[0], &d->events[n++]);
		memmove(d->stash, d->stash + 1, --d->nstash * sizeof(d->stash[0]));
	}
	if (!d->q || n >= max)
		return n;
	if (t)
		timeout = (int64_t)t->tv_sec * 1000000000LL + t->tv_nsec;
	got = iomapfs_queue_reap(d->q, min > n ? min - n : 0, max - n, d->comps, timeout);
	if (got < 0) {
		say_error(td, -got, "iomapfs_queue_reap");
		return got;
	}
	for (i = 0; i < (unsigned int)got; i++)
		complete(td, &d->comps[i], &d->events[n++]);
	return n;
}

static struct io_u *fio_iomapfs_event(struct thread_data *td, int event)
{
	struct iomapfs_data *d = td->io_ops_data;

	return d->events[event];
}

/* Ends the job's hold on `m` (from get_volume(td, 1)); the last unmounts. */
static void put_volume(struct mounted *m)
{
	pthread_mutex_lock(&mounted_lock);
	m->users--;
	put_volume_locked(m);
	pthread_mutex_unlock(&mounted_lock);
}

/* Frees the job's data and ends its hold on the volume. */
static void free_data(struct iomapfs_data *d)
{
	if (d->m)
		put_volume(d->m);
	free(d->events);
	free(d->comps);
	free(d->stash);
	free(d->queued);
	free(d);
}

static int fio_iomapfs_init(struct thread_data *td)
{
	struct iomapfs_data *d;
	struct mounted *m = get_volume(td, 1);
	int err;

	if (!m)
		return 1;
	d = calloc(1, sizeof(*d));
	if (!d) {
		put_volume(m);
		return 1;
	}
	d->m = m;
	d->depth = td->o.iodepth ? td->o.iodepth : 1;
	d->events = calloc(d->depth, sizeof(*d->events));
	d->comps = calloc(d->depth, sizeof(*d->comps));
	d->stash = calloc(d->depth, sizeof(*d->stash));
	d->queued = calloc(d->depth, sizeof(*d->queued));
	if (!d->events || !d->comps || !d->stash || !d->queued) {
		free_data(d);
		return 1;
	}
	if (td->o.odirect && d->depth > 1) {
		err = iomapfs_queue_create(m->vol, d->depth, &d->q);
		if (err) {
			say_error(td, -err, "iomapfs_queue_create");
			free_data(d);
			return 1;
		}
	}
	td->io_ops_data = d;
	return 0;
}

/*
 * Replaces fio's I/O buffers with queue buffers (same contents), so that
 * queued requests are lent to the device without a copy. fio sets
 * io_u->buf before this hook and reads it afterwards (fill, verify).
 */
static int fio_iomapfs_post_init(struct thread_data *td)
{
	struct iomapfs_data *d = td->io_ops_data;
	unsigned long long max_bs = td_max_bs(td);
	struct io_u *io_u;
	void *buf;
	int i;

	if (!d->q || !max_bs)
		return 0;
	io_u_qiter(&td->io_u_all, io_u, i) {
		if (!io_u->buf)
			continue;
		buf = iomapfs_queue_buf_alloc(d->q, max_bs);
		if (!buf) {
			say_error(td, ENOMEM, "iomapfs_queue_buf_alloc");
			return 1;
		}
		memcpy(buf, io_u->buf, max_bs);
		io_u->buf = buf;
	}
	return 0;
}

static void fio_iomapfs_cleanup(struct thread_data *td)
{
	struct iomapfs_data *d = td->io_ops_data;
	int err;

	if (!d)
		return;
	if (d->q && (err = iomapfs_queue_destroy(d->q)))
		log_err("iomapfs: iomapfs_queue_destroy: %s\n", iomapfs_last_error());
	free_data(d);
	td->io_ops_data = NULL;
}

/* At unload or exit: volumes mounted by fio's setup but never used by a job. */
static void __attribute__((destructor)) unmount_leftovers(void)
{
	int i;

	pthread_mutex_lock(&mounted_lock);
	while (mounted_list) {
		struct mounted *m = mounted_list;

		m->users = 0;
		put_volume_locked(m);
		if (mounted_list == m) /* busy: leave it to the process exit */
			break;
	}
	for (i = 0; i < nformatted; i++)
		free(formatted[i]);
	nformatted = 0;
	pthread_mutex_unlock(&mounted_lock);
}

struct ioengine_ops ioengine = {
	.name			= "iomapfs",
	.version		= FIO_IOOPS_VERSION,
	.flags			= FIO_DISKLESSIO | FIO_NODISKUTIL | FIO_ASYNCIO_SETS_ISSUE_TIME,
	.init			= fio_iomapfs_init,
	.post_init		= fio_iomapfs_post_init,
	.queue			= fio_iomapfs_queue,
	.commit			= fio_iomapfs_commit,
	.getevents		= fio_iomapfs_getevents,
	.event			= fio_iomapfs_event,
	.cleanup		= fio_iomapfs_cleanup,
	.open_file		= fio_iomapfs_open_file,
	.close_file		= fio_iomapfs_close_file,
	.unlink_file		= fio_iomapfs_unlink_file,
	.get_file_size		= fio_iomapfs_get_file_size,
	.prepopulate_file	= fio_iomapfs_prepopulate_file,
	.options		= options,
	.option_struct_size	= sizeof(struct iomapfs_fio_options),
};
