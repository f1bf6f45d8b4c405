//! Stopping a run early (Ctrl-C, SIGTERM, SIGHUP, or [`request_stop`]) without
//! leaving devices behind.
//!
//! While a run is in progress, SIGINT, SIGTERM and SIGHUP only set a flag
//! (the handler does nothing else: setting an atomic is async-signal-safe).
//! Measurement loops and waits poll the flag and return
//! [`crate::BenchError::Interrupted`]; the test bed's Drop guards then unmount,
//! detach and reset everything on the way out. The previous handlers are
//! restored when the last concurrent run ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

static STOP: AtomicBool = AtomicBool::new(false);

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

struct Installed {
    /// Runs currently holding a [`SignalGuard`].
    users: usize,
    /// Handlers to put back when `users` drops to 0.
    previous: Vec<(libc::c_int, libc::sigaction)>,
}

static INSTALLED: Mutex<Installed> = Mutex::new(Installed {
    users: 0,
    previous: Vec::new(),
});

extern "C" fn on_signal(_signal: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// True once a stop was requested during the current run(s).
pub fn stop_requested() -> bool {
    STOP.load(Ordering::Relaxed)
}

/// Asks every run in this process to stop as if Ctrl-C had been pressed: it
/// tears down its devices and returns [`crate::BenchError::Interrupted`].
/// Has no effect on runs that start afterwards.
pub fn request_stop() {
    STOP.store(true, Ordering::SeqCst);
}

/// Installs the flag-setting handlers for as long as it lives.
pub struct SignalGuard(());

impl SignalGuard {
    pub fn install() -> SignalGuard {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        if installed.users == 0 {
            STOP.store(false, Ordering::SeqCst);
            for &signal in &SIGNALS {
                // SAFETY: sigaction is plain data; all-zero is a valid
                // (empty) value that we then fill in. The handler only stores
                // to an atomic, which is async-signal-safe. SA_RESTART keeps
                // blocking calls in other code from failing with EINTR.
                unsafe {
                    let mut action: libc::sigaction = std::mem::zeroed();
                    action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                    action.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut action.sa_mask);
                    let mut old: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(signal, &action, &mut old) == 0 {
                        installed.previous.push((signal, old));
                    }
                }
            }
        }
        installed.users += 1;
        SignalGuard(())
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        installed.users -= 1;
        if installed.users == 0 {
            for (signal, old) in installed.previous.drain(..) {
                // SAFETY: `old` is exactly what sigaction returned for this
                // signal when we replaced it.
                unsafe {
                    libc::sigaction(signal, &old, std::ptr::null_mut());
                }
            }
        }
    }
}

/// Sleeps for `total`, waking early (with `true`) if a stop is requested or
/// `abort` becomes true.
pub fn sleep_unless_stopped(total: std::time::Duration, abort: &AtomicBool) -> bool {
    const TICK: std::time::Duration = std::time::Duration::from_millis(10);
    let deadline = std::time::Instant::now() + total;
    loop {
        if stop_requested() || abort.load(Ordering::Relaxed) {
            return true;
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return false;
        }
        std::thread::sleep(TICK.min(deadline - now));
    }
}
