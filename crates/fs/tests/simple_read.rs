//! The simple-read fast path allocates nothing and sends one request.
//!
//! A counting global allocator sees every heap allocation of this test
//! binary; counts are per thread, so other tests running alongside cannot
//! disturb them.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use blockdev::{BlockDevice, MemDevice};
use iomapfs_fs::{FormatOptions, OpenFlags, Volume};

struct CountingAllocator;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// only addition is a thread-local counter, whose const initialiser needs no
// allocation (so the allocator cannot recurse into itself).
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

fn allocations() -> u64 {
    ALLOCATIONS.with(|c| c.get())
}

#[test]
fn simple_reads_allocate_nothing_and_send_one_request_each() {
    const BLOCK: u64 = 4096;
    let dev = Arc::new(MemDevice::new(16 << 20, 512));
    Volume::format(dev.clone(), &FormatOptions::default()).unwrap();
    let vol = Volume::open(dev.clone()).unwrap();
    let f = vol
        .open_file(
            "/data",
            OpenFlags {
                create: true,
                direct: true,
                ..OpenFlags::default()
            },
        )
        .unwrap();
    let data: Vec<u8> = (0..64 * BLOCK).map(|i| (i % 253) as u8).collect();
    f.pwrite(&data, 0).unwrap();
    f.fsync().unwrap();
    let mut buf = vec![0u8; BLOCK as usize];
    f.pread(&mut buf, 0).unwrap(); // warm-up: lazily initialised statics

    const READS: u64 = 1000;
    let before_requests = dev.counters().snapshot();
    let before = allocations();
    for i in 0..READS {
        let off = (i * 7 % 64) * BLOCK;
        let len = if i % 2 == 0 { BLOCK } else { 512 };
        let n = f.pread(&mut buf[..len as usize], off).unwrap();
        assert_eq!(n as u64, len);
    }
    let allocated = allocations() - before;
    let requests = dev.counters().snapshot().since(&before_requests);
    for i in 0..64u64 {
        f.pread(&mut buf, i * BLOCK).unwrap();
        assert_eq!(
            &buf[..],
            &data[(i * BLOCK) as usize..((i + 1) * BLOCK) as usize]
        );
    }
    assert_eq!(allocated, 0, "simple reads allocated {allocated} times");
    assert_eq!(requests.reads, READS, "one device request per read");

    // Control: the same one-block read down the generic path (a buffered
    // handle) is visible to the counter, so the zero above is not blind.
    let generic = vol.open_file("/data", OpenFlags::default()).unwrap();
    let before = allocations();
    generic.pread(&mut buf[..512], 100).unwrap();
    let generic_allocations = allocations() - before;
    println!("generic path: {generic_allocations} allocations");
    assert!(generic_allocations > 0);
}
