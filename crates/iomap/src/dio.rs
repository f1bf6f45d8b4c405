//! Direct I/O. (in progress)
