//! Getting a converted file onto a device: `leanstream unpack` and `leanstream verify` (the same
//! check as `leanstream-prep verify`, so a device needs no prep binary), and the byte-count
//! progress bar they share with `leanstream-prep pack`.

pub mod progress;
pub mod unpack;
pub mod verify;
