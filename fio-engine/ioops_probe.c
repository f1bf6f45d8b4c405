/* Reports the loading fio's FIO_IOOPS_VERSION: fio refuses an engine whose version differs and says which it wants. */
struct probe_ops { void *next, *prev; const char *name; int version; int flags; void *hooks[64]; };
struct probe_ops ioengine = { .name = "iomapfs-ioops-probe", .version = -1 };
