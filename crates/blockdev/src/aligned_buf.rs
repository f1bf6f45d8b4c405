//! (in progress)
pub struct AlignedBuf;
