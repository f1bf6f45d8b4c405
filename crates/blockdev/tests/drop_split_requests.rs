//! A queue dropped while one piece of a split write is still in
//! the kernel must not free the buffer when another piece's completion is
//! reaped. The second piece's memory is registered with userfaultfd, so the
//! kernel blocks on it until the test resolves the fault; the buffer's
//! munmap shows as a UFFD_EVENT_UNMAP. Needs root (kernel-mode faults).

mod common;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use blockdev::{AlignedBuf, DeviceRequest, RequestLimits, UringDevice, UringOptions, WriteMode};
use blockdev::{BlockDevice, DeviceQueue, SyncOpenOptions};
use common::{image, initial};

const HALF: usize = 1 << 20;
const UFFD_API: u64 = 0xaa;
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_ZEROPAGE: libc::c_ulong = 0xc020_aa04;
const FEATURE_EVENT_UNMAP: u64 = 1 << 6;
const EVENT_PAGEFAULT: u8 = 0x12;
const EVENT_UNMAP: u8 = 0x16;
/// A wait for the kernel that takes longer than this is a failure, not a
/// hang of the test run.
const WATCHDOG: Duration = Duration::from_secs(60);

fn watchdog(started: Instant, waiting_for: &str) {
    assert!(
        started.elapsed() < WATCHDOG,
        "waited {WATCHDOG:?} for {waiting_for}"
    );
}

/// The next userfaultfd event, if one is waiting.
fn event(uffd: i32) -> Option<u8> {
    let mut msg = [0u8; 32];
    // SAFETY: reads at most 32 bytes into `msg`.
    let n = unsafe { libc::read(uffd, msg.as_mut_ptr().cast(), 32) };
    (n == 32).then_some(msg[0])
}

fn cqes_waiting(ring_fds: &[i32]) -> u64 {
    ring_fds
        .iter()
        .filter_map(|fd| std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok())
        .flat_map(|t| {
            t.lines()
                .filter_map(|l| {
                    l.strip_prefix("CQEs:")
                        .map(|v| v.trim().parse::<u64>().unwrap())
                })
                .collect::<Vec<_>>()
        })
        .sum()
}

fn ring_fds() -> Vec<i32> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|l| l.to_string_lossy().contains("io_uring"))
                .unwrap_or(false)
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

#[test]
fn drop_keeps_the_buffer_until_the_last_piece_completes() {
    // SAFETY: plain syscall, no memory passed.
    let uffd =
        unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) } as i32;
    if uffd < 0 {
        if std::env::var_os("IOMAPFS_REQUIRE_PRIVILEGED").is_some() {
            panic!("userfaultfd unavailable");
        }
        return eprintln!(
            "skipping: userfaultfd unavailable: {}",
            std::io::Error::last_os_error()
        );
    }
    let mut api = [UFFD_API, FEATURE_EVENT_UNMAP, 0u64];
    // SAFETY: struct uffdio_api is three u64s.
    assert_eq!(
        unsafe { libc::ioctl(uffd, UFFDIO_API, api.as_mut_ptr()) },
        0,
        "UFFDIO_API"
    );

    let img = image(4 << 20, initial);
    let limits = RequestLimits {
        max_bytes: Some(HALF),
        ..RequestLimits::NONE
    };
    let dev = Arc::new(
        UringDevice::open(
            img.path(),
            SyncOpenOptions::default(),
            UringOptions::default(),
        )
        .unwrap()
        .with_request_limits(limits),
    );
    let before = ring_fds();
    let mut q = dev.new_queue(4).unwrap();
    let rings: Vec<i32> = ring_fds()
        .into_iter()
        .filter(|fd| !before.contains(fd))
        .collect();
    assert!(!rings.is_empty());

    let mut buf = AlignedBuf::new_huge_pages(2 * HALF).unwrap();
    let second = buf.as_ptr() as u64 + HALF as u64;
    // SAFETY: advice on the buffer's own mapping.
    unsafe { libc::madvise(buf.as_mut_ptr().cast(), 2 * HALF, libc::MADV_NOHUGEPAGE) };
    buf[..HALF].fill(0xa5); // the first piece's pages are present
    let mut reg = [second, HALF as u64, 1 /* MISSING */, 0];
    // SAFETY: struct uffdio_register is four u64s; the range is the
    // untouched second half of the buffer's mapping.
    assert_eq!(
        unsafe { libc::ioctl(uffd, UFFDIO_REGISTER, reg.as_mut_ptr()) },
        0,
        "REGISTER"
    );

    q.push(
        7,
        DeviceRequest::Write {
            offset: 0,
            buf,
            mode: WriteMode::Normal,
        },
    )
    .unwrap();
    q.submit().unwrap();
    // The second piece is blocked on its missing page.
    let started = Instant::now();
    while event(uffd) != Some(EVENT_PAGEFAULT) {
        watchdog(started, "the second piece's page fault");
        std::hint::spin_loop();
    }
    // The first piece is done and its completion waits in the ring.
    let mut back = vec![0u8; HALF];
    let file = std::fs::File::open(img.path()).unwrap();
    let started = Instant::now();
    while cqes_waiting(&rings) == 0 {
        watchdog(started, "the first piece's completion");
        use std::os::unix::fs::FileExt;
        file.read_exact_at(&mut back, 0).unwrap(); // a syscall: runs task work
    }
    let (tid_tx, tid_rx) = mpsc::channel();
    let dropper = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tid_tx.send(unsafe { libc::gettid() }).unwrap();
        drop(q);
    });
    let tid = tid_rx.recv().unwrap();
    // Either the drop frees the buffer (munmap waits for us to read the
    // UNMAP event), or it reaps the first piece and waits in io_uring_enter
    // for the second.
    let started = Instant::now();
    let freed_early = loop {
        watchdog(started, "the dropped queue to free the buffer or wait");
        match event(uffd) {
            Some(EVENT_UNMAP) => break true,
            Some(other) => panic!("unexpected userfaultfd event {other:#x}"),
            None => {}
        }
        let syscall =
            std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).unwrap_or_default();
        if syscall.starts_with(&format!("{} ", libc::SYS_io_uring_enter))
            && cqes_waiting(&rings) == 0
        {
            break false;
        }
    };
    let mut zero = [second, HALF as u64, 0, 0];
    // SAFETY: struct uffdio_zeropage is four 64-bit fields.
    unsafe { libc::ioctl(uffd, UFFDIO_ZEROPAGE, zero.as_mut_ptr()) };
    // SAFETY: our descriptor; closing wakes any fault still waiting.
    unsafe { libc::close(uffd) };
    dropper.join().unwrap();
    assert!(
        !freed_early,
        "the dropped queue freed the buffer while a piece of its write was still in the kernel"
    );
    let mut whole = vec![0u8; 2 * HALF];
    dev.read_at(&mut whole, 0).unwrap();
    assert!(whole[..HALF].iter().all(|&b| b == 0xa5));
    assert!(whole[HALF..].iter().all(|&b| b == 0));
}
