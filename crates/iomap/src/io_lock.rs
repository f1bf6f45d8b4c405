//! The inode's I/O lock and its in-flight direct-I/O counter.
//!
//! Pure overwrites hold the lock shared and run concurrently; anything that
//! allocates, converts, zeroes or changes the size holds it exclusive, and
//! first drains in-flight direct I/O (which, once asynchronous, may outlive
//! the shared lock that submitted it).
//! (TO BE IMPLEMENTED: see dio helper task.)
pub struct InodeIoLock;
