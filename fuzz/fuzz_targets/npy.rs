#![no_main]
//! Fuzz target `npy`: see `tessera::fuzz_entry::npy` for the input layout and the contracts.

use libfuzzer_sys::fuzz_target;
use tessera::fuzz_entry::TrackingAlloc;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fuzz_target!(|data: &[u8]| tessera::fuzz_entry::npy(data));
